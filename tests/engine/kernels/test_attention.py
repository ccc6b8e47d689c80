"""Attention on CPU: grouped KV heads in SDPA, transformers' attention without the copies, where it takes
(engine/library/grouped.py); and each request's rows against its own keys read from the paged cache in place
(engine/kernels/attention.py, attention.c), against SDPA for each request alone."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from structlog.testing import capture_logs

from tests.support import builds
from ttft_sse.engine.kernels import attention, compiler
from ttft_sse.engine.library import grouped
from ttft_sse.engine.library import in_place as places
from ttft_sse.engine.library.in_place import InPlace, StepHooks
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

HEADS, DIM = 6, 16


def tiny(kv_heads: int) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=HEADS * DIM,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(KV heads SDPA was given, whether it was told they are grouped) for every SDPA call."""
    calls: list[tuple[int, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((key.shape[1], kwargs.get("enable_gqa", False)))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def step(kv_heads: int) -> tuple[Any, Any, Any, Any]:
    """A batched step: a prompt of 4 rows, and a stream's next row after 2 tokens, side by side."""
    return attention.masked_step(torch, HEADS, kv_heads, DIM, [(4, 4), (1, 3)], seed=1)


def test_group_marks_every_attention_module_which_then_calls_the_engines_function_by_a_name_of_its_own() -> None:
    """The marked modules' config (a copy) names grouped_sdpa's name; the model's own config, which continuous
    batching checks, and the library's ``sdpa``, which every other model calls, stay as they were."""
    model = tiny(kv_heads=2)
    library_sdpa = transformers.AttentionInterface()["sdpa"]
    with capture_logs() as logs:
        assert grouped.group(model, torch) == 2
    assert [getattr(layer.self_attn, grouped.MARK, False) for layer in model.model.layers] == [True, True]
    assert grouped.dispatch(model) == 2
    implementations = {layer.self_attn.config._attn_implementation for layer in model.model.layers}
    assert (implementations, model.config._attn_implementation) == ({grouped.NAME}, "sdpa")
    assert transformers.AttentionInterface()[grouped.NAME] is grouped.grouped_sdpa
    assert transformers.AttentionInterface()["sdpa"] is library_sdpa is not grouped.grouped_sdpa
    assert logs == [{"event": "attention_grouped", "log_level": "info", "modules": 2}]
    assert grouped.dispatch(tiny(kv_heads=2)) == 0  # nothing marked: nothing changes


def test_a_masked_step_reads_the_grouped_heads_in_place_and_gives_the_repeated_heads_result(
    sdpa_calls: list[tuple[int, bool]],
) -> None:
    module = tiny(kv_heads=2).model.layers[0].self_attn
    inputs = step(kv_heads=2)
    want, _ = grouped.grouped_sdpa(module, *inputs, scaling=module.scaling)  # not marked: transformers'
    assert sdpa_calls == [(HEADS, False)]  # each KV head copied for its 3 query heads
    setattr(module, grouped.MARK, True)
    got, _ = grouped.grouped_sdpa(module, *inputs, scaling=module.scaling)
    assert sdpa_calls[1:] == [(2, True)]
    assert got.shape == (1, 5, HEADS, DIM)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Each request's rows are its own attention alone: the mask kept the other one out.
    query, key, value, _ = inputs
    first, _ = grouped.grouped_sdpa(
        module, query[:, :, :4], key[:, :, :4], value[:, :, :4], None, scaling=module.scaling, is_causal=True
    )
    second, _ = grouped.grouped_sdpa(
        module, query[:, :, 4:], key[:, :, 4:], value[:, :, 4:], None, scaling=module.scaling
    )
    torch.testing.assert_close(got[:, :4], first, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 4:], second, rtol=1e-5, atol=1e-6)


def test_the_calls_it_does_not_take_are_transformers_own(sdpa_calls: list[tuple[int, bool]]) -> None:
    module = tiny(kv_heads=2).model.layers[0].self_attn
    setattr(module, grouped.MARK, True)
    query, key, value, mask = step(kv_heads=2)
    # One query row with a mask: transformers folds the groups into rows (3 of them), grouped heads, no flag.
    out, _ = grouped.grouped_sdpa(module, query[:, :, :1], key, value, mask[:, :, :1], scaling=module.scaling)
    assert out.shape == (1, 1, HEADS, DIM)
    assert sdpa_calls == [(2, False)]
    with pytest.raises(ValueError, match="softcap"):  # transformers' own refusal
        grouped.grouped_sdpa(module, query, key, value, mask, softcap=30.0)


def test_a_model_without_grouped_heads_is_left_alone() -> None:
    model = tiny(kv_heads=HEADS)
    assert grouped.group(model, torch) == 0
    assert not any(hasattr(m, grouped.MARK) for m in model.modules())


def test_nothing_is_marked_when_grouped_heads_disagree_with_repeated_ones_on_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch.nn.functional.scaled_dot_product_attention

    def wrong_when_grouped(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs) + (1.0 if kwargs.get("enable_gqa") else 0.0)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", wrong_when_grouped)
    model = tiny(kv_heads=2)
    with capture_logs() as logs:
        assert grouped.group(model, torch) == 0
    assert not any(hasattr(m, grouped.MARK) for m in model.modules())
    assert logs == [
        {
            "event": "attention_not_grouped",
            "log_level": "warning",
            "reason": "SDPA over grouped heads disagrees with repeated heads",
        }
    ]


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_the_engine_marks_the_bundled_models_attention_on_cpu_unless_told_not_to(settings: Settings, on: bool) -> None:
    engine = SingleEngine(settings.replace(grouped_attention=on, paged_attention=on))
    engine.load(StageClock())
    marked = [m for m in engine.model.modules() if getattr(m, grouped.MARK, False)]
    paged = [m for m in engine.model.modules() if getattr(m, attention.PAGED, None) is not None]
    # SmolLM2-135M: 30 layers, 3 KV heads for 9 query heads
    assert (len(marked), len(paged), grouped.paged(engine.model)) == ((30, 30, True) if on else (0, 0, False))


# -- request by request over the paged cache (attention.c) ---------------------------------------------------------


def one_by_one(query: Any, key: Any, value: Any, requests: list[tuple[int, int]], scale: float) -> Any:
    """The oracle: SDPA for each request alone, its rows seeing its own past and its new rows up to themselves."""
    out, row, column = [], 0, 0
    for rows, keys in requests:
        allowed = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, row : row + rows],
                key[:, :, column : column + keys],
                value[:, :, column : column + keys],
                attn_mask=allowed,
                scale=scale,
                enable_gqa=True,
            )
        )
        row, column = row + rows, column + keys
    return torch.cat(out, dim=2).transpose(1, 2)


