"""KV caches in f16 while the model computes in fp32 (``TTFT_KV_DTYPE=f16``: engine/library/half_cache.py): the C
attention over fp16 values and the decoder layers' writes of them on every build (AVX-512, AVX2 with F16C, AVX2 in
plain C), the dense cache of the single engine and the prefill process, and the batched engine's paged cache with the
bundled model, its interludes and prefix sharing."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.support import builds
from tests.support.engines import collect, prompt_of
from tests.support.texts import QUESTIONS, STORY, SYSTEM
from ttft_sse.engine.base import Finished, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.first.process import Prefixes, last_logits
from ttft_sse.engine.kernels import attention, kernel
from ttft_sse.engine.library import decoder, grouped, half_cache
from ttft_sse.engine.library import in_place as places
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "avx2-no-f16c": ("-mno-avx512f", "-mno-f16c")}
"""The builds each C path is checked on, whatever this machine's CPU: as built for it, without AVX-512 (AVX2 with
F16C's conversions), and without F16C too (half.h's plain C)."""


def tiny(kv_heads: int = 2, heads: int = 6, dim: int = 16) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=heads * dim, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=list(BUILDS))
def half_module(request: pytest.FixtureRequest) -> Any:
    """An attention module marked for the C attention over an f16 cache, on each build."""
    model = tiny()
    half_cache.mark(model, half_cache.F16)
    with builds.flags(*BUILDS[request.param]):
        assert grouped.page(model, torch, builds.DIRECTORY) == 2
    grouped.dispatch(model)
    module = model.model.layers[0].self_attn
    assert getattr(module, attention.PAGED_HALF, None) is not None
    return module


def one_by_one(query: Any, key: Any, value: Any, requests: list[tuple[int, int]], scale: float) -> Any:
    """SDPA in fp32 for each request alone, its rows seeing its own past and its new rows up to themselves."""
    out, row, column = [], 0, 0
    for rows, keys in requests:
        allowed = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, row : row + rows], key[:, :, column : column + keys],
                value[:, :, column : column + keys], attn_mask=allowed, scale=scale, enable_gqa=True,
            )
        )  # fmt: skip
        row, column = row + rows, column + keys
    return torch.cat(out, dim=2).transpose(1, 2)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 6, 16), (32, 32, 128), (12, 1, 16)],
    ids=["smollm2", "no-groups", "llama2-7b", "one-kv-head"],
)  # fmt: skip
def test_the_c_attention_over_an_f16_cache_is_sdpa_over_the_rounded_values_in_fp32(
    half_module: Any, heads: int, kv_heads: int, dim: int
) -> None:
    # Decoding streams, prompts with and without a past, and two prompts past long_rows (SDPA over their keys,
    # gathered from the f16 rows and widened).
    long = 16
    requests = [(1, 40), (5, 5), (1, 1), (3, 20), (long + 1, long + 9), (long + 3, long + 3)]
    query, key, value, _ = attention.masked_step(torch, heads, kv_heads, dim, requests, seed=3)
    keys, values, index = attention.in_cache(torch, key, value, slots=300)
    rounded = (keys.to(torch.float16), values.to(torch.float16), index)
    widened = (rounded[0].float(), rounded[1].float(), index)
    cu_q, cu_k = attention.starts(torch, requests)

    def attend(kv: tuple[Any, Any, Any]) -> Any:
        return attention.paged_attention(half_module, query, kv, cu_q, cu_k, long + 3, dim**-0.5, long_rows=long)

    got = attend(rounded)
    # The oracle: SDPA in fp32 over the keys and values rounded to fp16 (as the cache holds them), within the fp32
    # C attention's own tolerance against SDPA (tests/engine/kernels/test_attention.py).
    key16, value16 = (x.to(torch.float16).float() for x in (key, value))
    torch.testing.assert_close(got, one_by_one(query, key16, value16, requests, dim**-0.5), rtol=1e-4, atol=2e-6)
    # Bit for bit the fp32 function over the same values widened (what the single engine's dense cache hands it),
    # and not the fp32 cache's result: the rounding is there.
    assert torch.equal(got, attend(widened))
    assert not torch.equal(got, attend((keys, values, index)))


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel_library(request: pytest.FixtureRequest) -> Path:
    """The kernel's library (decoder.c among its files) on each build."""
    return builds.built(kernel.build, *BUILDS[request.param])


