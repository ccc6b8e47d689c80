"""Decoder layers in C around the library's cache and attention (engine/library/decoder.py,
engine/kernels/decoder.c)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support import builds
from tests.support.ggufs import named, quantise, write_gguf
from tests.support.paths import CACHE_DIR
from tests.support.texts import PASSAGE
from ttft_sse.engine.kernels import attention, compiler, kernel, structs
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.library import decoder, families, stack
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

DIRECTORY = CACHE_DIR / KERNEL_DIR
ULPS = 2
"""How far silu(g) * u may be from its fp64 value, in fp32 roundings (2^-23 of it); torch's own fp32 silu(g) * u
is up to 1.53 away."""


@pytest.fixture(scope="module")
def loaded(settings: Settings) -> tuple[SingleEngine, list[dict[str, Any]]]:
    """The single engine with the defaults, and its load's log."""
    engine = SingleEngine(settings)
    with capture_logs() as logs:
        engine.load(StageClock())
    return engine, logs


@pytest.fixture(scope="module")
def loaded_int8(settings: Settings) -> tuple[SingleEngine, list[dict[str, Any]]]:
    """The single engine with int8 rows (``TTFT_GGUF_ACTIVATIONS=int8``), and its load's log."""
    engine = SingleEngine(settings.replace(gguf_activations="int8"))
    with capture_logs() as logs:
        engine.load(StageClock())
    return engine, logs


@contextlib.contextmanager
def library_layers(model: Any) -> Iterator[None]:
    """``model``'s decoder layers the library's again, for the length of the block."""
    layers = list(model.model.layers)
    fused = [layer.__class__ for layer in layers]
    for layer in layers:
        layer.__class__ = LlamaDecoderLayer
    try:
        yield
    finally:
        for layer, kind in zip(layers, fused, strict=True):
            layer.__class__ = kind


@pytest.fixture(scope="module", params=["native", "avx2"])
def library(request: pytest.FixtureRequest) -> Path:
    """The kernel's library as this CPU builds it, and built without AVX-512 (what a CPU without it gets)."""
    if request.param == "native":
        return kernel.build(DIRECTORY)
    return builds.built(kernel.build, "-mno-avx512f")


def test_every_decoder_layer_of_the_bundled_model_runs_in_c_and_the_log_says_so(
    loaded: tuple[SingleEngine, list[dict[str, Any]]],
) -> None:
    engine, logs = loaded
    layers = list(engine.model.model.layers)
    assert len(layers) == 30 and all(type(layer) is decoder.fused_layer_class() for layer in layers)
    assert {
        "event": "decoder_fused",
        "log_level": "info",
        "family": "llama",
        "layers": 30,
        "of": 30,
        "one_call": True,
    } in logs
    assert engine.info.weights == "gguf-blocks"
    assert engine.info.decoder == "fused: 30 of 30 layers"
    # All of them, in order: a batched step's first layer runs them in one call (run_layers).
    chain = layers[0].chain
    assert chain is not None and chain.layers == tuple(layers) and all(layer.chain is chain for layer in layers)
    assert list(chain.addresses) == [layer.address for layer in layers]


def test_the_fused_model_gives_the_librarys_logits_within_roundings_and_the_same_next_tokens(
    loaded: tuple[SingleEngine, list[dict[str, Any]]],
) -> None:
    """A passage at once, then its first 5 tokens and the rest token by token on a cache: every position's logits,
    both ways."""
    engine, _ = loaded
    ids = engine.tokenizer("The city of Paris is the capital of France. It lies on the river", return_tensors="pt")
    ids = ids.input_ids

    def logits() -> tuple[Any, Any]:
        whole = engine.model(ids).logits[0]
        cache = transformers.DynamicCache(config=engine.model.config)
        steps = [engine.model(ids[:, :5], cache=cache).logits[0]]
        steps += [engine.model(ids[:, i : i + 1], cache=cache).logits[0] for i in range(5, ids.shape[1])]
        return whole, torch.cat(steps)

    with torch.inference_mode():
        got = logits()
        with library_layers(engine.model):
            want = logits()
    for g, w in zip(got, want, strict=True):
        assert g.shape == (ids.shape[1], engine.model.config.vocab_size)
        assert float((g - w).abs().max()) <= 1e-3 * float(w.abs().max())
        assert torch.equal(g.argmax(-1), w.argmax(-1))
        assert not torch.equal(g, w)  # it really ran other code (the norms sum in another order)