def bookkeeping(requests: list[tuple[int, int]]) -> dict[str, Any]:
    """What continuous batching passes the attention function about a step of ``requests`` (new rows, keys)."""
    cu_q, cu_k = attention.starts(torch, requests)
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": max(rows for rows, _ in requests)}


@pytest.fixture(scope="module", params=["native", "avx2"])
def paged_module(request: pytest.FixtureRequest) -> Any:
    """An attention module marked for the C attention, built for this CPU, and without AVX-512 (what a CPU without
    it gets: its AVX2 side, checked on every machine)."""
    model = tiny(kv_heads=2)
    with builds.flags(*(("-mno-avx512f",) if request.param == "avx2" else ())):
        assert grouped.page(model, torch, builds.DIRECTORY) == 2
    grouped.dispatch(model)  # the attention function that hands the marked modules' calls to the C attention
    return model.model.layers[0].self_attn


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (6, 6, 16), (16, 2, 32), (10, 5, 128), (12, 1, 16)],
    ids=["smollm2", "no-groups", "8-a-kv-head", "dim-128", "one-kv-head"],
)
def test_each_request_attends_to_its_own_keys_read_through_the_index(
    paged_module: Any, sdpa_calls: list[tuple[int, bool]], heads: int, kv_heads: int, dim: int
) -> None:
    # Decoding streams (one row), prompts beside them (with and without a past: a shared prefix), and two prompts
    # longer than long_rows (512 in the engine), which go to SDPA: one with a past, one without.
    long = 16
    requests = [(1, 40), (5, 5), (1, 1), (3, 20), (long + 1, long + 9), (2, 2), (long + 3, long + 3)]
    query, key, value, _ = attention.masked_step(torch, heads, kv_heads, dim, requests, seed=3)
    want = one_by_one(query, key, value, requests, dim**-0.5)
    sdpa_calls.clear()
    kv = attention.in_cache(torch, key, value, slots=500)
    cu_q, cu_k = attention.starts(torch, requests)
    got = attention.paged_attention(paged_module, query, kv, cu_q, cu_k, long + 3, dim**-0.5, long_rows=long)
    assert got.shape == (1, sum(r for r, _ in requests), heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-6)
    assert sdpa_calls == [(kv_heads, True)] * 2  # the long prompts alone, over their gathered keys
    # With the engine's long_rows, every one of these requests takes C.
    sdpa_calls.clear()
    again = attention.paged_attention(paged_module, query, kv, cu_q, cu_k, long + 3, dim**-0.5)
    torch.testing.assert_close(again, want, rtol=1e-4, atol=2e-6)
    assert sdpa_calls == []


