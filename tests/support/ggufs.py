"""Small GGUF weights made by the tests: blocks quantised by gguf's own quantiser (or, for the K-quants it does not
quantise, by :func:`quantise_k` and :func:`quantise_q6_k`, ports of llama.cpp's), and linear layers holding them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

KINDS = {
    name: gguf.GGMLQuantizationType[name]
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")
}
SUPER = 256
"""Inputs a K-quant super-block holds."""


def quantised(shape: tuple[int, int], kind: str, seed: int = 0, sigma: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """A random normal ``shape`` weight (standard deviation ``sigma``) quantised as ``kind``: (raw blocks, gguf's
    dequantisation). gguf quantises the legacy types; :func:`quantise_k` Q4_K and Q5_K; :func:`quantise_q6_k`
    Q6_K."""
    data = (np.random.default_rng(seed).standard_normal(shape) * sigma).astype(np.float32)
    return quantise(data, kind)


def quantise(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """``data`` (fp32) quantised as ``kind``: (raw blocks, gguf's dequantisation)."""
    if kind in ("Q4_K", "Q5_K"):
        blocks = quantise_k(data, kind)
    elif kind == "Q6_K":
        blocks = quantise_q6_k(data)
    else:
        blocks = gguf.quants.quantize(data, KINDS[kind])
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


def _qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``make_qx_quants`` (``rmse_type`` 1, no importance) for rows of 16 values (``x``: n x 16, fp32):
    each row's scale and codes 0..2*nmax-1 (``w = scale * (l - nmax)``): the first guess ``-nmax / max`` (``max``
    the value of largest magnitude, the first such), then 18 trial scales, each kept where it explains more of
    ``sum(x^2 * x * l)`` by least squares weighted by ``x^2``. Sums run input after input, as llama.cpp's do."""
    f = np.float32
    largest = x[np.arange(len(x)), np.argmax(np.abs(x), axis=1)]
    empty = np.abs(largest) < f(1e-15)
    safe = np.where(empty, f(1), largest)
    weight = x * x

    def trial(inverse: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        codes = np.clip(np.rint(inverse[:, None] * x), -nmax, nmax - 1).astype(f)
        sum_lx, sum_l2 = np.zeros(len(x), f), np.zeros(len(x), f)
        for i in range(x.shape[1]):
            sum_lx += weight[:, i] * x[:, i] * codes[:, i]
            sum_l2 += weight[:, i] * codes[:, i] * codes[:, i]
        return codes, sum_lx, sum_l2

    codes, sum_lx, sum_l2 = trial(f(-nmax) / safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(sum_l2 != 0, sum_lx / sum_l2, f(0)).astype(f)
    best = scale * sum_lx
    for step in (*range(-9, 0), *range(1, 10)):
        candidate, lx, l2 = trial(-(f(nmax) + f(0.1) * f(step)) / safe)
        better = (l2 > 0) & (lx * lx > best * l2)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, lx / l2, scale).astype(f)
        best = np.where(better, scale * lx, best)
        codes = np.where(better[:, None], candidate, codes)
    return np.where(empty, f(0), scale), np.where(empty[:, None], 0, codes + nmax).astype(np.uint8)


def quantise_q6_k(data: np.ndarray) -> np.ndarray:
    """``data`` (rows x a multiple of 256, fp32) as Q6_K blocks, as llama.cpp's ``quantize_row_q6_K_ref`` (what
    llama-quantize uses without an importance matrix) makes them: each 16 inputs a scale (:func:`_qx`), each
    super-block ``d`` (fp16) = the scale of largest magnitude over -128 and the signed 8-bit ``sc`` of each 16
    inputs, then each value's code ``round(x / (d*sc))`` clamped to -32..31, plus 32."""
    f = np.float32
    rows, inputs = data.shape
    assert inputs % SUPER == 0, f"Q6_K needs whole super-blocks of {SUPER} inputs, not {inputs}"
    x = data.astype(f).reshape(-1, 16, 16)  # super-blocks x groups x inputs
    scales, codes = _qx(x.reshape(-1, 16), 32)
    scales, codes = scales.reshape(-1, 16), codes.reshape(-1, 16, 16)
    largest = scales[np.arange(len(scales)), np.argmax(np.abs(scales), axis=1)]
    empty = np.abs(largest) < f(1e-15)
    inverse = f(-128) / np.where(empty, f(1), largest)
    d = np.where(empty, f(0), f(1) / inverse).astype(np.float16)
    sc = np.minimum(127, np.rint(inverse[:, None] * scales)).astype(np.int8)
    step = d.astype(f)[:, None] * sc.astype(f)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = (np.clip(np.rint(x / step[..., None]), -32, 31) + 32).astype(np.uint8)
    codes = np.where(step[..., None] != 0, again, codes).reshape(-1, 2, 4, 32)  # halves x quarters x inputs
    codes = np.where(empty[:, None, None, None], 0, codes).astype(np.uint8)
    low = codes & 0x0F
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    high = codes >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    sc = np.where(empty[:, None], 0, sc)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def layers_of(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """A Q4_1, a Q8_0 and an F32 weight in a file; linear layers holding them, in an order that chains (64 → 96 →
    32 → 16 features: tests/engine/kernels/test_kernel.py runs them as a model), the Q4_1 rows reordered as
    transformers' loader does to q and k."""
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


# A whole Llama-shaped model in a GGUF file, as llama-quantize's Q4_K_M lays one out, with random blocks: what the
# loading tests and the memory test load. Its tokenizer is the bundled model's (copied from that file's metadata).
Q4_K_M_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}
"""The types of a Q4_K_M file's tensors that are not Q4_K (llama-quantize gives half the v and down layers Q6_K)."""
_BLOCK_BYTES = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34)}