def test_the_decoder_layers_round_keys_and_values_to_fp16_as_torch_does(kernel_library: Path) -> None:
    """decoder.c's cache write (``ttft_kv_write``) against ``torch.Tensor.to(torch.float16)``, bit for bit: values
    of every magnitude, exact ties (to even), fp16's subnormals and the smallest of them, the largest finite value
    and what rounds past it, infinities; a count that leaves a tail after the vectors."""
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(4001, generator=generator) * torch.logspace(-9, 5, 4001)
    ulp = 2.0**-10
    ties = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, 2048 + 1, 2048 + 3, 2.0**-24 * 1.5, 2.0**-24 * 2.5, 2.0**-25])
    small = [0.0, -0.0, 2.0**-14, 2.0**-14 * (1 - ulp), 2.0**-24, 2.0**-26, 1e-8, 3.0e-5, -6.1e-5, 0.1, 1 / 3]
    edges = torch.tensor([*small, 65504.0, 65519.0, 65520.0, 1e6, float("inf"), float("-inf")])
    values = torch.cat([spread, ties, -ties, edges, -edges])
    assert values.numel() % 16 != 0
    write = decoder.function(kernel_library, decoder.KV_WRITE)
    got = torch.empty(values.numel(), dtype=torch.float16)
    assert write(got.data_ptr(), values.data_ptr(), values.numel(), 1) == 0
    assert torch.equal(got.view(torch.int16), values.to(torch.float16).view(torch.int16))
    copied = torch.empty_like(values)
    assert write(copied.data_ptr(), values.data_ptr(), values.numel(), 0) == 0  # an fp32 cache: as they are
    assert torch.equal(copied, values)


def test_a_dense_f16_cache_holds_fp16_and_hands_the_attention_the_rounded_values_in_fp32() -> None:
    model = tiny()
    assert type(half_cache.dense(model)) is transformers.DynamicCache  # not marked: the library's
    half_cache.mark(model, half_cache.F16)
    cache = half_cache.dense(model)
    generator = torch.Generator().manual_seed(1)
    first, second = ([torch.randn(1, 2, n, 16, generator=generator) for _ in "kv"] for n in (5, 3))
    keys, values = cache.update(*first, 0)
    assert (keys.dtype, cache.layers[0].keys.dtype) == (torch.float32, torch.float16)
    assert torch.equal(keys, first[0].to(torch.float16).float())
    keys, values = cache.update(*second, 0)
    assert torch.equal(values, torch.cat([first[1], second[1]], dim=2).to(torch.float16).float())
    kept = copy.deepcopy(cache)  # the prefill process keeps copies, crops them and grows them again
    kept.crop(-2)
    assert (kept.get_seq_length(), kept.layers[0].values.dtype, cache.get_seq_length()) == (6, torch.float16, 8)


@pytest.fixture(scope="module")
def f16_settings(settings: Settings) -> Settings:
    return settings.replace(kv_dtype="f16")


@pytest.fixture(scope="module")
def single_f16(f16_settings: Settings) -> SingleEngine:
    engine = SingleEngine(f16_settings)
    engine.load(StageClock())
    return engine


@pytest.fixture(scope="module")
def batched_f16(f16_settings: Settings) -> Iterator[BatchedEngine]:
    engine = BatchedEngine(f16_settings.replace(prefill_between_layers=True))
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


def outcome(result: tuple[str, Finished]) -> tuple[str, str, int]:
    text, finished = result
    return text, finished.finish_reason, finished.usage.completion_tokens