def test_a_step_of_new_prompts_alone_reads_the_rows_just_written(paged_module: Any) -> None:
    # With nothing to read from the cache, the index is the step's write index: key j is the row written for j.
    requests = [(4, 4), (7, 7)]
    query, key, value, _ = attention.masked_step(torch, HEADS, 2, DIM, requests, seed=4)
    keys, values, index = attention.in_cache(torch, key, value, slots=64, seed=5)
    got = attention.paged_attention(
        paged_module, query, (keys, values, index), *attention.starts(torch, requests), 7, 0.25
    )
    torch.testing.assert_close(got, one_by_one(query, key, value, requests, 0.25), rtol=1e-4, atol=2e-6)


def test_the_attention_function_takes_paged_steps_for_marked_modules_and_gathers_for_the_others(
    paged_module: Any, sdpa_calls: list[tuple[int, bool]]
) -> None:
    requests = [(1, 6), (2, 3)]
    query, key, value, mask = attention.masked_step(torch, HEADS, 2, DIM, requests, seed=6)
    keys, values, index = attention.in_cache(torch, key, value, slots=32, seed=7)
    step = bookkeeping(requests)
    kv = {attention.KV: (keys, values, index)}
    want = one_by_one(query, key, value, requests, 0.25)
    sdpa_calls.clear()
    paged, _ = grouped.grouped_sdpa(paged_module, query, keys, values, mask, scaling=0.25, **step, **kv)
    assert sdpa_calls == []
    torch.testing.assert_close(paged, want, rtol=1e-4, atol=2e-6)
    # Not marked: the rows the library would have gathered, then SDPA with the step's mask.
    plain = tiny(kv_heads=2).model.layers[0].self_attn
    gathered, _ = grouped.grouped_sdpa(plain, query, keys, values, mask, scaling=0.25, **step, **kv)
    assert len(sdpa_calls) == 1
    torch.testing.assert_close(gathered, want, rtol=1e-4, atol=2e-6)


def test_the_single_engines_calls_take_the_same_c_function_over_its_dense_cache(
    paged_module: Any, sdpa_calls: list[tuple[int, bool]]
) -> None:
    # transformers' cache of one sequence: [1, kv heads, keys, dim], no mask (causal when more than one row).
    for rows, keys in ((7, 7), (1, 12)):
        query, key, value, _ = attention.masked_step(torch, HEADS, 2, DIM, [(rows, keys)], seed=8)
        want = one_by_one(query, key, value, [(rows, keys)], 0.25)
        sdpa_calls.clear()
        got, _ = grouped.grouped_sdpa(paged_module, query, key, value, None, scaling=0.25)
        assert sdpa_calls == []
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-6)
        # Bit for bit the batched engine's result for the same request, its keys read from a paged cache.
        cache = attention.in_cache(torch, key, value, slots=64, seed=9)
        paged = attention.paged_attention(
            paged_module, query, cache, *attention.starts(torch, [(rows, keys)]), rows, 0.25
        )
        assert torch.equal(got, paged)
    # With a mask, the library's own function.
    query, key, value, mask = attention.masked_step(torch, HEADS, 2, DIM, [(3, 3), (1, 4)], seed=10)
    sdpa_calls.clear()
    grouped.grouped_sdpa(paged_module, query, key, value, mask, scaling=0.25)
    assert len(sdpa_calls) == 1


