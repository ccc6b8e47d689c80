"""Attention on CPU: grouped KV heads in SDPA, transformers' attention without the copies, where it takes
(engine/library/grouped.py); and each request's rows against its own keys read from the paged cache in place
(engine/kernels/attention.py, attention.c), against SDPA for each request alone."""

from __future__ import annotations

from typing import Any

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
