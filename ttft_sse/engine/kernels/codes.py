"""A GGUF file's own quantised blocks, read into the codes the kernels multiply by.

transformers loads a GGUF by expanding every weight to fp32 with ``gguf``'s dequantisation (the bundled SmolLM2 is
Q4_1, its embedding and tied LM head Q8_0). Kept as codes, a weight is 4.5 to 8.5 bits an input instead of 32: what
a decode step, bound by the bytes it reads, gains by. The engine's kernels (engine/kernels/kernel.py) multiply by
:class:`Codes`: a 4-bit or an 8-bit code an input, one fp32 scale and one fp32 zero a block of 32 inputs (16 for
Q6_K), ``w = q * scale + zero`` in one fused multiply-add. These GGUF types are read into that form (:data:`FORMATS`):

====== ====================== =========== ========= ======================
type   gguf's weight          codes       scale     zero
====== ====================== =========== ========= ======================
Q4_0   ``d*(q-8)``            4-bit q-8   d         -0.0
Q4_1   ``d*q + m``            4-bit q-8   d         m + 8*d
Q5_0   ``d*(q-16)``           8-bit q-16  d         -0.0
Q5_1   ``d*q + m``            8-bit q-16  d         m + 16*d
Q8_0   ``d*q``                8-bit q     d         -0.0
Q4_K   ``(d*sc)*q - dmin*m``  4-bit q-8   d*sc      8*(d*sc) - dmin*m
Q5_K   ``(d*sc)*q - dmin*m``  8-bit q-16  d*sc      16*(d*sc) - dmin*m
Q6_K   ``(d*sc)*(q-32)``      8-bit q-32  d*sc      -0.0, each 16 inputs
====== ====================== =========== ========= ======================

``d``, ``dmin`` and the legacy types' ``m`` are the file's fp16 values; a K-quant's ``sc`` and ``m`` are its 6-bit
ones for each 32 inputs of a super-block of 256; Q6_K's ``sc`` is a signed byte for each 16 inputs (its codes
:data:`SIXTEEN`: 8-bit codes, a scale each 16 inputs, no zero). A scale is exact in fp32 (11 bits times 6 at most;
Q6_K's 11 times 7) and so is its product with a code (17 bits times 5 at most; Q6_K's 18 times 5), so the one
rounding of ``fma(code, scale, zero)`` is that of the sum,
as in gguf's ``scale*q + m`` (or ``- dmin*m``): the weights are gguf's bit for bit wherever the zero itself is exact
in fp32 (two values of a few bits each, of similar size: nearly always), and a zero of -0.0 adds nothing, not even
to a -0.0 (:class:`Codes`). Where the zero is not exact, the match (engine/kernels/matches.py) finds out, and the
layer stays fp32: correctness never rests on it.

F16, BF16 and F32 matrices are read as the weights themselves (:data:`DENSE`: the kernel's dense layouts, which widen
fp16 and bf16 exactly as it reads them). Other types stay fp32 (engine/kernels/matches.py's ``why_not``): Q3_K and Q2_K
(their 2- and 3-bit codes with a minimum each 16 inputs have no layout here), and the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

BLOCK = 32
"""Inputs a block of :class:`Codes` (a K-quant's super-block holds 8 of them)."""

# GGML type ids (gguf.GGMLQuantizationType) of the types read into Codes.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14

SIXTEEN = 6
"""The ``bits`` of Q6_K's codes: 8-bit codes (q - 32, of 6 bits), a scale each 16 inputs and no zero (the kernel's
third layout, kernel.c)."""

# GGML type ids of the unquantised types, and the ``bits`` of their dense layouts (kernel.c): the values themselves.
F32, F16, BF16 = 0, 1, 30
HALF, BRAIN, FULL = 16, 17, 32
DENSE = {F32: ("F32", FULL), F16: ("F16", HALF), BF16: ("BF16", BRAIN)}
"""The dense types by GGML id: their name and their codes' ``bits``."""
DENSE_DTYPES: dict[int, Any] = {HALF: np.float16, BRAIN: np.uint16, FULL: np.float32}
"""How a dense layout's values are held, by ``bits`` (bf16 as its 16 bits: numpy has no bf16)."""


@dataclass(frozen=True)
class Format:
    """How a GGUF type is stored, and the codes it is read into."""

    name: str
    inputs: int  # inputs a stored block: 32, or a K-quant's super-block of 256
    size: int  # bytes of a stored block
    bits: int  # of its codes in Codes: 4, 8, or SIXTEEN


FORMATS = {
    Q4_0: Format("Q4_0", 32, 18, 4),  # fp16 d, 16 bytes of 4-bit codes
    Q4_1: Format("Q4_1", 32, 20, 4),  # fp16 d, fp16 m, 16 bytes of 4-bit codes
    Q5_0: Format("Q5_0", 32, 22, 8),  # fp16 d, 4 bytes of fifth bits, 16 bytes of low nibbles
    Q5_1: Format("Q5_1", 32, 24, 8),  # fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of low nibbles
    Q8_0: Format("Q8_0", 32, 34, 8),  # fp16 d, 32 signed bytes
    Q4_K: Format("Q4_K", 256, 144, 4),  # fp16 d, fp16 dmin, 12 bytes of 6-bit sc and m, 128 bytes of 4-bit codes
    Q5_K: Format("Q5_K", 256, 176, 8),  # as Q4_K, with 32 bytes of fifth bits before the 128 of low nibbles
    Q6_K: Format("Q6_K", 256, 210, SIXTEEN),  # 128 bytes of low nibbles, 64 of high 2 bits, 16 signed sc, fp16 d
}


@dataclass(frozen=True)
class Codes:
    """One weight as codes, ``w = q * scale + zero`` a block of :attr:`group` inputs (:data:`BLOCK`, or 16 for
    :data:`SIXTEEN`).

    ``q``: ``(out, in)`` int8, 4-bit codes less 8 (-8..7) or 8-bit ones (-128..127; Q6_K's -32..31); ``scale``,
    ``zero``: ``(out, in // group)`` float32; ``bits``: 4, 8 or :data:`SIXTEEN`. A dense type's (``bits`` one of
    :data:`DENSE_DTYPES`) ``q`` holds the values themselves, ``(out, in)`` of that dtype, and its ``scale`` and
    ``zero`` are empty, ``(out, 0)``. ``q * scale`` is exact, so ``q * scale + zero`` has one rounding, as the
    kernel's fused multiply-add has. The types whose weight adds nothing to ``d*q``
    (Q4_0, Q5_0, Q8_0, Q6_K) have zeros of -0.0: adding -0.0 changes no value, not even a -0.0 (a negative ``d`` times
    code 0), where adding +0.0 would turn it into +0.0, other bits. The others add theirs, +0.0 included, as gguf does.
    """

    q: npt.NDArray[Any]
    scale: npt.NDArray[np.float32]
    zero: npt.NDArray[np.float32]
    bits: int
    # A K-quant's own factors, where the codes are Q4_K's or Q5_K's: d and dmin (fp16, out x super-blocks of 256), sc
    # and m (uint8, out x blocks): scale == d*sc and zero == 8*scale - dmin*m (Q5_K: 16*scale), each one fp32
    # rounding (the kernel's compact panels).
    factors: tuple[Any, Any, Any, Any] | None = None

    @property
    def unquantised(self) -> bool:
        """Whether ``q`` holds a dense type's values (:data:`DENSE_DTYPES`): fp32 rows in every mode, since int8
        rows multiply quantised blocks."""
        return self.bits in DENSE_DTYPES

    @property
    def group(self) -> int:
        """Inputs a scale and a zero: :data:`BLOCK`, or 16 for :data:`SIXTEEN`."""
        return 16 if self.bits == SIXTEEN else BLOCK

    def dense(self) -> npt.NDArray[np.float32]:
        """The weight in fp32, as the kernel expands it and as the file's own dequantisation gives it (the table
        above), bit for bit where the zero is exact; a dense type's values widened exactly."""
        if self.bits == BRAIN:
            return (self.q.astype(np.uint32) << 16).view(np.float32)
        if self.unquantised:
            return self.q.astype(np.float32)
        scaled = np.repeat(self.scale, self.group, axis=1) * self.q.astype(np.float32)
        weight: npt.NDArray[np.float32] = scaled + np.repeat(self.zero, self.group, axis=1)
        return weight

    def packed(self) -> npt.NDArray[np.uint8]:
        """The codes as Q4_0 lays them out in a block, ``(out, in * bits // 8)`` bytes: 4-bit codes (plus 8) two a
        byte, a block's first 16 inputs in the low nibbles and its last 16 in the high ones; 8-bit as is."""
        if self.bits != 4:
            return self.q.view(np.uint8)  # a dense type's values as their bytes
        out = self.q.shape[0]
        blocks = (self.q.astype(np.int16) + 8).astype(np.uint8).reshape(out, -1, 2, BLOCK // 2)
        return np.ascontiguousarray(blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, -1)

    @classmethod
    def unpacked(cls, packed: npt.NDArray[np.uint8], scale: Any, zero: Any, bits: int, factors: Any = None) -> Codes:
        """The inverse of :meth:`packed` (``scale``, ``zero`` and ``factors`` as the codes hold them)."""
        if bits != 4:
            return cls(packed.view(DENSE_DTYPES.get(bits, np.int8)), scale, zero, bits, factors)
        out = packed.shape[0]
        halves = packed.reshape(out, -1, 1, BLOCK // 2)
        q = np.concatenate([halves & 0x0F, halves >> 4], axis=2).reshape(out, -1).astype(np.int8) - np.int8(8)
        return cls(q, scale, zero, bits, factors)

    def rows(self, order: npt.NDArray[np.intp]) -> Codes:
        factors = None if self.factors is None else tuple(f[order] for f in self.factors)
        return Codes(self.q[order], self.scale[order], self.zero[order], self.bits, factors)

    def first(self, inputs: int) -> Codes:
        """The first ``inputs`` columns (whole blocks; Q4_K's factors where they are whole super-blocks)."""
        blocks = -(-inputs // self.group)
        factors = None
        if self.factors is not None and blocks % 8 == 0:  # d and dmin a super-block of 8, sc and m a block
            factors = tuple(f[:, : blocks // 8 if i < 2 else blocks] for i, f in enumerate(self.factors))
        q = self.q[:, : blocks * self.group]
        return Codes(q, self.scale[:, :blocks], self.zero[:, :blocks], self.bits, factors)


def _fp16(raw: npt.NDArray[np.uint8], at: int) -> npt.NDArray[np.float32]:
    """The fp16 value at byte ``at`` of each stored block, in fp32."""
    return raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """A legacy block's 16 bytes of nibbles as its 32 values: the low nibbles first, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _fifth_bits(qh: npt.NDArray[np.uint8]) -> npt.NDArray[np.integer[Any]]:
    """A Q5_0/Q5_1 block's 4 bytes of fifth bits as 32 values of 0 or 16 (uint8): input i's is bit i of the
    little-endian 32-bit word."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _super_scales(raw: npt.NDArray[np.uint8]) -> tuple[npt.NDArray[Any], ...]:
    """A Q4_K/Q5_K super-block's ``d`` and ``dmin`` (fp16, a super-block) and the 6-bit ``sc`` and ``m`` of each of
    its 8 blocks (uint8), from its values packed as gguf's ``Q4_K.get_scale_min`` reads them: bytes 0-3 hold sc of
    blocks 0-3 in their low 6 bits, 4-7 m of blocks 0-3; blocks 4-7 have their low 4 bits in bytes 8-11 (sc in the
    low nibble, m in the high) and their top 2 bits in the top bits of bytes 0-3 (sc) and 4-7 (m)."""
    packed = raw[..., 4:16]
    low_sc, low_m, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low_sc & 0x3F, (rest & 0x0F) | ((low_sc >> 2) & 0x30)], axis=-1)
    m = np.concatenate([low_m & 0x3F, (rest >> 4) | ((low_m >> 2) & 0x30)], axis=-1)
    halves = raw[..., 0:4].copy().view(np.float16)
    return halves[..., 0], halves[..., 1], sc.astype(np.uint8), m.astype(np.uint8)


def _super_nibbles(packed: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """A K-quant super-block's 128 bytes of nibbles as its 8 blocks' 32 values each: each 32 bytes hold two blocks,
    the first in the low nibbles, the second in the high ones."""
    pairs = packed.reshape(*packed.shape[:-1], 4, 1, 32)
    both = np.concatenate([pairs & 0x0F, pairs >> 4], axis=-2)
    return both.reshape(*packed.shape[:-1], 8, 32)


def decode(blocks: npt.NDArray[Any], kind: int, shape: tuple[int, int]) -> Codes:
    """Split a tensor's raw bytes, of one of the :data:`FORMATS`, into codes, scales and zeros (the table above);
    those of a :data:`DENSE` type are its values. ``shape`` is ``(out, in)``."""
    if kind in DENSE:
        return _dense(np.asarray(blocks).view(np.uint8), kind, shape)
    out, inputs = shape
    form = FORMATS[kind]
    raw = np.ascontiguousarray(blocks).reshape(out, inputs // form.inputs, form.size)
    values: npt.NDArray[np.integer[Any]]  # each input's unsigned code (uint8: numpy types some as signed)
    if kind == Q6_K:
        return _decode_q6_k(raw, out, inputs)
    if kind in (Q4_K, Q5_K):
        d, dmin, sc, m = _super_scales(raw)
        # d*sc and dmin*m, fp32 products as gguf computes them (exact: 11 bits times 6)
        scale = d.astype(np.float32)[..., None] * sc.astype(np.float32)
        minimum = dmin.astype(np.float32)[..., None] * m.astype(np.float32)
        if kind == Q4_K:
            values, middle = _super_nibbles(raw[..., 16:144]), 8
        else:
            fifth = (raw[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # block j's: bit j
            values, middle = _super_nibbles(raw[..., 48:176]) | (fifth << 4), 16
        # (d*sc)*q - dmin*m == (d*sc)*(q - middle) + (middle*(d*sc) - dmin*m); middle*(d*sc) is exact.
        zero = np.float32(middle) * scale - minimum
        q = values.reshape(out, inputs).astype(np.int8) - np.int8(middle)
        factors = (d, dmin, sc.reshape(out, -1), m.reshape(out, -1))
        return Codes(q, scale.reshape(out, -1), zero.reshape(out, -1), form.bits, factors)
    d = _fp16(raw, 0)
    zero = np.full_like(d, -0.0)  # nothing added (Codes)
    if kind == Q8_0:
        return Codes(raw[..., 2:].copy().view(np.int8).reshape(out, inputs), d, zero, 8)
    if kind == Q4_0:
        values, middle = _nibbles(raw[..., 2:]), 8
    elif kind == Q4_1:
        values, middle = _nibbles(raw[..., 4:]), 8
    elif kind == Q5_0:
        values, middle = _nibbles(raw[..., 6:]) | _fifth_bits(raw[..., 2:6]), 16
    else:  # Q5_1
        values, middle = _nibbles(raw[..., 8:]) | _fifth_bits(raw[..., 4:8]), 16
    if kind in (Q4_1, Q5_1):
        zero = _fp16(raw, 2) + np.float32(middle) * d  # d*q + m == d*(q - middle) + (m + middle*d)
    q = values.reshape(out, inputs).astype(np.int8) - np.int8(middle)
    return Codes(q, d, zero, form.bits)


def _dense(raw: npt.NDArray[np.uint8], kind: int, shape: tuple[int, int]) -> Codes:
    """A dense tensor's bytes (``out`` rows) as :class:`Codes` holding its values (``shape`` is ``(out, in)``)."""
    bits = DENSE[kind][1]
    values = np.ascontiguousarray(raw).view(DENSE_DTYPES[bits]).reshape(shape)
    empty = np.zeros((shape[0], 0), np.float32)
    return Codes(values, empty, empty, bits)


def _decode_q6_k(raw: npt.NDArray[np.uint8], out: int, inputs: int) -> Codes:
    """Q6_K super-blocks (``out`` x super-blocks x 210 bytes) as codes, as gguf's ``Q6_K.dequantize_blocks`` reads
    them: each half of 128 inputs has 64 bytes of low nibbles (inputs 0-63 of the half in the low nibbles, 64-127 in
    the high ones) and 32 bytes of high 2 bits (input i's in bits 2*(i // 32) of byte i % 32); then 16 signed
    scales, one each 16 inputs, and the fp16 ``d``. The scale is ``d*sc`` (an exact fp32 product, as gguf's)."""
    low = raw[..., 0:128].reshape(*raw.shape[:-1], 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    high = raw[..., 128:192].reshape(*raw.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    values = (low & 0x0F).reshape(*raw.shape[:-1], 256) | ((high & 0x03).reshape(*raw.shape[:-1], 256) << 4)
    scale = _fp16(raw, 208)[..., None] * raw[..., 192:208].view(np.int8).astype(np.float32)
    q = values.reshape(out, inputs).astype(np.int8) - np.int8(32)
    scale = scale.reshape(out, -1)
    return Codes(q, scale, np.full_like(scale, -0.0), SIXTEEN)  # nothing added (Codes)