def test_calls_with_more_than_the_c_function_computes_go_to_the_library(
    paged_module: Any, sdpa_calls: list[tuple[int, bool]]
) -> None:
    requests = [(1, 6), (2, 3)]
    query, key, value, mask = attention.masked_step(torch, HEADS, 2, DIM, requests, seed=11)
    step = bookkeeping(requests)
    kv = {attention.KV: attention.in_cache(torch, key, value, slots=32, seed=12)}
    with pytest.raises(ValueError, match="softcap"):  # transformers' own refusal: the call reached it
        grouped.grouped_sdpa(paged_module, query, key, value, mask, scaling=0.25, softcap=30.0, **step, **kv)
    # The single engine's call with a sliding window (Mistral's kind): SDPA, as the library does it.
    query, key, value, _ = attention.masked_step(torch, HEADS, 2, DIM, [(1, 9)], seed=13)
    sdpa_calls.clear()
    grouped.grouped_sdpa(paged_module, query, key, value, None, scaling=0.25, sliding_window=4)
    assert len(sdpa_calls) == 1


def in_place_cache() -> Any:
    """A paged cache as :class:`InPlace` reads it: one full-attention layer of 4 pages of 8 rows, 2 KV
    heads of 16 floats."""
    from types import SimpleNamespace

    pages = [torch.randn(4, 8, 2, DIM) for _ in range(2)]
    allocator = SimpleNamespace(index=0, layer_type="full_attention", get_cache_for_block_table=lambda layer: pages)
    return SimpleNamespace(layer_to_allocator={0: allocator})


def step_kwargs(write: list[int], read: list[int], **more: Any) -> dict[str, Any]:
    """A layer's kwargs in a batched step of two requests (1 new row of 4 keys, 2 new rows of 3 keys)."""
    return {
        "write_index": [torch.tensor(write, dtype=torch.int32)],
        "read_index": [torch.tensor(read, dtype=torch.int32)],
        "cu_seq_lens_q": torch.tensor([0, 1, 3], dtype=torch.int32),
        "cu_seq_lens_k": {"full_attention": torch.tensor([0, 4, 7])},
        "max_length_q": 2,
        "block_table": None,
        **more,
    }


def test_the_layers_of_a_step_share_its_index_arrays_made_once(paged_module: Any) -> None:
    in_place = InPlace(in_place_cache(), StepHooks())
    kwargs = step_kwargs([5, 9, 10], [0, 1, 2, 5, 7, 9, 10])
    step = in_place.step(paged_module, kwargs)
    assert step is not None
    assert [t.dtype for t in (step.write, step.index, step.cu_q, step.cu_k)] == [torch.int64] * 2 + [torch.int32] * 2
    assert (step.write.tolist(), step.index.tolist()) == ([5, 9, 10], [0, 1, 2, 5, 7, 9, 10])
    assert (step.cu_q.tolist(), step.cu_k.tolist()) == ([0, 1, 3], [0, 4, 7])
    assert (step.requests, step.key_stride, step.head_stride, step.slots) == (2, 2 * DIM, DIM, 32)
    pages = in_place.cache.layer_to_allocator[0].get_cache_for_block_table(0)
    assert [rows.data_ptr() for rows in in_place.rows[0]] == [page.data_ptr() for page in pages]
    # The next layer of the step (the same kwargs' values): the same arrays; the next step: new ones.
    assert in_place.step(paged_module, dict(kwargs)) is step
    following = in_place.step(paged_module, step_kwargs([6, 11, 12], [0, 1, 2, 5, 6, 7, 9, 10, 11, 12]))
    assert following is not None and following is not step
    assert following.index.tolist() == [0, 1, 2, 5, 6, 7, 9, 10, 11, 12]
    # A step of new prompts alone reads the rows it writes.
    fresh = in_place.step(paged_module, step_kwargs([20, 21, 22], []))
    assert fresh is not None and fresh.index.tolist() == [20, 21, 22]


