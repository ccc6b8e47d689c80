"""The decoder-layer families in C (engine/library/families.py, engine/library/decoder.py), on tiny random-weight GGUFs
of each family (tests/support/tinymodels.py) loaded as a user's file is."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support import tinymodels
from tests.support.caches import Caches
from tests.support.engines import collect, prompt_of
from ttft_sse.engine.base import SamplingParams, Usage
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.library import families, stack
from ttft_sse.engine.library import in_place as places
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

torch = pytest.importorskip("torch")


def uncached(usage: Usage) -> Usage:
    """A usage less its cached tokens: the engines compared keep different prefix caches."""
    return replace(usage, cached_tokens=0)


pytest.importorskip("gguf")

FUSED = ("qwen2", "qwen3", "gemma3")
LAYERS = {"qwen2": 2, "qwen3": 2, "gemma3": 6}
# Longer than the tiny Gemma 3's sliding window (a character a token), so its sliding layers drop keys.
PROMPTS = (
    "tell me a story about a dragon who could fly",
    "what is the capital of france? paris is.",
    "hello world, how are you?",
    "write a short answer: why is it so?",
)
assert all(len(p) > 2 * tinymodels.GEMMA3_WINDOW for p in PROMPTS)
SHORT = ("hi", "paris?")  # within the window, with the special tokens


@pytest.fixture(scope="module")
def gguf_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("family-ggufs")
    return lambda family: tinymodels.build_gguf(family, root)


@pytest.fixture(scope="module")
def family_settings(
    gguf_of: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory, fresh_cache: Caches
) -> Callable[..., Any]:
    cache = fresh_cache(tmp_path_factory.mktemp("family-cache"))

    def make(family: str, **changes: Any) -> Settings:
        base = Settings(model=str(gguf_of(family)), cache_dir=cache, threads=1, prefill_process=False)
        return base.replace(**changes)

    return make


@pytest.fixture(scope="module")
def singles(family_settings: Callable[..., Settings]) -> Iterator[Callable[..., tuple[SingleEngine, list[Any]]]]:
    """``singles(family, fused)``: the single engine on that family's GGUF, with or without the C layers, loaded
    once, and its load's log."""
    made: dict[tuple[str, bool], tuple[SingleEngine, list[Any]]] = {}

    def get(family: str, fused: bool = True) -> tuple[SingleEngine, list[Any]]:
        if (family, fused) not in made:
            engine = SingleEngine(family_settings(family, fused_layers=fused))
            with capture_logs() as logs:
                engine.load(StageClock())
            made[family, fused] = (engine, logs)
        return made[family, fused]

    yield get


@pytest.mark.parametrize("family", FUSED)
def test_every_decoder_layer_of_the_family_runs_in_c_and_the_log_and_readyz_label_say_so(
    singles: Callable[..., tuple[SingleEngine, list[Any]]], family: str
) -> None:
    engine, logs = singles(family)
    layers = list(engine.model.model.layers)
    n = LAYERS[family]
    assert len(layers) == n and all(isinstance(layer, families.FusedLayer) for layer in layers)
    assert all(layer.family.name == family for layer in layers)
    event = {"event": "decoder_fused", "log_level": "info", "family": family, "layers": n, "of": n, "one_call": True}
    assert event in logs  # the load probe against the family's own layer passed
    assert engine.info.decoder == f"fused: {n} of {n} layers"
    assert engine.info.weights == "gguf-blocks"


@pytest.mark.parametrize("family", FUSED)
def test_the_fused_layers_give_the_family_layers_logits_within_roundings(
    singles: Callable[..., tuple[SingleEngine, list[Any]]], family: str
) -> None:
    """Every position's logits of a prompt at once and then token by token on a cache, with the C layers and with
    the library's own layers of the family swapped back in (the same modules, the same weights)."""
    engine, _ = singles(family)
    model = engine.model
    ids = engine.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    import transformers

    def logits() -> tuple[Any, Any]:
        whole = model(ids).logits[0]
        cache = transformers.DynamicCache(config=model.config)
        steps = [model(ids[:, :5], cache=cache).logits[0]]
        steps += [model(ids[:, i : i + 1], cache=cache).logits[0] for i in range(5, ids.shape[1])]
        return whole, torch.cat(steps)

    layers = list(model.model.layers)
    fused = [type(layer) for layer in layers]
    with torch.inference_mode():
        got = logits()
        for layer in layers:
            layer.__class__ = layer.family.classes()[0]
        try:
            want = logits()
        finally:
            for layer, kind in zip(layers, fused, strict=True):
                layer.__class__ = kind
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= 1e-4 * float(w.abs().max())
        assert torch.equal(g.argmax(-1), w.argmax(-1))


