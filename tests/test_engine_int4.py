"""Int4 linear layers from a GGUF's own Q4_0/Q4_1 blocks (engine/int4.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.test_engine_batched import collect, prompt_of
from tests.test_engine_codes import KINDS, quantised, write_gguf
from ttft_sse.engine import codes, int4
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.batched import BatchedEngine
from ttft_sse.engine.hf import HFEngine
from ttft_sse.engine.models import ModelSource
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

needs_kernel = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="the engine uses torch's CPU int4 kernel only with AVX-512",
)


def linear_of(blocks: np.ndarray, dense: np.ndarray, bias: Any = None) -> Any:
    out, inputs = dense.shape
    layer = torch.nn.Linear(inputs, out, bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(dense))
        if bias is not None:
            layer.bias.copy_(bias)
    int4._attach(layer, codes.decode(blocks, int(KINDS["Q4_1"]), (out, inputs)), torch)
    return layer


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("shape", "int4_calls"), [((2, 4), 1), ((1, 1), 1), ((3, 3), 0), ((8, 40), 0)])
def test_the_int4_kernel_takes_1_to_8_rows_the_bf16_copy_more_both_the_dense_layer_to_bf16_rounding(
    monkeypatch: pytest.MonkeyPatch, bias: bool, shape: tuple[int, int], int4_calls: int
) -> None:
    blocks, dense = quantised((96, 128), "Q4_1")
    b = torch.linspace(-1, 1, 96) if bias else None
    layer = linear_of(blocks, dense, b)
    calls: list[int] = []
    real = int4._int4_mm
    monkeypatch.setattr(int4, "_int4_mm", lambda *args: calls.append(args[1].shape[0]) or real(*args))
    x = torch.randn(*shape, 128)  # [batch, tokens, features], as the model calls it
    with torch.no_grad():
        got = layer(x)
    want = torch.nn.functional.linear(x.to(torch.bfloat16).float(), torch.from_numpy(dense), b)
    assert got.shape == (*shape, 96) and got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
    assert float((got - want).abs().max()) > 0  # bf16 rounding is there: not the fp32 GEMM
    assert calls == [shape[0] * shape[1]] * int4_calls
    assert list(int4.INT4_ROWS) == list(range(1, 9))


@needs_kernel
def test_each_row_of_the_int4_result_is_the_same_bits_whatever_else_the_batch_holds() -> None:
    blocks, dense = quantised((192, 576), "Q4_1")
    layer = linear_of(blocks, dense)
    x = torch.randn(8, 576)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])
        for rows in (2, 3, 5, 8):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@needs_kernel
def test_apply_replaces_exactly_the_layers_whose_weights_the_file_holds_as_q4(tmp_path: Path) -> None:
    q4_1, dense_1 = quantised((96, 64), "Q4_1", seed=1)
    q4_0, dense_0 = quantised((64, 96), "Q4_0", seed=2)
    other = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    order = np.random.default_rng(4).permutation(96)  # as transformers' loader permutes q and k rows
    write_gguf(
        path,
        {
            "blk.0.up.weight": (q4_1, "Q4_1"),
            "blk.0.down.weight": (q4_0, "Q4_0"),
            "blk.0.other.weight": (other, "F32"),
        },
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64), torch.nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(dense_1[order]))
        model[1].weight.copy_(torch.from_numpy(dense_0))
        model[2].weight.copy_(torch.from_numpy(other))
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = model(x.to(torch.bfloat16).float())

    with capture_logs() as logs:
        assert int4.apply(model, path, torch) == 2
    assert logs == [{"event": "weights_int4", "log_level": "info", "layers": 2, "bf16_only": 1}]
    assert [type(layer).__name__ for layer in model] == ["Int4Linear"] * 3
    assert [layer.codes is not None for layer in model] == [True, True, False]  # the F32 one: its bf16 copy only
    assert [layer.weight.numel() for layer in model] == [0, 0, 32 * 64]  # fp32 weights with codes are dropped
    with torch.no_grad():
        got = model(x)
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


def test_apply_changes_nothing_and_says_why_without_an_avx512_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    with capture_logs() as logs:
        assert int4.apply(model, tmp_path / "unread.gguf", torch) == 0
    assert type(model[0]) is torch.nn.Linear
    assert logs == [
        {
            "event": "weights_not_int4",
            "log_level": "warning",
            "reason": "the int4 kernel is used on AVX-512 only; this CPU: AVX2",
        }
    ]


@needs_kernel
async def test_the_bundled_model_streams_from_int4_layers_when_asked(settings: Settings) -> None:
    """Every decoder linear of the bundled Q4_1 file gets its codes; the LM head (Q8_0 in the file) does not; a
    decode step (one row a stream) goes through the kernel, and the greedy answer is still right."""
    engine = BatchedEngine(dataclasses.replace(settings, int4_weights=True))
    with capture_logs() as logs:
        engine.load(StageClock())
    try:
        model = engine.model
        layers = [m for m in model.modules() if isinstance(m, int4.int4_linear_class()) and m.codes is not None]
        assert len(layers) == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down
        assert isinstance(model.lm_head, int4.int4_linear_class()) and model.lm_head.codes is None  # Q8_0
        assert engine.info.weights == "int4+bf16-packed"
        assert {"event": "weights_int4", "log_level": "info", "layers": len(layers), "bf16_only": 1} in logs
        rows: list[int] = []
        width = layers[0].in_features
        hook = layers[0].register_forward_hook(lambda _m, args, _out: rows.append(args[0].numel() // width))
        text, finished = await collect(
            engine.stream(prompt_of(engine, "What is the capital of France?"), SamplingParams(max_tokens=12))
        )
        hook.remove()
    finally:
        await engine.close()
    assert "Paris" in text, text
    assert finished.usage.completion_tokens >= 2
    assert rows.count(1) == finished.usage.completion_tokens - 1  # every decode step after the prompt's


@pytest.mark.parametrize(
    ("kind", "on_cpu_in_fp32", "reason", "layout"),
    [
        ("directory", True, "int4 codes are read from a GGUF file", "column-major+packed"),
        ("gguf", False, "int4 codes are for fp32 on CPU", "as loaded"),
    ],
)
def test_asking_for_int4_where_it_cannot_apply_says_why_and_changes_nothing_else(
    settings: Settings, kind: str, on_cpu_in_fp32: bool, reason: str, layout: str
) -> None:
    engine = HFEngine(dataclasses.replace(settings, int4_weights=True))
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    with capture_logs() as logs:
        source = ModelSource(kind, "unread", "tiny")  # type: ignore[arg-type]
        got = engine._arrange(model, torch, source, "unread", on_cpu_in_fp32=on_cpu_in_fp32)  # type: ignore[arg-type]
    assert got == layout
    assert {"event": "weights_not_int4", "log_level": "warning", "reason": reason} in logs
    assert not any(isinstance(m, int4.int4_linear_class()) for m in model.modules())


@needs_kernel
def test_a_kernel_that_disagrees_puts_every_layer_back_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, path = tiny_q4_model(tmp_path)
    real = int4._int4_mm
    monkeypatch.setattr(int4, "_int4_mm", lambda *args: real(*args) * 1.1)
    with capture_logs() as logs:
        assert int4.apply(model, path, torch) == 0
    assert type(model[0]) is torch.nn.Linear and not hasattr(model[0], "codes") and not hasattr(model[0], "wide")
    assert logs == [
        {
            "event": "weights_not_int4",
            "log_level": "warning",
            "reason": "the CPU int4 or bf16 kernel disagrees with the fp32 GEMM at 8 rows",
        }
    ]


@needs_kernel
def test_a_file_without_q4_layers_changes_nothing_and_says_so(tmp_path: Path) -> None:
    dense = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    path = tmp_path / "f32.gguf"
    write_gguf(path, {"blk.0.up.weight": (dense, "F32")})
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(dense))
    with capture_logs() as logs:
        assert int4.apply(model, path, torch) == 0
    assert type(model[0]) is torch.nn.Linear and not hasattr(model[0], "wide")
    assert logs == [
        {
            "event": "weights_not_int4",
            "log_level": "warning",
            "reason": "no linear weight of the model is stored as Q4_0 or Q4_1 in the file",
        }
    ]


def tiny_q4_model(tmp_path: Path) -> tuple[Any, Path]:
    blocks, dense = quantised((96, 64), "Q4_1")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, {"blk.0.up.weight": (blocks, "Q4_1")})
    torch.manual_seed(0)  # the second layer (no codes) the same in every copy
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 8, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(dense[::-1].copy()))  # rows reordered
    return model, path