def test_a_call_the_c_attention_does_not_compute_whole_gets_no_step(paged_module: Any) -> None:
    in_place = InPlace(in_place_cache(), StepHooks())
    read = [0, 1, 2, 5, 7, 9, 10]
    assert in_place.step(paged_module, step_kwargs([5, 9, 10], read, block_table=torch.zeros(1, 2))) is None
    assert in_place.step(paged_module, step_kwargs([5, 9, 10], read, softcap=30.0)) is None
    assert in_place.step(paged_module, step_kwargs([5, 9, 10], read, max_length_q=attention.LONG_ROWS + 1)) is None
    assert in_place.step(tiny(kv_heads=2).model.layers[0].self_attn, step_kwargs([5, 9, 10], read)) is None  # unmarked
    with pytest.raises(RuntimeError, match="past the cache"):
        in_place.step(paged_module, step_kwargs([5, 9, 32], read))


def test_page_marks_every_attention_module_after_its_probe(tmp_path: Any) -> None:
    model = tiny(kv_heads=2)
    with capture_logs() as logs:
        assert grouped.page(model, torch, tmp_path) == 2
    assert [callable(getattr(layer.self_attn, attention.PAGED, None)) for layer in model.model.layers] == [True, True]
    assert [entry["event"] for entry in logs if entry["log_level"] == "info"][-1:] == ["attention_paged"]


def test_a_head_size_the_c_attention_cannot_take_leaves_the_model_as_it_was(tmp_path: Any) -> None:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=2,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).eval()  # heads of 8 floats: the C attention takes multiples of 16
    with capture_logs() as logs:
        assert grouped.page(model, torch, tmp_path) == 0
    assert not any(hasattr(m, attention.PAGED) for m in model.modules())
    assert logs[-1] == {"event": "attention_not_paged", "log_level": "warning", "reason": "paged attention failed (-1)"}


def test_a_model_whose_attention_is_not_sdpa_is_left_alone(tmp_path: Any) -> None:
    model = tiny(kv_heads=2)
    model.config._attn_implementation = "eager"  # continuous batching would call transformers' paged eager
    with capture_logs() as logs:
        assert grouped.page(model, torch, tmp_path) == 0
    assert not any(hasattr(m, attention.PAGED) for m in model.modules())
    assert logs == [
        {
            "event": "attention_not_paged",
            "log_level": "warning",
            "reason": "the model's attention is 'eager', not 'sdpa'",
        }
    ]


def test_a_cache_with_layers_of_another_kind_is_left_to_gather_as_the_library_does() -> None:
    from types import SimpleNamespace

    class CompressedAllocator:  # neither full nor sliding-window attention
        index = 0

    def library_update(*args: Any) -> str:
        return "the library's"

    cache = SimpleNamespace(cache_allocators={0: CompressedAllocator()}, update=library_update)
    with capture_logs() as logs:
        assert places.reads_in_place(cache) is False
    assert cache.update is library_update
    assert logs == [
        {
            "event": "attention_not_paged",
            "log_level": "warning",
            "reason": "the model has other than full- and sliding-attention layers",
        }
    ]