@pytest.mark.parametrize("family", FUSED)
async def test_the_fused_engines_greedy_answer_is_the_unfused_engines(
    singles: Callable[..., tuple[SingleEngine, list[Any]]], family: str
) -> None:
    """The reference: the same GGUF on the same block kernel with the family's layers in transformers' Python
    (``TTFT_FUSED_LAYERS=false``). For Gemma 3 the prompts and answers are longer than its sliding window."""
    fused, _ = singles(family)
    plain, _ = singles(family, fused=False)
    assert fused.info.decoder.startswith("fused")
    assert plain.info.decoder == "not fused (TTFT_FUSED_LAYERS=false); each layer runs in transformers' Python"
    params = SamplingParams(max_tokens=24)
    for prompt in PROMPTS:
        got = await collect(fused.stream(prompt_of(fused, prompt), params))
        want = await collect(plain.stream(prompt_of(plain, prompt), params))
        assert got[0] == want[0] and replace(got[1].usage, cached_tokens=0) == replace(
            want[1].usage, cached_tokens=0
        ), prompt
        assert want[1].usage.completion_tokens == 24


@pytest.mark.parametrize("family", FUSED)
async def test_concurrent_requests_on_the_batched_engine_each_get_the_text_they_get_alone(
    family_settings: Callable[..., Settings],
    singles: Callable[..., tuple[SingleEngine, list[Any]]],
    family: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer runs in one C call over the paged cache read in place (``ttft_decoder_stack``). Gemma 3's
    sliding-window layers are read in place too where writing first loses nothing (its decode steps); its prompts,
    longer than the tiny model's window, wrap around the ring, and those steps take the library's reading and
    attention for the sliding layers; each answer is the same alone or together. Prompts within the window are
    read in place at every step, as the single engine's dense cache attends through the same C function: the same
    answers as the single engine, bit for bit, after their decode steps have wrapped the ring twice."""
    engine = BatchedEngine(family_settings(family))
    engine.load(StageClock())
    single, _ = singles(family)
    stacked: list[int] = []
    windows: list[bool] = []
    run_layers, window_index = stack.run_layers, places.window_index

    def spy(*arguments: Any, **named: Any) -> Any:
        stacked.append(1)
        return run_layers(*arguments, **named)

    def seen(*arguments: Any) -> Any:
        found = window_index(*arguments)
        windows.append(found is not None)
        return found

    monkeypatch.setattr(stack, "run_layers", spy)
    monkeypatch.setattr(places, "window_index", seen)
    try:
        assert engine.info.decoder == f"fused: {LAYERS[family]} of {LAYERS[family]} layers"
        params = SamplingParams(max_tokens=20)
        alone = [await collect(engine.stream(prompt_of(engine, p), params)) for p in PROMPTS]
        together = await asyncio.gather(*(collect(engine.stream(prompt_of(engine, p), params)) for p in PROMPTS))
        # Together, the prompts are found in the cache the requests alone left: the same usage less cached tokens.
        assert [(t, uncached(f.usage)) for t, f in together] == [(t, uncached(f.usage)) for t, f in alone]
        for prompt in SHORT:
            got = await collect(engine.stream(prompt_of(engine, prompt), params))
            want = await collect(single.stream(prompt_of(single, prompt), params))
            assert (got[0], uncached(got[1].usage)) == (want[0], want[1].usage), prompt
            assert got[1].usage.prompt_tokens <= tinymodels.GEMMA3_WINDOW
        assert all(f.usage.completion_tokens == 20 for _, f in alone)
        assert stacked
        # Gemma 3: in place at every decode step, the library's reading for the prompts that wrap the ring.
        assert (True in windows, False in windows) == ((True, True) if family == "gemma3" else (False, False))
    finally:
        await engine.close()


def test_a_sliding_window_step_reads_in_place_only_where_writing_first_overwrites_nothing_it_reads() -> None:
    """The library's ring of a window of 4 (one page of 4 rows at 8..11): its read index lists a request's cached
    rows, then a placeholder (1) for each new row; its write index, the new rows' places (the trash row, 99, for new
    rows past the window)."""

    class Ring:
        sentinel_index, write_trash_index = 1, 99

    tensor = torch.tensor
    # A decode step at position 6: rows of positions 3, 4, 5, then the new one, which takes position 2's row.
    got = places.window_index(tensor([11, 8, 9, 1]), tensor([10]), Ring(), torch)
    assert got.tolist() == [11, 8, 9, 10]
    # Two requests' decode steps, and a new prompt alone (nothing to read: its own rows).
    got = places.window_index(tensor([8, 1, 20, 21, 1]), tensor([9, 22]), Ring(), torch)
    assert got.tolist() == [8, 9, 20, 21, 22]
    assert places.window_index(tensor([], dtype=torch.int64), tensor([8, 9]), Ring(), torch).tolist() == [8, 9]
    # Two new rows at positions 6 and 7 behind 3, 4, 5: position 7 takes position 3's row, which the step reads.
    assert places.window_index(tensor([11, 8, 9, 1, 1]), tensor([10, 11]), Ring(), torch) is None
    # A prompt longer than the window: its first rows go to the trash.
    assert places.window_index(tensor([], dtype=torch.int64), tensor([99, 8, 9, 10, 11]), Ring(), torch) is None


async def test_a_q4_k_m_file_runs_fused_on_int8_rows_and_the_degraded_mode_answers_as_that_engine(
    tmp_path_factory: pytest.TempPathFactory, fresh_cache: Caches
) -> None:
    """A Q4_K_M file's Q4_K and Q6_K layers have int8 records (fp32 scales; Q6_K's two a block): with
    TTFT_GGUF_ACTIVATIONS=int8 every decoder layer runs in C on int8 rows, and with TTFT_DEGRADE=int8 the batched
    engine starts, and switched to int8 gives that engine's greedy answers, each saying degraded."""
    root = tmp_path_factory.mktemp("k-quant")
    path = tinymodels.build_gguf("qwen3", root, hidden=256, kind="Q4_K_M")
    base = Settings(model=str(path), cache_dir=fresh_cache(root / "cache"), threads=1, prefill_process=False)
    single = SingleEngine(base.replace(gguf_activations="int8"))
    batched = BatchedEngine(base.replace(degrade="int8"))
    with capture_logs() as logs:
        single.load(StageClock())
        batched.load(StageClock())
    try:
        by_type = {"Q4_K": "blocks, int8 rows: 10", "Q6_K": "blocks, int8 rows: 4"}  # the fp32 LM head's rows too
        by_type["F32"] = "blocks, fp32 rows: 1 (not quantised: int8 rows multiply quantised blocks)"
        assert next(e["by_type"] for e in logs if e["event"] == "weights_blocks") == by_type
        assert single.info.weights == "gguf-blocks-int8"
        assert single.info.decoder == batched.info.decoder == "fused: 2 of 2 layers"
        assert batched.info.modes == ("normal", "int8")
        params = SamplingParams(max_tokens=16)
        normal = [await collect(batched.stream(prompt_of(batched, p), params)) for p in PROMPTS[:2]]
        batched.set_mode("int8")
        got = [await collect(batched.stream(prompt_of(batched, p), params)) for p in PROMPTS[:2]]
        want = [await collect(single.stream(prompt_of(single, p), params)) for p in PROMPTS[:2]]
        assert [(t, f.usage) for t, f in got] == [(t, f.usage) for t, f in want]
        assert [f.degraded for _, f in got] == [True, True] and not any(f.degraded for _, f in normal)
        assert [t for t, _ in normal] != [t for t, _ in got]  # int8 rows are another model's arithmetic
    finally:
        await batched.close()