def test_the_prefill_processs_prompts_behind_a_cached_f16_prefix_are_the_whole_prompts(
    single_f16: SingleEngine,
) -> None:
    """The prefill process's computation (engine/first/process.py) over f16 caches: a prompt behind a kept prefix,
    and two side by side, give the logits of each prompt computed whole; what it keeps is fp16."""
    model = single_f16.model
    prefixes = Prefixes()
    asks = [tuple(prompt_of(single_f16, q, SYSTEM).token_ids) for q in QUESTIONS[:3]]

    def whole(ids: tuple[int, ...]) -> Any:
        with torch.inference_mode():
            out = model.base_model(input_ids=torch.tensor([ids]), cache=half_cache.dense(model), use_cache=True)
            return model.get_output_embeddings()(out.last_hidden_state[0, -1])

    first = last_logits(model, torch, prefixes, [asks[0]])[0]
    assert torch.equal(first, whole(asks[0]))
    together = last_logits(model, torch, prefixes, asks[1:])  # behind the system prompt the first one left
    assert all(torch.equal(together[i], whole(asks[1 + i])) for i in range(2))
    kept, _ = prefixes.take(asks[1], lambda: half_cache.dense(model))
    assert kept.layers[0].keys.dtype == torch.float16


async def test_the_batched_engine_keeps_its_paged_cache_in_f16_and_gives_the_single_engines_text(
    batched_f16: BatchedEngine, single_f16: SingleEngine, settings: Settings
) -> None:
    """Five requests together and each alone, on the batched engine's f16 cache (its decoder layers in C writing
    fp16 values, the C attention reading them in place), give the f16 single engine's text; the cache is half the
    fp32 engine's bytes."""
    assert (batched_f16.info.kv_cache_dtype, single_f16.info.kv_cache_dtype) == ("float16", "float16")
    assert batched_f16.info.kv_cache_bytes == 8192 * 30 * 2 * 3 * 64 * 2  # SmolLM2-135M's, at 2 bytes a value
    params = SamplingParams(max_tokens=24)
    asks = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?", *QUESTIONS[:2]]
    want = [outcome(await collect(single_f16.stream(prompt_of(single_f16, a), params))) for a in asks]
    together = await asyncio.gather(*(collect(batched_f16.stream(prompt_of(batched_f16, a), params)) for a in asks))
    assert [outcome(got) for got in together] == want
    cache = batched_f16._manager.batch_processor.cache
    in_place = cache.in_place
    assert {rows.dtype for pair in in_place.rows.values() for rows in pair} == {torch.float16}
    assert cache.cache_tensor.numel() < 8192 * 30 * 2 * 3 * 64 * 2 * 1.1  # bytes: the f16 cache, and its trash
    # The seeded and too-long requests' engine (the single one inside) keeps its cache in f16 too.
    assert half_cache.in_f16(batched_f16._single.model)