def test_without_avx512_or_avx2_the_c_attention_refuses_and_nothing_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "FLAGS", (*compiler.FLAGS, "-mno-avx512f", "-mno-avx2"))  # what such a CPU gets built
    with pytest.raises(RuntimeError, match="the CPU has neither AVX-512 nor AVX2 with FMA"):
        attention.function(attention.build(builds.DIRECTORY))
    model = tiny(kv_heads=2)
    with capture_logs() as logs:
        assert grouped.page(model, torch, builds.DIRECTORY) == 0
    assert not grouped.paged(model)
    assert logs[-1] == {
        "event": "attention_not_paged",
        "log_level": "warning",
        "reason": "the CPU has neither AVX-512 nor AVX2 with FMA",
    }


def test_the_function_the_marked_modules_call_is_the_one_that_dispatches_marked_calls(paged_module: Any) -> None:
    """The batched steps' layers attend in one C call only where the module's attention function is grouped_sdpa
    (InPlace.step reads its mark): dispatch names it in the marked modules' config."""
    functions = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
    called = functions.get_interface(paged_module.config._attn_implementation, None)
    assert called is grouped.grouped_sdpa
    assert getattr(called, attention.DISPATCHES) is True


# -- a request's rows in blocks (attention.c's attend_n): each row's bits are its own ------------------------------


BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "no-f16c": ("-mno-avx512f", "-mno-f16c")}
"""attention.c's builds: this CPU's, what a CPU without AVX-512 gets, and an AVX2 one without F16C (fp16 widened in
plain C)."""


