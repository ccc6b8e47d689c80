"""A GGUF file's tensors read by the model's names (engine/kernels/stored.py), and the kernel's check of their codes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.engine.kernels.test_kernel import DIRECTORY, one_thread
from tests.support.ggufs import KINDS, quantised, write_gguf
from ttft_sse.engine.kernels import codes, kernel
from ttft_sse.engine.kernels.stored import UNKNOWN, Place, Stored

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

__all__ = ["one_thread"]  # the kernel runs on one torch thread (an autouse fixture)


def file_of(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A Q4_K, a Q8_0 and an F32 matrix and an F32 vector in a file; gguf's dequantisation of each."""
    q4, dense_4 = quantised((32, 256), "Q4_K", seed=1)
    q8, dense_8 = quantised((16, 64), "Q8_0", seed=2)
    f32 = np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32)
    norm = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    path = tmp_path / "stored.gguf"
    write_gguf(path, {"q4": (q4, "Q4_K"), "q8": (q8, "Q8_0"), "f32": (f32, "F32"), "norm": (norm, "F32")})
    return path, {"q4": dense_4, "q8": dense_8, "f32": f32, "norm": norm}


def test_weights_are_read_by_name_in_the_model_row_order_as_gguf_dequantises_them(tmp_path: Path) -> None:
    path, dense = file_of(tmp_path)
    order = np.arange(32)[::-1].copy()
    stored = Stored(path, {"a.weight": Place("q4", order), "b.weight": Place("q8"), "n.weight": Place("norm")})
    assert (stored.kind("a.weight"), stored.kind("b.weight"), stored.kind("missing.weight")) == (
        "Q4_K",
        "Q8_0",
        UNKNOWN,
    )
    assert stored.tensor("a.weight") is not None and stored.tensor("a.weight").shape == (32, 256)
    assert np.array_equal(stored.dense("a.weight"), dense["q4"][order])
    assert np.array_equal(stored.dense("b.weight"), dense["q8"])
    assert np.array_equal(stored.dense("n.weight"), dense["norm"])
    rows = np.array([0, 7, 31])
    assert np.array_equal(stored.rows("a.weight", rows), dense["q4"][order][rows])
    found = stored.codes("a.weight")
    assert found is not None and found.bits == 4
    assert np.array_equal(found.dense(), dense["q4"][order])  # codes in the model's row order, bit for bit
    assert stored.codes("n.weight") is None  # a vector has no codes


def test_a_mapped_tensor_is_the_file_s_bytes_read_only(tmp_path: Path) -> None:
    path, dense = file_of(tmp_path)
    stored = Stored(path, {"e.weight": Place("q8")})
    rows, tensor = stored.mapped("e.weight")
    assert rows.shape == (16, 2 * 34) and not rows.flags.writeable
    assert np.array_equal(gguf.quants.dequantize(rows[[3, 5]], KINDS["Q8_0"]), dense["q8"][[3, 5]])
    assert tensor.kind_name == "Q8_0"


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_a_k_quant_layer_whose_zero_is_not_exact_stays_off_the_kernel(tmp_path: Path, kind: str) -> None:
    """A super-block of d = 1, dmin = 2**-24 (fp16's least), every sc and m 1 and every code 0: gguf's weight is
    1*0 - 2**-24, but the zero 8 - 2**-24 (16 - 2**-24 for Q5_K) rounds to 8 in fp32, so the codes give -8 + 8 = 0.
    The checked rows include row 0, so the layer gets no codes and keeps the file's fp32 weight."""
    blocks, _ = quantised((16, 256), kind)
    blocks = blocks.copy()
    crafted = np.zeros(blocks.shape[1], np.uint8)  # codes (and Q5_K's fifth bits) 0
    crafted[0:4] = np.array([1.0, 2.0**-24], np.float16).view(np.uint8)  # d, dmin
    crafted[4:8] = crafted[8:12] = 1  # sc and m of blocks 0-3 (their top 2 bits, blocks 4-7's, 0)
    crafted[12:16] = 0x11  # sc and m of blocks 4-7, low 4 bits
    blocks[0] = crafted
    want = gguf.quants.dequantize(blocks, KINDS[kind]).astype(np.float32)
    assert np.all(want[0] == -(2.0**-24))
    assert np.all(codes.decode(blocks, int(KINDS[kind]), (16, 256)).dense()[0] == 0)
    path = tmp_path / "inexact.gguf"
    write_gguf(path, {"w": (blocks, kind)})
    model = torch.nn.Sequential(torch.nn.Linear(256, 16, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(want))
    with capture_logs() as logs:
        applied = kernel.apply(model, Stored(path, {"0.weight": Place("w")}), torch, directory=DIRECTORY)
    assert {"event": "layer_codes_inexact", "log_level": "warning", "layer": "0", "kind": kind} in logs
    assert applied == (None, {kind: "fp32: 1 (its blocks do not give back the file's dequantisation bit for bit)"})
    assert type(model[0]) is torch.nn.Linear