def test_with_int8_rows_every_decoder_layer_runs_in_c_too_and_predicts_what_the_librarys_layers_predict(
    loaded_int8: tuple[SingleEngine, list[dict[str, Any]]],
) -> None:
    """Teacher-forced on a passage: the next-token choice of the C layers against the library's layers, both on the
    int8 kernel. A rounding of the norm or of exp can move an activation across an int8 step, and that moves it by
    1/127 of its block: the logits are not within roundings of each other, as with fp32 rows, but as near as int8
    rows are to fp32 rows (tests/engine/kernels/test_kernel.py; seen here: 75 of 80 choices, KL 0.0036)."""
    engine, logs = loaded_int8
    layers = list(engine.model.model.layers)
    assert all(type(layer) is decoder.fused_layer_class() for layer in layers)
    assert all(layer.arithmetic.q.int8 == 1 and layer.arithmetic.down.int8 == 1 for layer in layers)
    assert {
        "event": "decoder_fused",
        "log_level": "info",
        "family": "llama",
        "layers": 30,
        "of": 30,
        "one_call": True,
    } in logs
    assert engine.info.weights == "gguf-blocks-int8"
    ids = engine.tokenizer(PASSAGE, return_tensors="pt").input_ids
    with torch.inference_mode():
        got = engine.model(ids).logits[0].double()
        with library_layers(engine.model):
            want = engine.model(ids).logits[0].double()
    agreement = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    p, q = want.log_softmax(-1), got.log_softmax(-1)
    divergence = float((p.exp() * (p - q)).sum(-1).mean())
    assert agreement >= 0.9 and divergence <= 0.01, (agreement, divergence)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("count", [9, 150])
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_each_row_is_the_same_bits_whatever_else_the_call_holds(
    request: pytest.FixtureRequest, activations: str, count: int
) -> None:
    """decoder.c's two halves, called directly on a layer of the bundled model, with fp32 or int8 rows: ``count``
    rows at once (150: three chunks of its buffer) and one by one."""
    engine, _ = request.getfixturevalue("loaded" if activations == "fp32" else "loaded_int8")
    layer = engine.model.model.layers[3]
    numbers = layer.arithmetic
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(count, numbers.hidden, generator=generator)
    cos, sin = (torch.rand(count, numbers.dim, generator=generator) for _ in range(2))
    a = torch.randn(count, numbers.heads * numbers.dim, generator=generator)

    def halves(rows: slice) -> list[Any]:
        out = [
            torch.empty(x[rows].shape[0], n * numbers.dim) for n in (numbers.heads, numbers.kv_heads, numbers.kv_heads)
        ]
        pointers = [t[rows].data_ptr() for t in (x, cos, sin)]  # rows of contiguous tensors: contiguous
        assert layer.head(layer.address, pointers[0], out[0].shape[0], *pointers[1:], *(t.data_ptr() for t in out)) == 0
        y = torch.empty(out[0].shape[0], numbers.hidden)
        assert layer.tail(layer.address, x[rows].data_ptr(), a[rows].data_ptr(), y.shape[0], y.data_ptr()) == 0
        return [*out, y]

    together = halves(slice(0, count))
    alone = [torch.cat(parts) for parts in zip(*(halves(slice(i, i + 1)) for i in range(count)), strict=True)]
    for both, one in zip(together, alone, strict=True):
        assert torch.equal(both, one)
    assert all(bool(t.abs().sum() > 0) for t in together)