async def test_interludes_and_prefix_sharing_over_the_f16_cache_give_the_single_engines_text(
    batched_f16: BatchedEngine, single_f16: SingleEngine
) -> None:
    """Newcomers at a busy batch: an interlude computes their prompts into the f16 cache (written by decoder.c), the
    batch reuses those blocks (prefix hits), and each text is the f16 single engine's."""
    params = SamplingParams(max_tokens=10)
    asks = [f"Traveller {i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(6)]
    want = [outcome(await collect(single_f16.stream(prompt_of(single_f16, a, SYSTEM), params))) for a in asks]
    await collect(batched_f16.stream(prompt_of(batched_f16, "Hi", SYSTEM), SamplingParams(max_tokens=1)))
    assert batched_f16.interludes is not None
    served, hits = batched_f16.interludes.served, batched_f16.stats().prefix_hit_tokens
    story = batched_f16.stream(prompt_of(batched_f16, STORY), SamplingParams(max_tokens=300))
    await anext(story)  # the batch decodes a long answer while the newcomers come
    try:
        got = [outcome(await collect(batched_f16.stream(prompt_of(batched_f16, a, SYSTEM), params))) for a in asks]
    finally:
        await story.aclose()
    assert got == want
    assert batched_f16.interludes.served > served
    assert batched_f16.stats().prefix_hit_tokens > hits


async def test_the_prefill_process_keeps_the_batchs_f16_cache_and_its_first_tokens_are_the_batchs(
    f16_settings: Settings, single_f16: SingleEngine
) -> None:
    """The prefill process, started by an engine whose KV cache ``auto`` made f16 (the fp32 one does not fit in 1,550
    MiB beside the bundled model's weights and working memory), is told f16 (``auto`` could choose otherwise in the
    child, by the memory left to it) and computes with an f16 cache too: the first tokens it wins are the batch's (no
    mismatch logged), and each text is the f16 single engine's."""
    from structlog.testing import capture_logs

    from tests.engine.first.test_process import prompts, until_the_process_wins
    from tests.support.servers import eventually

    auto = f16_settings.replace(kv_dtype="auto", memory_limit_mb=1550)
    engine = BatchedEngine(auto.replace(prefill_process=True, prefill_between_layers=False, kernel_helpers=0))
    engine.load(StageClock())
    try:
        assert (engine.info.kv_cache_dtype, engine.info.kv_cache_tokens) == ("float16", 8192)
        assert engine._prefill is not None
        assert engine._prefill._settings.kv_dtype == "f16"  # what the child loads with
        eventually(lambda: engine.stats().prefill != "loading", timeout=180)
        assert engine.stats().prefill == "ready"
        params = SamplingParams(max_tokens=12)

        async def burst(n: int) -> None:
            label = f"({n}) "
            want = [outcome(await collect(single_f16.stream(p, params))) for p in prompts(single_f16, label)]
            with capture_logs() as logs:
                got = await asyncio.gather(*(collect(engine.stream(p, params)) for p in prompts(engine, label)))
            assert [outcome(g) for g in got] == want
            assert not [e for e in logs if e["event"] == "first_token_mismatch"]

        await until_the_process_wins(engine, burst)
    finally:
        await engine.close()


async def test_sliding_window_layers_over_an_f16_cache_read_in_place_or_through_the_library_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3's sliding-window layers (a tiny model's window of 8) over the f16 paged cache: decode steps read the
    ring in place, prompts that wrap it take the library's reading (the f16 class's update widens what it reads) and
    its attention. Each answer is the same alone and together, and a prompt within the window the f16 single
    engine's, whose dense cache holds the sliding layers' rows in f16 too."""
    from tests.support import tinymodels
    from tests.support.paths import CACHE_DIR

    # The suite's cache directory: its C libraries are built already (a fresh one compiles them all, ~30 s).
    settings = Settings(
        model=str(tinymodels.build_gguf("gemma3", tmp_path)), cache_dir=CACHE_DIR, threads=1,
        prefill_process=False, kv_dtype="f16",
    )  # fmt: skip
    windows: list[bool] = []
    window_index = places.window_index

    def seen(*arguments: Any) -> Any:
        found = window_index(*arguments)
        windows.append(found is not None)  # read in place, or by the library
        return found

    monkeypatch.setattr(places, "window_index", seen)
    single = SingleEngine(settings)
    single.load(StageClock())
    engine = BatchedEngine(settings)
    engine.load(StageClock())
    try:
        assert engine.info.kv_cache_dtype == "float16"
        params = SamplingParams(max_tokens=20)
        asks = ["tell me a story about a dragon who could fly", "what is the capital of france? paris is."]
        alone = [outcome(await collect(engine.stream(prompt_of(engine, a), params))) for a in asks]
        together = await asyncio.gather(*(collect(engine.stream(prompt_of(engine, a), params)) for a in asks))
        assert [outcome(t) for t in together] == alone
        got = outcome(await collect(engine.stream(prompt_of(engine, "hi"), params)))
        assert got == outcome(await collect(single.stream(prompt_of(single, "hi"), params)))
        assert (True in windows, False in windows) == (True, True)
    finally:
        await engine.close()
