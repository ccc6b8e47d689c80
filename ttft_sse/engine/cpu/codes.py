"""A GGUF file's own quantised blocks, found again behind the fp32 weights transformers loaded from it.

A GGUF quantised to Q4_0, Q4_1 or Q8_0 (the bundled SmolLM2 is Q4_1, its embedding and tied LM head Q8_0) stores
each weight in blocks of 32 inputs: codes ``q`` with one scale ``d`` (and, for Q4_1, one minimum ``m``) a block.
transformers loads the file by expanding every weight to fp32: Q4_0 ``w = d*(q-8)``, Q4_1 ``w = d*q + m``, Q8_0
``w = d*q``. Kept as codes, a weight is 4.5 to 8.5 bits an input instead of 32: what a decode step, bound by the
bytes it reads, gains by. The engine's kernels (engine/cpu/kernel.py) multiply by these codes.

Layers are matched to the file's tensors by their rows' bits, not by name, so no table of each architecture's names
is needed, and a row order changed by transformers' loader (q and k) is found too. Only a layer whose codes give
back exactly the fp32 weight transformers loaded gets them. Reading and matching the file takes seconds (most of it
``gguf``'s reading of the metadata), so the codes are kept in the model's converted directory for the next start.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

log = structlog.get_logger("ttft_sse.engine")

BLOCK = 32
"""Inputs per GGUF block."""

# GGML type ids (gguf.GGMLQuantizationType), the bytes of one block (fp16 d, fp16 m for Q4_1, then the codes) and
# the bits of one code.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
BITS = {Q4_0: 4, Q4_1: 4, Q8_0: 8}


@dataclass(frozen=True)
class Codes:
    """One weight as codes, ``w = q * scale + zero`` a block of :data:`BLOCK` inputs.

    ``q``: ``(out, in)`` int8, 4-bit codes less 8 (-8..7) or 8-bit ones (-128..127); ``scale``, ``zero``:
    ``(out, in // BLOCK)`` float32; ``bits``: 4 or 8.
    """

    q: npt.NDArray[np.int8]
    scale: npt.NDArray[np.float32]
    zero: npt.NDArray[np.float32]
    bits: int

    def dense(self) -> npt.NDArray[np.float32]:
        """The weight in fp32, as the file's own dequantisation gives it (``d*q + m``, ``d*(q-8)``, ``d*q``)."""
        scaled = np.repeat(self.scale, BLOCK, axis=1) * self.q.astype(np.float32)
        zero = np.repeat(self.zero, BLOCK, axis=1)
        # Adding a zero of 0 would turn Q4_0's -0.0 (a negative d times code 8) into +0.0: other bits.
        return np.where(zero == 0, scaled, scaled + zero).astype(np.float32)

    def packed(self) -> npt.NDArray[np.uint8]:
        """The codes as the file lays them out in a block, ``(out, in * bits // 8)`` bytes: 4-bit codes (plus 8)
        two a byte, a block's first 16 inputs in the low nibbles and its last 16 in the high ones; 8-bit as is."""
        if self.bits == 8:
            return self.q.view(np.uint8)
        out = self.q.shape[0]
        blocks = (self.q.astype(np.int16) + 8).astype(np.uint8).reshape(out, -1, 2, BLOCK // 2)
        return np.ascontiguousarray(blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, -1)

    @classmethod
    def unpacked(
        cls, packed: npt.NDArray[np.uint8], scale: npt.NDArray[np.float32], zero: npt.NDArray[np.float32], bits: int
    ) -> Codes:
        """The inverse of :meth:`packed`."""
        if bits == 8:
            return cls(packed.view(np.int8), scale, zero, bits)
        out = packed.shape[0]
        halves = packed.reshape(out, -1, 1, BLOCK // 2)
        q = np.concatenate([halves & 0x0F, halves >> 4], axis=2).reshape(out, -1).astype(np.int8) - np.int8(8)
        return cls(q, scale, zero, bits)

    def rows(self, order: npt.NDArray[np.intp]) -> Codes:
        return Codes(self.q[order], self.scale[order], self.zero[order], self.bits)

    def first(self, inputs: int) -> Codes:
        """The first ``inputs`` columns (whole blocks)."""
        blocks = -(-inputs // BLOCK)
        return Codes(self.q[:, : blocks * BLOCK], self.scale[:, :blocks], self.zero[:, :blocks], self.bits)


def decode(blocks: npt.NDArray[np.uint8], kind: int, shape: tuple[int, int]) -> Codes:
    """Split a Q4_0, Q4_1 or Q8_0 tensor's raw bytes into codes, scales and zeros. ``shape`` is ``(out, in)``."""
    out, inputs = shape
    raw = np.ascontiguousarray(blocks).reshape(out, inputs // BLOCK, BLOCK_BYTES[kind])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    zero = np.zeros_like(d)
    if kind == Q8_0:
        q = raw[..., 2:].copy().view(np.int8).reshape(out, inputs)
        return Codes(q, d, zero, 8)
    if kind == Q4_1:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = raw[..., 4:]
        zero = m + 8 * d  # d*q + m == d*(q-8) + (m + 8d)
    else:
        packed = raw[..., 2:]
    # Low nibbles hold a block's first 16 inputs, high nibbles its last 16.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, inputs).astype(np.int8) - np.int8(8)
    return Codes(q, d, zero, 4)


def read(path: str | Path) -> list[Codes]:
    """Every Q4_0, Q4_1 or Q8_0 matrix in the GGUF file at ``path``."""
    import gguf

    found = []
    for tensor in gguf.GGUFReader(str(path)).tensors:
        kind = int(tensor.tensor_type)
        if kind in BLOCK_BYTES and len(tensor.shape) == 2:
            inputs, out = (int(n) for n in tensor.shape)  # GGUF lists the fastest-moving dimension first
            found.append(decode(np.asarray(tensor.data), kind, (out, inputs)))
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
    codes: Codes
    hashes: npt.NDArray[np.uint64]  # of the rows of codes.dense(), their first HASHED_COLUMNS


def _fingerprint(hashes: npt.NDArray[np.uint64]) -> tuple[int, int]:
    """The same for the same rows in any order."""
    return len(hashes), int(hashes.sum(dtype=np.uint64))


def _index(stored: list[Codes]) -> dict[tuple[int, int], list[_Candidate]]:
    """The file's matrices by the fingerprint of their rows."""
    candidates: dict[tuple[int, int], list[_Candidate]] = {}
    for codes in stored:
        candidate = _Candidate(codes, _code_hashes(codes))
        candidates.setdefault(_fingerprint(candidate.hashes), []).append(candidate)
    return candidates


def _match(weight: npt.NDArray[np.float32], candidates: dict[tuple[int, int], list[_Candidate]]) -> Codes | None:
    """The codes whose rows are exactly ``weight``'s rows, put in ``weight``'s row order; ``None`` if none are."""
    if weight.shape[1] % BLOCK:
        return None
    hashes = _row_hashes(weight)
    for candidate in candidates.get(_fingerprint(hashes), []):
        mine, theirs = np.argsort(hashes, kind="stable"), np.argsort(candidate.hashes, kind="stable")
        order = np.empty_like(theirs)
        order[mine] = theirs  # row i of weight is row order[i] of the codes, if the hashes are all distinct
        codes = candidate.codes.rows(order)
        if np.array_equal(codes.dense(), weight):
            return codes
    return None


CACHE_FILE = "gguf-codes.npz"
"""Where :func:`of_layers` keeps the codes it matched, by layer name, in the model's converted directory."""


def _load_cached(path: Path | None, layers: dict[str, Any]) -> dict[str, Codes] | None:
    """The codes saved by an earlier start, if every one still gives back its layer's rows (checked on the
    hashed columns: the converted directory is keyed by the file's contents, this guards against a changed loader)."""
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as saved:
            names = {key.rsplit(".", 1)[0] for key in saved.files}
            found = {}
            for name in names:
                bits = int(saved[f"{name}.bits"])
                found[name] = Codes.unpacked(saved[f"{name}.q"], saved[f"{name}.scale"], saved[f"{name}.zero"], bits)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("codes_cache_unreadable", path=str(path), reason=repr(exc))
        return None
    for name, codes in found.items():
        layer = layers.get(name)
        if layer is None or tuple(layer.weight.shape) != codes.q.shape:
            return None
        want = _row_hashes(layer.weight.detach().numpy())
        if not np.array_equal(want, _code_hashes(codes)):
            return None
    return found


def _save_cached(path: Path | None, found: dict[str, Codes]) -> None:
    if path is None:
        return
    arrays: dict[str, npt.NDArray[Any]] = {}
    for name, codes in found.items():
        arrays[f"{name}.q"], arrays[f"{name}.bits"] = codes.packed(), np.asarray(codes.bits)
        arrays[f"{name}.scale"], arrays[f"{name}.zero"] = codes.scale, codes.zero
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial.npz")
    try:
        np.savez(partial, **arrays)  # type: ignore[arg-type]  # numpy types the keywords as its own flags
        partial.replace(path)
    except OSError as exc:  # a read-only cache directory: matched again at the next start
        log.warning("codes_cache_not_written", path=str(path), reason=repr(exc))
        partial.unlink(missing_ok=True)


def of_layers(layers: dict[str, Any], gguf_path: str | Path, cache: Path | None) -> dict[str, Codes]:
    """The codes of each of ``layers`` (``torch.nn.Linear`` by name) the file holds, from the cache of an earlier
    start or else by matching the file's blocks."""
    found = _load_cached(cache, layers)
    if found is None:
        candidates = _index(read(gguf_path))
        found = {}
        for name, layer in layers.items():
            codes = _match(layer.weight.detach().numpy(), candidates)
            if codes is not None:
                found[name] = codes
        _save_cached(cache, found)
    return found
