"""Small GGUF weights made by the tests: blocks quantised by gguf's own quantiser, and linear layers holding them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

KINDS = {
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
}


def quantised(shape: tuple[int, int], kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A random ``shape`` weight quantised by gguf's own quantiser: (raw blocks, gguf's dequantisation)."""
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    blocks = gguf.quants.quantize(data, KINDS[kind])
    return blocks, gguf.quants.dequantize(blocks, KINDS[kind]).astype(np.float32)


def layers_of(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """A Q4_1, a Q8_0 and an F32 weight in a file; linear layers holding them, in an order that chains (64 → 96 →
    32 → 16 features: tests/engine/cpu/test_kernel.py runs them as a model), the Q4_1 rows reordered as transformers'
    loader does to q and k."""
    q4, dense_4 = quantised((96, 64), "Q4_1", seed=1)
    q8, dense_8 = quantised((32, 96), "Q8_0", seed=2)
    other = np.random.default_rng(3).standard_normal((16, 32)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    if not path.exists():
        write_gguf(path, {"up": (q4, "Q4_1"), "down": (q8, "Q8_0"), "other": (other, "F32")})
    layers = {"up": torch.nn.Linear(64, 96), "down": torch.nn.Linear(96, 32), "other": torch.nn.Linear(32, 16)}
    with torch.no_grad():
        layers["up"].weight.copy_(torch.from_numpy(dense_4[::-1].copy()))
        layers["down"].weight.copy_(torch.from_numpy(dense_8))
        layers["other"].weight.copy_(torch.from_numpy(other))
    return layers, path


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        if kind == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=KINDS[kind])  # the blocks: (out, bytes a row)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