@pytest.mark.parametrize("count", [1, 8, 150])
def test_q_k_v_and_gate_up_joined_give_the_same_bits_as_the_layers_one_by_one(
    loaded: tuple[SingleEngine, list[dict[str, Any]]], count: int
) -> None:
    """kernel.join: each decoder layer of the bundled model computes q, k and v in one call of the kernel, and gate
    and up in another, over the layers' own panels (the layers compute on views of them: the codes are held once).
    decoder.c's halves give the same bits with the joined calls as with the layers one by one."""
    engine, _ = loaded
    layer = engine.model.model.layers[3]
    numbers = layer.arithmetic
    hidden, dim, intermediate = numbers.hidden, numbers.dim, numbers.intermediate
    assert (numbers.qkv.outputs, numbers.gate_up.outputs) == (
        (numbers.heads + 2 * numbers.kv_heads) * dim,
        2 * intermediate,
    )
    qkv, gate_up = layer.joined
    panels = numbers.heads * dim // 16  # q's panels come first, then k's
    q, k = (layer.get_submodule(decoder.LINEARS[name]) for name in ("q", "k"))
    assert q.arrays[0].data_ptr() == qkv[0].data_ptr() == numbers.qkv.codes
    assert k.arrays[0].data_ptr() == qkv[0][panels].data_ptr()
    up = layer.get_submodule(decoder.LINEARS["up"])
    assert up.arrays[0].data_ptr() == gate_up[0][intermediate // 16].data_ptr() and numbers.gate_up.codes
    apart = structs.Layer.from_buffer_copy(numbers)
    apart.qkv, apart.gate_up = decoder.Linear(), decoder.Linear()  # codes NULL: one call a layer, as before
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(count, hidden, generator=generator)
    cos, sin = (torch.rand(count, dim, generator=generator) for _ in range(2))
    a = torch.randn(count, numbers.heads * dim, generator=generator)

    def halves(address: int) -> list[Any]:
        out = [torch.empty(count, n * dim) for n in (numbers.heads, numbers.kv_heads, numbers.kv_heads)]
        pointers = [t.data_ptr() for t in (x, cos, sin, *out)]
        assert layer.head(address, pointers[0], count, *pointers[1:]) == 0
        y = torch.empty(count, hidden)
        assert layer.tail(address, x.data_ptr(), a.data_ptr(), count, y.data_ptr()) == 0
        return [*out, y]

    joined, one_by_one = halves(layer.address), halves(ctypes.addressof(apart))
    for got, want in zip(joined, one_by_one, strict=True):
        assert torch.equal(got, want)
    assert all(bool(t.abs().sum() > 0) for t in joined)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_batched_steps_layer_in_one_call_is_its_head_cache_write_attention_and_tail_in_turn(
    loaded: tuple[SingleEngine, list[dict[str, Any]]], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decoder.c's ttft_decoder_layer against the calls it replaces, on a layer of the bundled model: the head, the
    new keys and values copied into the cache's rows (the library's update; in an f16 cache, rounded by torch),
    attention.c's function through engine/kernels/attention.py, the tail. The same bits, in the output and in the
    cache."""
    engine, _ = loaded
    layer = engine.model.model.layers[3]
    module, numbers = layer.self_attn, layer.arithmetic
    assert getattr(module, attention.PAGED, None) is not None
    library = attention.build(DIRECTORY)
    for name, arguments in ((attention.PAGED_HALF, attention.ARGUMENTS), (attention.PAGED_PART_HALF, ())):
        monkeypatch.setattr(module, name, compiler.load(library, name, arguments), raising=False)
    half = dtype == "float16"
    requests = [(1, 6), (4, 4), (2, 9)]  # (new rows, keys): a decode, a new prompt, a prompt behind its past
    rows, keys = sum(r for r, _ in requests), sum(k for _, k in requests)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, numbers.hidden, generator=generator)
    cos, sin = (torch.rand(rows, numbers.dim, generator=generator) for _ in range(2))
    cache = [torch.randn(40, numbers.kv_heads, numbers.dim, generator=generator) for _ in "kv"]
    cache = [rows.to(getattr(torch, dtype)) for rows in cache]
    index = torch.randperm(40, generator=generator)[:keys]
    # Each request's keys are its past, then its new rows: the new rows' keys and values are written last.
    cu_q, cu_k = attention.starts(torch, requests)
    write = torch.cat([index[int(cu_k[s + 1]) - n : int(cu_k[s + 1])] for s, (n, _) in enumerate(requests)])

    q = torch.empty(rows, numbers.heads * numbers.dim)
    k, v = (torch.empty(rows, numbers.kv_heads * numbers.dim) for _ in range(2))
    pointers = [t.data_ptr() for t in (x, cos, sin, q, k, v)]
    assert layer.head(layer.address, pointers[0], rows, *pointers[1:]) == 0
    want_cache = [t.clone() for t in cache]
    for rows_of, new in zip(want_cache, (k, v), strict=True):
        rows_of.index_copy_(0, write, new.view(rows, numbers.kv_heads, numbers.dim).to(rows_of.dtype))
    query = q.view(1, rows, numbers.heads, numbers.dim).transpose(1, 2)
    longest = max(n for n, _ in requests)
    a = attention.paged_attention(module, query, (*want_cache, index), cu_q, cu_k, longest, module.scaling)
    want = torch.empty(rows, numbers.hidden)
    assert layer.tail(layer.address, pointers[0], a.reshape(rows, -1).data_ptr(), rows, want.data_ptr()) == 0

    got_cache = [t.clone() for t in cache]
    shared = attention.Step(write, index, cu_q, cu_k, len(requests), cache[0].stride(0), cache[0].stride(1), 40, half)
    step = stack.c_step(shared, module)
    got = torch.empty(rows, numbers.hidden)
    status = layer.whole(
        layer.address, ctypes.addressof(step), pointers[0], rows, pointers[1], pointers[2],
        *(t.data_ptr() for t in got_cache), got.data_ptr(),
    )  # fmt: skip
    assert status == 0
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_cache, want_cache, strict=True))
    assert not torch.equal(got_cache[0], cache[0]) and bool(want.abs().sum() > 0)


def test_a_steps_layers_in_one_call_are_each_layers_call_in_turn_and_stop_where_the_flag_says(
    loaded: tuple[SingleEngine, list[dict[str, Any]]],
) -> None:
    """decoder.c's ttft_decoder_stack over four layers of the bundled model against ttft_decoder_layer called for
    each in turn: the same bits, in the output and in each layer's cache rows. With the flag raised it stops before
    the second layer, the first one's output in out; taken up from there (x and out the same tensor), it ends with
    the same bits."""
    engine, _ = loaded
    layers = list(engine.model.model.layers)[4:8]
    module, numbers = layers[0].self_attn, layers[0].arithmetic
    requests = [(1, 6), (4, 4), (2, 9)]
    rows, keys = sum(r for r, _ in requests), sum(k for _, k in requests)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, numbers.hidden, generator=generator)
    cos, sin = (torch.rand(rows, numbers.dim, generator=generator) for _ in range(2))
    caches = [[torch.randn(40, numbers.kv_heads, numbers.dim, generator=generator) for _ in range(2)] for _ in layers]
    index = torch.randperm(40, generator=generator)[:keys]
    cu_q, cu_k = attention.starts(torch, requests)
    write = torch.cat([index[int(cu_k[s + 1]) - n : int(cu_k[s + 1])] for s, (n, _) in enumerate(requests)])
    strides = caches[0][0].stride()[:2]
    shared = attention.Step(write, index, cu_q, cu_k, len(requests), *strides, 40, False)
    step = stack.c_step(shared, module)

    def one_by_one(count: int) -> tuple[Any, list[list[Any]]]:
        cache = [[t.clone() for t in pair] for pair in caches]
        y = x
        for layer, (k, v) in zip(layers[:count], cache, strict=False):
            out = torch.empty(rows, numbers.hidden)
            status = layer.whole(
                layer.address, ctypes.addressof(step), y.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
                k.data_ptr(), v.data_ptr(), out.data_ptr(),
            )  # fmt: skip
            assert status == 0
            y = out
        return y, cache

    got_cache = [[t.clone() for t in pair] for pair in caches]
    pointers = [(ctypes.c_void_p * len(layers))(*values) for values in (
        [layer.address for layer in layers],
        [ctypes.addressof(step)] * len(layers),
        [pair[0].data_ptr() for pair in got_cache],
        [pair[1].data_ptr() for pair in got_cache],
    )]  # fmt: skip
    waiting = ctypes.c_int32(1)
    called = structs.Stack(len(layers), *(ctypes.addressof(p) for p in pointers), ctypes.addressof(waiting))
    run = decoder.function(kernel.build(DIRECTORY), decoder.STACK)
    y = torch.empty(rows, numbers.hidden)
    arguments = (rows, cos.data_ptr(), sin.data_ptr(), y.data_ptr())
    assert run(ctypes.addressof(called), 0, x.data_ptr(), *arguments) == 1  # stopped before the second layer
    first, first_cache = one_by_one(1)
    assert torch.equal(y, first)
    assert all(
        torch.equal(g, w) for gp, wp in zip(got_cache, first_cache, strict=True) for g, w in zip(gp, wp, strict=True)
    )
    waiting.value = 0
    assert run(ctypes.addressof(called), 1, y.data_ptr(), *arguments) == len(layers)
    want, want_cache = one_by_one(len(layers))
    assert torch.equal(y, want) and not torch.equal(want, first)
    assert all(
        torch.equal(g, w) for gp, wp in zip(got_cache, want_cache, strict=True) for g, w in zip(gp, wp, strict=True)
    )
    assert not torch.equal(got_cache[-1][0], caches[-1][0])


def test_silu_times_up_is_within_roundings_of_fp64_over_the_whole_range(library: Path) -> None:
    """Past the clamps (exp's argument in [-87, 88]) silu is 0 or x to fp32's precision; NaN stays NaN; an odd count
    takes the padded tail."""
    silu_mul = decoder.function(library, decoder.SILU_MUL)
    g = torch.cat([torch.linspace(-120.0, 120.0, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -87.5])])
    u = torch.linspace(-2.0, 3.0, g.numel())
    want = torch.nn.functional.silu(g.double()) * u.double()
    got = g.clone()
    assert silu_mul(got.data_ptr(), u.data_ptr(), got.numel()) == 0
    error = (got.double() - want).abs()
    assert bool((error <= ULPS * 2.0**-23 * want.abs() + 1e-30).all()), float((error / want.abs()).max())
    nan = torch.tensor([float("nan")] * 3)
    assert silu_mul(nan.data_ptr(), torch.ones(3).data_ptr(), 3) == 0
    assert bool(nan.isnan().all())


def test_gelu_times_up_is_within_roundings_of_g_times_u_of_fp64_over_the_whole_range(library: Path) -> None:
    """Gemma 3's gate: GELU's tanh approximation. Where 1 + tanh cancels (g below about -3) the error is one of
    g * u's roundings, not of the result's, as with torch's own fp32 GELU (both 1.23 of them here); NaN stays NaN."""
    gelu_mul = decoder.function(library, decoder.GELU_MUL)
    g = torch.cat([torch.linspace(-120.0, 120.0, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -87.5])])
    u = torch.linspace(-2.0, 3.0, g.numel())
    want = torch.nn.functional.gelu(g.double(), approximate="tanh") * u.double()
    got = g.clone()
    assert gelu_mul(got.data_ptr(), u.data_ptr(), got.numel()) == 0
    error = (got.double() - want).abs()
    assert bool((error <= ULPS * 2.0**-23 * (g.double() * u.double()).abs() + 1e-30).all())
    positive = g > 1.0  # no cancellation: within roundings of the result
    assert bool((error[positive] <= 4 * 2.0**-23 * want[positive].abs()).all())
    nan = torch.tensor([float("nan")] * 3)
    assert gelu_mul(nan.data_ptr(), torch.ones(3).data_ptr(), 3) == 0
    assert bool(nan.isnan().all())


def test_where_c_does_not_compute_the_layers_they_stay_the_librarys_and_the_log_says_why() -> None:
    """A model whose linear layers are not on the block kernel (plain fp32 weights), and a model of another
    family."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with capture_logs() as logs:
        assert decoder.fuse(model, torch, kernel.build(DIRECTORY)) == 0
    assert all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)
    reason = "LlamaDecoderLayer: not every linear layer is on the block kernel"
    assert logs == [{"event": "decoder_not_fused", "log_level": "info", "reason": reason}]
    assert families.label(model) == f"not fused ({reason}); each layer runs in transformers' Python"
    with capture_logs() as logs:
        assert decoder.fuse(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch, kernel.build(DIRECTORY)) == 0
    reason = "the model has no decoder layers"
    assert logs == [{"event": "decoder_not_fused", "log_level": "info", "reason": reason}]


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_a_probe_that_disagrees_leaves_every_layer_the_librarys(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, activations: str
) -> None:
    """The C half after the attention replaced by one that leaves its output as it was: the probe sees it, with int8
    rows' wider tolerance too."""
    engine = SingleEngine(settings.replace(fused_layers=False, gguf_activations=activations))
    with capture_logs():
        engine.load(StageClock())
    layers = list(engine.model.model.layers)
    assert all(type(layer) is LlamaDecoderLayer for layer in layers)  # the setting off: the library's layers
    real = decoder.function

    def broken(path: Path, name: str) -> Any:
        if name != decoder.TAIL:
            return real(path, name)
        return ctypes.CFUNCTYPE(ctypes.c_int, *decoder._ARGUMENTS[name])(lambda *_args: 0)

    monkeypatch.setattr(decoder, "function", broken)
    with capture_logs() as logs:
        assert decoder.fuse(engine.model, torch, kernel.build(DIRECTORY)) == 0
    assert all(type(layer) is LlamaDecoderLayer and not hasattr(layer, "arithmetic") for layer in layers)
    reason = "LlamaDecoderLayer: the C decoder layer disagrees with the library's on a probe"
    assert logs == [{"event": "decoder_not_fused", "log_level": "warning", "reason": reason}]


Q4_K_M = {
    "q_proj": "Q4_K",
    "k_proj": "Q4_K",
    "v_proj": "Q6_K",
    "o_proj": "Q4_K",
    "gate_proj": "Q4_K",
    "up_proj": "Q4_K",
    "down_proj": "Q6_K",
}
"""llama.cpp's Q4_K_M mix of a decoder layer's linear layers (in about half of its layers: the others' attn_v and
ffn_down are Q4_K too)."""


def q4_k_m_model(path: Path) -> Any:
    """A random 2-layer Llama 256 wide (whole K-quant super-blocks) whose linear layers hold gguf's dequantisation
    of their weights quantised in the :data:`Q4_K_M` mix, written to a GGUF file at ``path`` (the LM head is not)."""
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    tensors = {}
    for name, module in model.named_modules():
        kind = Q4_K_M.get(name.rsplit(".", 1)[-1])
        if kind is not None:
            blocks, dense = quantise(module.weight.detach().numpy(), kind)
            tensors[name] = (blocks, kind)
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(dense))
    write_gguf(path, tensors)
    return model