def random_blocks(shape: tuple[int, int], kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random ``kind`` blocks for an ``(out, in)`` weight whose values spread about 0.02 either side of zero: random
    codes and scales, with the fp16 factors set so (no quantiser runs: fast at hundreds of MB)."""
    out, inputs = shape
    per_block, size = _BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, (out, inputs // per_block, size), dtype=np.uint8)
    if kind == "Q4_K":  # w = d*sc*q - dmin*m, q 0..15, sc and m 0..63
        d = rng.uniform(1.0e-4, 2.0e-4, raw.shape[:2]).astype(np.float16)
        raw[..., 0:2] = d[..., None].view(np.uint8)
        raw[..., 2:4] = (d * np.float16(7.5))[..., None].view(np.uint8)
    elif kind == "Q6_K":  # w = d*sc*(q-32), sc -128..127
        d = rng.uniform(1.0e-5, 2.0e-5, raw.shape[:2]).astype(np.float16)
        raw[..., 208:210] = d[..., None].view(np.uint8)
    else:  # Q8_0: w = d*q
        d = rng.uniform(1.0e-4, 3.0e-4, raw.shape[:2]).astype(np.float16)
        raw[..., 0:2] = d[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def tokenizer_fields(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """The ``tokenizer.*`` fields of the GGUF file at ``path``: (key, value, type, element type)."""
    reader = gguf.GGUFReader(str(path))
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), kind, sub))
    return fields


def write_llama(
    path: Path,
    *,
    tokenizer_from: Path,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 512,
    seed: int = 0,
    tied: bool = False,
) -> Path:
    """A Llama-shaped Q4_K_M GGUF at ``path`` with random blocks (:func:`random_blocks`) and the tokenizer of the
    GGUF file ``tokenizer_from``; ``tied``: no output tensor (the LM head is the token embedding)."""
    fields = tokenizer_fields(tokenizer_from)
    vocab = next(len(value) for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-q4_k_m")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, value, kind, sub in fields:
        writer.add_key_value(key, value, kind, sub_type=sub)
    head = hidden // heads

    def matrix(name: str, out: int, inputs: int) -> None:
        kind = Q4_K_M_TYPES.get(name.split(".")[-1], "Q4_K")
        writer.add_tensor(f"{name}.weight", random_blocks((out, inputs), kind, rng), raw_dtype=KINDS[kind])

    matrix("token_embd", vocab, hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.attn_q", heads * head, hidden)
        matrix(f"blk.{i}.attn_k", kv_heads * head, hidden)
        matrix(f"blk.{i}.attn_v", kv_heads * head, hidden)
        matrix(f"blk.{i}.attn_output", hidden, heads * head)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.ffn_gate", ffn, hidden)
        matrix(f"blk.{i}.ffn_up", ffn, hidden)
        matrix(f"blk.{i}.ffn_down", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        matrix("output", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sequential(path: Path, reversed_rows: tuple[str, ...] = ()) -> Any:
    """The file's tensors for a ``torch.nn.Sequential`` of its matrices: layer ``i``'s weight is the file's ``i``-th
    tensor, its rows reversed for those named in ``reversed_rows`` (as transformers' loader reorders q and k rows)."""
    from ttft_sse.engine.kernels.stored import Place, Stored, table

    tensors = table(path)
    places = {}
    for i, (name, tensor) in enumerate(tensors.items()):
        order = np.arange(tensor.shape[0])[::-1].copy() if name in reversed_rows else None
        places[f"{i}.weight"] = Place(name, order)
    return Stored(path, places, tensors)


def named(path: Path) -> Any:
    """The file's tensors for a model whose modules are named as the file's tensors are (``<name>.weight``)."""
    from ttft_sse.engine.kernels.stored import Place, Stored, table

    tensors = table(path)
    return Stored(path, {f"{name}.weight": Place(name) for name in tensors}, tensors)
