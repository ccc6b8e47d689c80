"""Grouped KV heads in SDPA (engine/attention.py): transformers' attention without the copies, where it takes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from structlog.testing import capture_logs

from ttft_sse.engine import attention
from ttft_sse.engine.hf import HFEngine
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


def test_group_marks_every_attention_module_and_becomes_transformers_sdpa() -> None:
    model = tiny(kv_heads=2)
    with capture_logs() as logs:
        assert attention.group(model, torch) == 2
    assert [getattr(layer.self_attn, attention.MARK, False) for layer in model.model.layers] == [True, True]
    assert transformers.AttentionInterface()["sdpa"] is attention.grouped_sdpa
    assert logs == [{"event": "attention_grouped", "log_level": "info", "modules": 2}]


def test_a_masked_step_reads_the_grouped_heads_in_place_and_gives_the_repeated_heads_result(
    sdpa_calls: list[tuple[int, bool]],
) -> None:
    module = tiny(kv_heads=2).model.layers[0].self_attn
    inputs = step(kv_heads=2)
    want, _ = attention.grouped_sdpa(module, *inputs, scaling=module.scaling)  # not marked: transformers'
    assert sdpa_calls == [(HEADS, False)]  # each KV head copied for its 3 query heads
    setattr(module, attention.MARK, True)
    got, _ = attention.grouped_sdpa(module, *inputs, scaling=module.scaling)
    assert sdpa_calls[1:] == [(2, True)]
    assert got.shape == (1, 5, HEADS, DIM)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Each request's rows are its own attention alone: the mask kept the other one out.
    query, key, value, _ = inputs
    first, _ = attention.grouped_sdpa(
        module, query[:, :, :4], key[:, :, :4], value[:, :, :4], None, scaling=module.scaling, is_causal=True
    )
    second, _ = attention.grouped_sdpa(
        module, query[:, :, 4:], key[:, :, 4:], value[:, :, 4:], None, scaling=module.scaling
    )
    torch.testing.assert_close(got[:, :4], first, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 4:], second, rtol=1e-5, atol=1e-6)


def test_the_calls_it_does_not_take_are_transformers_own(sdpa_calls: list[tuple[int, bool]]) -> None:
    module = tiny(kv_heads=2).model.layers[0].self_attn
    setattr(module, attention.MARK, True)
    query, key, value, mask = step(kv_heads=2)
    # One query row with a mask: transformers folds the groups into rows (3 of them), grouped heads, no flag.
    out, _ = attention.grouped_sdpa(module, query[:, :, :1], key, value, mask[:, :, :1], scaling=module.scaling)
    assert out.shape == (1, 1, HEADS, DIM)
    assert sdpa_calls == [(2, False)]
    with pytest.raises(ValueError, match="softcap"):  # transformers' own refusal
        attention.grouped_sdpa(module, query, key, value, mask, softcap=30.0)


def test_a_model_without_grouped_heads_is_left_alone() -> None:
    model = tiny(kv_heads=HEADS)
    assert attention.group(model, torch) == 0
    assert not any(hasattr(m, attention.MARK) for m in model.modules())


def test_nothing_is_marked_when_grouped_heads_disagree_with_repeated_ones_on_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch.nn.functional.scaled_dot_product_attention

    def wrong_when_grouped(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs) + (1.0 if kwargs.get("enable_gqa") else 0.0)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", wrong_when_grouped)
    model = tiny(kv_heads=2)
    with capture_logs() as logs:
        assert attention.group(model, torch) == 0
    assert not any(hasattr(m, attention.MARK) for m in model.modules())
    assert logs == [
        {
            "event": "attention_not_grouped",
            "log_level": "warning",
            "reason": "SDPA over grouped heads disagrees with repeated heads",
        }
    ]


@pytest.mark.parametrize("grouped", [True, False], ids=["on", "off"])
def test_the_engine_groups_the_bundled_models_attention_on_cpu_unless_told_not_to(
    settings: Settings, grouped: bool
) -> None:
    engine = HFEngine(settings.replace(grouped_attention=grouped))
    engine.load(StageClock())
    marked = [m for m in engine.model.modules() if getattr(m, attention.MARK, False)]
    assert len(marked) == (30 if grouped else 0)  # SmolLM2-135M: 30 layers, 3 KV heads for 9 query heads