@pytest.fixture(scope="module", params=list(BUILDS))
def part_functions(request: pytest.FixtureRequest) -> dict[bool, Any]:
    """``ttft_attention_part`` (False: an fp32 cache) and ``ttft_attention_part_f16`` (True) of one build."""
    library = builds.built(attention.build, *BUILDS[request.param])
    arguments = (*attention.ARGUMENTS[:-1], ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
    return {
        half: compiler.load(library, attention.PAGED_PART_HALF if half else attention.PAGED_PART, arguments)
        for half in (False, True)
    }


@dataclasses.dataclass(frozen=True)
class Rows:
    """A step's queries (``[rows, heads * dim]``) of ``requests`` (new rows, keys) side by side, over a KV cache
    (``[slots, kv_heads * dim]``, fp16 values or fp32) whose rows ``index`` reads scattered."""

    requests: list[tuple[int, int]]
    shape: tuple[int, int, int]  # heads, KV heads, dim
    q: Any
    k: Any
    v: Any
    index: Any

    @staticmethod
    def random(requests: list[tuple[int, int]], shape: tuple[int, int, int], half: bool, seed: int) -> Rows:
        rng = np.random.default_rng(seed)
        heads, kv_heads, dim = shape
        rows, keys = sum(n for n, _ in requests), sum(k for _, k in requests)
        slots = 2 * keys + 5
        k, v = (
            (rng.standard_normal((slots, kv_heads * dim)) * 2).astype(np.float16 if half else np.float32) for _ in "kv"
        )
        q = rng.standard_normal((rows, heads * dim)).astype(np.float32)
        return Rows(requests, shape, q, k, v, rng.permutation(slots)[:keys].astype(np.int64))

    def starts(self, of: int) -> Any:
        """Where each request's rows (``of`` 0) or keys (1) start, with the total last."""
        return np.cumsum([0, *(request[of] for request in self.requests)]).astype(np.int32)

    @property
    def parts(self) -> int:
        """A row's heads of one KV head a part."""
        return len(self.q) * self.shape[1]

    def computed(self, function: Any, cuts: list[int]) -> Any:
        """The attention computed part range by part range (``cuts``: the ranges' bounds) into one output."""
        heads, kv_heads, dim = self.shape
        cu_q, cu_k, out = self.starts(0), self.starts(1), np.full_like(self.q, np.nan)
        at = [a.ctypes.data for a in (self.q, self.k, self.v, self.index, cu_q, cu_k, out)]
        for first, last in itertools.pairwise(cuts):
            assert function(
                at[0], heads, kv_heads, dim, at[1], at[2], kv_heads * dim, dim, at[3], at[4], at[5],
                len(self.requests), 512, dim**-0.5, first, last, at[6],
            ) == 0  # fmt: skip
        return out

    def row_alone(self, function: Any, request: int, row: int) -> Any:
        """Row ``row`` of request ``request`` computed as a request of one row over the keys it sees."""
        (new, keys), q0, k0 = self.requests[request], self.starts(0)[request], self.starts(1)[request]
        seen = keys - new + row + 1
        alone = dataclasses.replace(
            self, requests=[(1, seen)], q=self.q[q0 + row][None], index=self.index[k0 : k0 + seen]
        )
        return alone.computed(function, [0, alone.parts])[0]


SHAPES = {"smollm2": (9, 3, 64), "no-groups": (6, 6, 16), "8-a-kv-head": (16, 2, 32), "dim-128": (10, 5, 128)}
SHAPES["6-a-kv-head-dim-48"] = (12, 2, 48)  # a group of 4 heads then one of 2, a head size of no inlined case
# Rows of one request see one key more each: decodes, short prompts of odd and even rows, prompts behind a cached
# prefix, one whose rows start at its first key, side by side.
ROWS = [(1, 40), (5, 5), (1, 1), (2, 2), (3, 20), (7, 300), (4, 9), (30, 70), (1, 17), (9, 9)]


@pytest.mark.parametrize("half", [False, True], ids=["fp32-cache", "f16-cache"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_each_row_of_a_request_is_the_bits_of_that_row_alone_over_the_keys_it_sees(
    part_functions: dict[bool, Any], shape: tuple[int, int, int], half: bool
) -> None:
    rows = Rows.random(ROWS, shape, half, seed=sum(shape))
    whole = rows.computed(part_functions[half], [0, rows.parts])
    assert not np.isnan(whole).any()
    for s, (new, _) in enumerate(ROWS):
        for row in range(new):
            alone = rows.row_alone(part_functions[half], s, row)
            assert np.array_equal(whole[rows.starts(0)[s] + row], alone), (s, row)


@pytest.mark.parametrize("half", [False, True], ids=["fp32-cache", "f16-cache"])
@pytest.mark.parametrize("shape", [SHAPES["smollm2"], SHAPES["no-groups"]], ids=["smollm2", "no-groups"])
def test_parts_split_at_any_bound_or_in_chunks_of_any_size_give_the_same_bits(
    part_functions: dict[bool, Any], shape: tuple[int, int, int], half: bool
) -> None:
    """The helper threads share a step's attention by ranges of parts (helpers.c): a block of rows never takes a
    part outside the range it is given, and each row's bits do not depend on the block it falls in."""
    requests = [(1, 30), (5, 5), (7, 40), (2, 2), (4, 19)]
    rows = Rows.random(requests, shape, half, seed=7)
    function, parts = part_functions[half], rows.parts
    whole = rows.computed(function, [0, parts])
    heads, kv_heads, dim = shape
    part_of = np.arange(parts).reshape(-1, kv_heads).repeat(heads // kv_heads * dim, axis=1)  # each output's part
    for cut in range(parts + 1):
        assert np.array_equal(rows.computed(function, [0, cut, parts]), whole), cut
        for first, last in ((0, cut), (cut, parts)):  # nothing written outside the range
            alone = rows.computed(function, [first, last])
            inside = (part_of >= first) & (part_of < last)
            assert np.array_equal(alone[inside], whole[inside]) and np.isnan(alone[~inside]).all(), (first, last)
    for size in range(1, 8):
        assert np.array_equal(rows.computed(function, [*range(0, parts, size), parts]), whole), size


def test_a_row_with_no_key_to_see_gets_zeros_and_the_next_rows_their_own_bits(part_functions: dict[bool, Any]) -> None:
    # Not a step continuous batching builds (more new rows than keys), but a defined one: rows 0 and 1 see nothing.
    rows = Rows.random([(2, 2), (4, 2), (1, 3)], SHAPES["smollm2"], False, seed=9)
    whole = rows.computed(part_functions[False], [0, rows.parts])
    assert np.array_equal(whole[2:4], np.zeros_like(whole[2:4]))
    for row in (2, 3):
        assert np.array_equal(whole[2 + row], rows.row_alone(part_functions[False], 1, row))