def test_a_family_without_a_fused_form_runs_in_transformers_and_readyz_and_the_log_say_why(
    family_settings: Callable[..., Settings],
) -> None:
    from starlette.testclient import TestClient

    from tests.support.servers import eventually
    from ttft_sse.app import create_app

    settings = family_settings("nemotron", engine="single")
    engine = SingleEngine(settings)
    with capture_logs() as logs, TestClient(create_app(settings, engine)) as client:
        eventually(lambda: client.get("/readyz").status_code == 200)
        ready = client.get("/readyz").json()
    assert engine.info.weights == "gguf-blocks"  # its linear layers are on the block kernel; its layers are not C
    reason = "NemotronDecoderLayer: no fused form"
    assert {"event": "decoder_not_fused", "log_level": "info", "reason": reason} in logs
    label = f"not fused ({reason}); each layer runs in transformers' Python"
    assert engine.info.decoder == ready["decoder"] == label
    assert [e["decoder"] for e in logs if e["event"] == "weights_arranged"] == [label]
    assert not any(isinstance(m, families.FusedLayer) for m in engine.model.modules())


def test_each_family_is_found_by_its_layer_class_and_nothing_else_is() -> None:
    from transformers import Gemma3TextConfig, NemotronConfig, Qwen3Config

    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    gemma = transformers_layer(Gemma3TextConfig(head_dim=16, **small), "gemma3")
    qwen3 = transformers_layer(Qwen3Config(head_dim=16, **small), "qwen3")
    nemotron = transformers_layer(NemotronConfig(**small), "nemotron")
    assert [families.family_of(m) for m in (gemma, qwen3, nemotron)] == [
        *(f for name in ("gemma3", "qwen3") for f in families.FAMILIES if f.name == name),
        None,
    ]
    # Not on the block kernel: the reason names the class.
    assert families.why_not(qwen3, families.family_of(qwen3), torch) == (
        "Qwen3DecoderLayer: not every linear layer is on the block kernel"
    )
    assert families.why_not(nemotron, None, torch) == "NemotronDecoderLayer: no fused form"


