"""Small GGUF weights made by the tests: blocks quantised by gguf's own quantiser (or, for the K-quants it does not
quantise, by :func:`quantise_k`, a port of llama.cpp's), and linear layers holding them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

KINDS = {
    name: gguf.GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
}
SUPER = 256
"""Inputs a K-quant super-block holds."""


def quantised(shape: tuple[int, int], kind: str, seed: int = 0, sigma: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """A random normal ``shape`` weight (standard deviation ``sigma``) quantised as ``kind``: (raw blocks, gguf's
    dequantisation). gguf quantises the legacy types; :func:`quantise_k` Q4_K and Q5_K; Q6_K's blocks are random
    bytes with a plausible fp16 scale (:func:`random_q6_k`)."""
    rng = np.random.default_rng(seed)
    if kind == "Q6_K":
        blocks = random_q6_k(shape, rng)
    else:
        data = (rng.standard_normal(shape) * sigma).astype(np.float32)
        blocks = quantise_k(data, kind) if kind in ("Q4_K", "Q5_K") else gguf.quants.quantize(data, KINDS[kind])
    return blocks, gguf.quants.dequantize(blocks, KINDS[kind]).astype(np.float32)


def _qkx2(x: np.ndarray, top: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``make_qkx2_quants`` for rows of 32 values (``x``: n x 32, fp32): each row's scale and minimum
    (``w = scale * l - minimum``, ``l`` in 0..top), the best of the first guess and ``nstep + 1`` trial scales by
    least squares weighted by ``av_x + |x|``, each trial from the best minimum so far. Its sums run in another order
    than llama.cpp's, so a close choice between two trials can go the other way: the same bytes in nearly every
    super-block, not in all."""
    f = np.float32
    w = np.sqrt((x * x).sum(-1, keepdims=True) / f(32)) + np.abs(x)
    minimum, high = np.minimum(x.min(-1), f(0)), x.max(-1)
    flat = high == minimum
    sum_w, sum_x = w.sum(-1), (w * x).sum(-1)
    inverse = np.where(flat, f(1), f(top) / np.where(flat, f(1), high - minimum))
    scale = np.where(flat, f(0), f(1) / inverse)
    first = np.clip(np.rint(inverse[:, None] * (x - minimum[:, None])), 0, top)
    best = (w * (scale[:, None] * first + minimum[:, None] - x) ** 2).sum(-1)
    for step in range(nstep + 1):
        width = np.where(flat, f(1), high - minimum)
        trial = np.clip(np.rint(((f(rmin) + f(rdelta) * step + top) / width)[:, None] * (x - minimum[:, None])), 0, top)
        sum_l, sum_l2, sum_xl = (w * trial).sum(-1), (w * trial * trial).sum(-1), (w * trial * x).sum(-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        this_min = np.where(positive, f(0), this_min)
        error = (w * (this_scale[:, None] * trial + this_min[:, None] - x) ** 2).sum(-1)
        better = (det > 0) & (error < best) & ~flat
        best = np.where(better, error, best)
        scale, minimum = np.where(better, this_scale, scale), np.where(better, this_min, minimum)
    return scale.astype(f), (-minimum).astype(f)


def quantise_k(data: np.ndarray, kind: str) -> np.ndarray:
    """``data`` (rows x a multiple of 256, fp32) as Q4_K or Q5_K blocks, as llama.cpp's ``quantize_row_q4_K_ref``
    and ``..._q5_K_ref`` (without an importance matrix) make them: each block of 32 its scale and minimum
    (:func:`_qkx2`), each super-block of 256 ``d`` and ``dmin`` (fp16) of which the blocks' 6-bit ``sc`` and ``m``
    are multiples, then each value's code ``round((x + dmin*m) / (d*sc))``."""
    f = np.float32
    top, rmin, nstep = (15, -1.0, 20) if kind == "Q4_K" else (31, -0.5, 15)
    rows, inputs = data.shape
    assert inputs % SUPER == 0, f"{kind} needs whole super-blocks of {SUPER} inputs, not {inputs}"
    x = data.astype(f).reshape(-1, 8, 32)  # super-blocks x blocks x inputs
    scale, minimum = (v.reshape(-1, 8) for v in _qkx2(x.reshape(-1, 32), top, rmin, 0.1, nstep))
    largest_scale, largest_min = scale.max(-1, keepdims=True), minimum.max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        sc = np.minimum(np.rint(np.where(largest_scale > 0, f(63) / largest_scale, f(0)) * scale), 63)
        m = np.minimum(np.rint(np.where(largest_min > 0, f(63) / largest_min, f(0)) * minimum), 63)
    sc, m = np.maximum(sc, 0).astype(np.uint8), np.maximum(m, 0).astype(np.uint8)
    d, dmin = (largest_scale / f(63)).astype(np.float16), (largest_min / f(63)).astype(np.float16)
    step = d.astype(f) * sc.astype(f)
    offset = dmin.astype(f) * m.astype(f)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint((x + offset[..., None]) / step[..., None])
    codes = np.where(step[..., None] != 0, np.clip(codes, 0, top), 0).astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), np.uint8)  # as gguf's Q4_K.get_scale_min reads them
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    low = (codes & 0x0F).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)  # blocks 2j and 2j+1 share 32 bytes
    parts = [d.view(np.uint8), dmin.view(np.uint8), packed]
    if kind == "Q5_K":
        fifth = (codes >> 4).astype(np.uint8)  # super-blocks x blocks x inputs: block j's is bit j
        parts.append((fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8))
    parts.append(nibbles)
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def random_q6_k(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Q6_K blocks of random codes and 8-bit scales, with an fp16 ``d`` near 1e-3."""
    rows, inputs = shape
    blocks = rng.integers(0, 256, size=(rows * inputs // SUPER, 210), dtype=np.uint8)
    blocks[:, 208:210] = (np.abs(rng.standard_normal((len(blocks), 1))) * 1e-3).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


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
    """A GGUF file of ``tensors``: by name, an fp32 or fp16 array (``kind`` "F32" or "F16"), or the raw blocks of
    any GGUF type, ``(out, bytes a row)``, with its name as ``kind``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        if kind in ("F32", "F16"):
            writer.add_tensor(name, data.astype(np.float32 if kind == "F32" else np.float16))
        else:
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_model_gguf(
    path: Path, architecture: Any, metadata: dict[str, Any], tokens: tuple[str, ...], tensors: dict[str, Any]
) -> None:
    """A model's GGUF, as llama.cpp's converter writes one: ``architecture`` (a ``gguf.MODEL_ARCH``), its metadata
    (keys without the architecture's prefix), a sentencepiece vocabulary of ``tokens`` (``<unk>``, ``<s>``, ``</s>``
    first; a BOS added) and ``tensors`` as :func:`write_gguf` takes them."""
    name = gguf.MODEL_ARCH_NAMES[architecture]
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_name(f"tiny-{name}")
    for key, value in metadata.items():
        full = f"{name}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(tokens))
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(tokens) - 3)])
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    for tensor, (data, kind) in tensors.items():
        if kind in ("F32", "F16"):
            writer.add_tensor(tensor, data.astype(np.float32 if kind == "F32" else np.float16))
        else:
            writer.add_tensor(tensor, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