def test_a_model_in_the_q4_k_m_mix_is_fused_whole_and_answers_as_its_layers_unfused(
    library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its Q6_K attn_v and ffn_down run on the kernel too, so every decoder layer is fused (q/k/v not joined: Q4_K
    and Q6_K codes differ), and the greedy answer is the one its layers give unfused, on the kernel and in torch."""
    if library != kernel.build(DIRECTORY):  # the AVX2 build: apply finds it by its flags
        monkeypatch.setattr(compiler, "FLAGS", (*compiler.FLAGS, "-mno-avx512f"))
    path = tmp_path / "q4_k_m.gguf"
    model = q4_k_m_model(path)
    prompt = torch.tensor([[1, 17, 5, 60, 33, 8]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel runs on one
    try:
        with torch.inference_mode():
            plain = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
        applied = kernel.apply(model, named(path), torch, directory=library.parent)
        unknown = "fp32: 1 (the file holds no tensor for it)"  # the LM head
        assert applied == ("fp32", {"Q4_K": "blocks: 10", "Q6_K": "blocks: 4", "unknown": unknown})
        with torch.inference_mode():
            unfused = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
        with capture_logs() as logs:
            assert decoder.fuse(model, torch, library) == 2
        with torch.inference_mode():
            fused = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    finally:
        torch.set_num_threads(threads)
    assert {
        "event": "decoder_fused",
        "log_level": "info",
        "layers": 2,
        "of": 2,
        "one_call": True,
        "family": "llama",
    } in logs
    assert all(type(layer) is decoder.fused_layer_class() for layer in model.model.layers)
    assert fused.shape == (1, 22) and len(set(fused[0, 6:].tolist())) > 1
    assert torch.equal(fused, unfused) and torch.equal(unfused, plain)