def transformers_layer(config: Any, family: str) -> Any:
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    kind = {"gemma3": "Gemma3DecoderLayer", "qwen3": "Qwen3DecoderLayer", "nemotron": "NemotronDecoderLayer"}[family]
    return getattr(module, kind)(config, 0)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
async def test_an_unquantised_gguf_runs_fused_on_the_kernel_with_the_answer_of_transformers_fp32_layers(
    tmp_path_factory: pytest.TempPathFactory, fresh_cache: Caches, kind: str
) -> None:
    """An F16 or BF16 file's layers (and its F32 LM head) on the kernel's dense layouts, every decoder layer in C;
    the reference: the same file on transformers' fp32 layers alone (``TTFT_GGUF_KERNEL=false``)."""
    root = tmp_path_factory.mktemp(f"dense-{kind}")
    path = tinymodels.build_gguf("qwen2", root, kind=kind)
    base = Settings(model=str(path), cache_dir=fresh_cache(root / "cache"), threads=1, prefill_process=False)
    fast, plain = SingleEngine(base), SingleEngine(base.replace(gguf_kernel=False))
    for engine in (fast, plain):
        engine.load(StageClock())
    assert fast.info.decoder == "fused: 2 of 2 layers"
    assert fast.info.weights_by_type == {kind: "blocks: 14", "F32": "blocks: 1"}
    assert plain.info.weights_by_type == {} and plain.info.decoder.startswith("not fused")
    params = SamplingParams(max_tokens=24)
    for prompt in PROMPTS:
        got = await collect(fast.stream(prompt_of(fast, prompt), params))
        want = await collect(plain.stream(prompt_of(plain, prompt), params))
        assert got[0] == want[0] and replace(got[1].usage, cached_tokens=0) == replace(
            want[1].usage, cached_tokens=0
        ), prompt
