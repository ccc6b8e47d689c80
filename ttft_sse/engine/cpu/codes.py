"""A GGUF file's own quantised blocks, found again behind the fp32 weights transformers loaded from it.

transformers loads a GGUF by expanding every weight to fp32 with ``gguf``'s dequantisation (the bundled SmolLM2 is
Q4_1, its embedding and tied LM head Q8_0). Kept as codes, a weight is 4.5 to 8.5 bits an input instead of 32: what
a decode step, bound by the bytes it reads, gains by. The engine's kernels (engine/cpu/kernel.py) multiply by
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
to a -0.0 (:class:`Codes`). Where the zero is not exact, the match below finds out, and the layer stays fp32:
correctness never rests on it.

F16, BF16 and F32 matrices are read as the weights themselves (:data:`DENSE`: the kernel's dense layouts, which widen
fp16 and bf16 exactly as it reads them). Other types stay fp32 (:func:`why_not`): Q3_K and Q2_K (their 2- and 3-bit
codes with a minimum each 16 inputs have no layout here), and the others.

Layers are matched to the file's tensors by their rows' bits, not by name (no table of names; rows reordered by
transformers' loader, q and k, are found too), and get codes only if these give back exactly the fp32 weight
transformers loaded. Every matrix is known by a hash of its rows' first columns, so each layer's GGUF type is known
whether it gets codes or not (:class:`Found`). Reading and matching takes seconds, so the codes and types are kept
in the model's converted directory for the next start.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from ttft_sse.engine.cache_files import write_whole

log = structlog.get_logger("ttft_sse.engine")

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

UNKNOWN = "unknown"
"""The type of a layer whose rows no matrix of the file holds."""

_NO_LAYOUT_K = frozenset({"Q2_K", "Q3_K"})


def why_not(kind: str) -> str:
    """Why a layer whose weight the file holds as ``kind`` (a GGUF type's name) stays fp32."""
    if kind in {f.name for f in FORMATS.values()}:
        return "its blocks do not give back the loaded weight bit for bit"
    if kind in {name for name, _ in DENSE.values()}:
        return "its values do not give back the loaded weight bit for bit"
    if kind in _NO_LAYOUT_K:
        return "no kernel layout for 16-input scales and minimums"
    if kind == UNKNOWN:
        return "no matrix of the file holds its rows"
    return "no kernel layout for its blocks"


def why_fp32_rows(kind: str) -> str:
    """Why a layer on the kernel whose weight the file holds as ``kind`` keeps fp32 rows where int8 rows are asked
    for: int8 rows multiply quantised codes (engine/cpu/layouts.py's ``in_records``), and a dense type's values
    are not."""
    return "not quantised: int8 rows multiply quantised blocks"


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
    # Q4_K's own factors, where the codes are Q4_K's: d and dmin (fp16, out x super-blocks of 256), sc and m (uint8,
    # out x blocks): scale == d*sc and zero == 8*scale - dmin*m, each one fp32 rounding (the kernel's compact panels).
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
            return cls(packed.view(DENSE_DTYPES.get(bits, np.int8)), scale, zero, bits)
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
        factors = (d, dmin, sc.reshape(out, -1), m.reshape(out, -1)) if kind == Q4_K else None
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


@dataclass(frozen=True)
class Stored:
    """A matrix of the file: its GGUF type's name, the first columns of its weight as gguf dequantises them (at
    least :data:`HASHED_COLUMNS`, or all of them: enough to know it by), and its codes where it is of one of the
    :data:`FORMATS`."""

    kind: str
    head: npt.NDArray[np.float32]
    codes: Codes | None = None


def read(path: str | Path) -> list[Stored]:
    """Every matrix of the GGUF file at ``path`` whose type gguf can dequantise."""
    import gguf

    found = []
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if len(tensor.shape) != 2:
            continue
        inputs, out = (int(n) for n in tensor.shape)  # GGUF lists the fastest-moving dimension first
        kind = gguf.GGMLQuantizationType(int(tensor.tensor_type))
        per_block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = np.asarray(tensor.data).view(np.uint8).reshape(out, -1)
        blocks = -(-min(inputs, HASHED_COLUMNS) // per_block)  # those that hold the hashed columns
        try:
            head = gguf.quants.dequantize(np.ascontiguousarray(raw[:, : blocks * size]), kind)
        except NotImplementedError:  # nor could transformers' loader have read it
            continue
        codes = decode(raw, int(kind), (out, inputs)) if int(kind) in FORMATS or int(kind) in DENSE else None
        found.append(Stored(kind.name, np.asarray(head, np.float32).reshape(out, -1), codes))
    return found


@functools.cache
def _mix(width: int) -> npt.NDArray[np.uint64]:
    return np.random.default_rng(0x7474).integers(1, 2**63, size=width, dtype=np.uint64) | np.uint64(1)


HASHED_COLUMNS = 64
"""Columns a row's hash reads: enough to tell rows apart (a match is then checked on every bit)."""


def _row_hashes(matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.uint64]:
    """A 64-bit hash of the bits of each row's first columns (their words times fixed odd numbers, wrapping)."""
    head = np.ascontiguousarray(matrix[:, :HASHED_COLUMNS], dtype=np.float32)
    hashes: npt.NDArray[np.uint64] = (head.view(np.uint32).astype(np.uint64) * _mix(head.shape[1])).sum(
        axis=1, dtype=np.uint64
    )
    return hashes


def _code_hashes(codes: Codes) -> npt.NDArray[np.uint64]:
    """:func:`_row_hashes` of the weight ``codes`` give back, from the hashed columns' blocks only."""
    return _row_hashes(codes.first(HASHED_COLUMNS).dense())


@dataclass(frozen=True)
class _Candidate:
    stored: Stored
    hashes: npt.NDArray[np.uint64]  # of the rows of its weight as gguf dequantises it, their first HASHED_COLUMNS


def _fingerprint(hashes: npt.NDArray[np.uint64]) -> tuple[int, int]:
    """The same for the same rows in any order."""
    return len(hashes), int(hashes.sum(dtype=np.uint64))


def _index(stored: list[Stored]) -> dict[tuple[int, int], list[_Candidate]]:
    """The file's matrices by the fingerprint of their rows."""
    candidates: dict[tuple[int, int], list[_Candidate]] = {}
    for matrix in stored:
        candidate = _Candidate(matrix, _row_hashes(matrix.head))
        candidates.setdefault(_fingerprint(candidate.hashes), []).append(candidate)
    return candidates


def _match(
    weight: npt.NDArray[np.float32], candidates: dict[tuple[int, int], list[_Candidate]]
) -> tuple[str, Codes | None]:
    """The GGUF type of the file's matrix with ``weight``'s rows (:data:`UNKNOWN` if none has them), and its codes
    put in ``weight``'s row order if they give back exactly ``weight`` (``None`` if not, or if it has none)."""
    hashes = _row_hashes(weight)
    kind = UNKNOWN
    for candidate in candidates.get(_fingerprint(hashes), []):
        kind = candidate.stored.kind
        codes = candidate.stored.codes
        if codes is None or weight.shape != codes.q.shape:
            continue
        mine, theirs = np.argsort(hashes, kind="stable"), np.argsort(candidate.hashes, kind="stable")
        order = np.empty_like(theirs)
        order[mine] = theirs  # row i of weight is row order[i] of the codes, if the hashes are all distinct
        ordered = codes.rows(order)
        if np.array_equal(ordered.dense(), weight):
            return kind, ordered
    return kind, None


@dataclass(frozen=True)
class Found:
    """What the file holds of each layer: its GGUF type (:data:`UNKNOWN` where no matrix has its rows), and the
    codes of those whose weight they give back bit for bit."""

    kinds: dict[str, str]  # every layer asked about
    codes: dict[str, Codes]


CACHE_FILE = "gguf-codes-4.npz"
"""Where :func:`of_layers` keeps what it found, by layer name, in the model's converted directory (its name
changes with the types read into codes, so that a cache of fewer types is not taken for one of all of them)."""


FACTORS = ("kd", "kdmin", "ksc", "km")
"""The cache's names of :attr:`Codes.factors`."""


def _load_cached(path: Path | None, layers: dict[str, Any]) -> Found | None:
    """What an earlier start found, if it is of the same layers and each of its codes still gives back its layer's
    rows (checked on the hashed columns: the converted directory is keyed by the file's contents, this guards
    against a changed loader). A cache without the layers' types, as starts before they were kept wrote, is
    matched again."""
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as saved:
            names = {key.rsplit(".", 1)[0] for key in saved.files}
            if any(f"{name}.kind" not in saved.files for name in names):
                return None
            kinds = {name: str(saved[f"{name}.kind"]) for name in names}
            found = {}
            for name in names:
                if f"{name}.q" in saved.files:
                    bits = int(saved[f"{name}.bits"])
                    q, scale, zero = (saved[f"{name}.{part}"] for part in ("q", "scale", "zero"))
                    kept = f"{name}.kd" in saved.files  # Q4_K's factors
                    factors = tuple(saved[f"{name}.{part}"] for part in FACTORS) if kept else None
                    found[name] = Codes.unpacked(q, scale, zero, bits, factors)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("codes_cache_unreadable", path=str(path), reason=repr(exc))
        return None
    if names != set(layers):
        return None
    for name, codes in found.items():
        layer = layers[name]
        if tuple(layer.weight.shape) != codes.q.shape:
            return None
        want = _row_hashes(layer.weight.detach().numpy())
        if not np.array_equal(want, _code_hashes(codes)):
            return None
    return Found(kinds, found)


def _save_cached(path: Path | None, found: Found) -> None:
    if path is None:
        return
    arrays: dict[str, npt.NDArray[Any]] = {}
    for name, kind in found.kinds.items():
        arrays[f"{name}.kind"] = np.asarray(kind)
    for name, codes in found.codes.items():
        arrays[f"{name}.q"], arrays[f"{name}.bits"] = codes.packed(), np.asarray(codes.bits)
        arrays[f"{name}.scale"], arrays[f"{name}.zero"] = codes.scale, codes.zero
        arrays |= {f"{name}.{part}": f for part, f in zip(FACTORS, codes.factors or (), strict=False)}
    # A read-only cache directory: matched again at the next start.
    write_whole(path, lambda partial: np.savez(partial, **arrays), "codes_cache_not_written")  # type: ignore[arg-type]


def of_layers(layers: dict[str, Any], gguf_path: str | Path, cache: Path | None) -> Found:
    """The GGUF type of each of ``layers`` (``torch.nn.Linear`` by name) and the codes of those the file holds in
    one of the :data:`FORMATS` or :data:`DENSE` types bit for bit, from the cache of an earlier start or else by
    matching the file's matrices."""
    found = _load_cached(cache, layers)
    if found is None:
        candidates = _index(read(gguf_path))
        kinds, codes = {}, {}
        for name, layer in layers.items():
            kinds[name], matched = _match(layer.weight.detach().numpy(), candidates)
            if matched is not None:
                codes[name] = matched
        found = Found(kinds, codes)
        _save_cached(cache, found)
    return found


def by_type(kinds: dict[str, str], rows: dict[str, str], asked: str) -> dict[str, str]:
    """The path of each GGUF type's layers, by the type's name (:data:`UNKNOWN` for layers no matrix
    of the file holds), e.g. ``{"Q4_K": "blocks: 168", "F16": "fp32: 42 (not quantised)"}``. ``kinds``: each layer's
    type; ``rows``: the rows of each layer on the kernel, ``"fp32"`` or ``"int8"``; ``asked``: the rows asked for. A
    type whose layers take more than one path lists each, joined by "; ": on the kernel with the rows asked for, then
    with fp32 rows where int8 ones were asked for but the layer is not quantised, then fp32 layers, with the
    reason.
    """
    paths: dict[str, Counter[tuple[int, str]]] = {}
    for name, kind in kinds.items():
        row = rows.get(name)
        if row is None:
            path = (2, f"fp32: {{}} ({why_not(kind)})")
        elif row == asked:
            path = (0, "blocks: {}" if row == "fp32" else "blocks, int8 rows: {}")
        else:
            path = (1, f"blocks, fp32 rows: {{}} ({why_fp32_rows(kind)})")
        paths.setdefault(kind, Counter())[path] += 1
    return {
        kind: "; ".join(text.format(count) for (_, text), count in sorted(counted.items()))
        for kind, counted in sorted(paths.items())
    }
