"""Linear layers on a GGUF file's own Q4_0/Q4_1 codes and bf16 copies, for CPU (``TTFT_INT4_WEIGHTS``, off by default).

A GGUF quantised to Q4_0 or Q4_1 (the bundled SmolLM2 is Q4_1) stores each linear weight in blocks of 32 inputs: 4-bit
codes ``q`` with one scale ``d`` (and, for Q4_1, one minimum ``m``) a block, ``w = d*q + m`` (Q4_0: ``w = d*(q-8)``).
transformers loads the file by expanding every weight to fp32, and a decode step then streams those fp32 weights
from memory. torch's CPU kernel for weight-only int4 (``_weight_int4pack_mm_for_cpu``, the one torchao's int4
weight-only mode calls) multiplies by the codes directly, ``w = (q-8)*scale + zero`` a block of 32: the file's own
formula with ``scale = d``, ``zero = m + 8d``. It is fastest for a few rows; for more, oneDNN's GEMM on a
pre-packed bf16 copy of the weight (AMX on this CPU) is. Measured on this machine (one thread, 30 weights of
576x1536, ms, fp32 input cast to bf16 and the output back; ``/tmp`` scripts, run once each):

====== ===================== ================== =============== ==========
rows   fp32, column-major    fp32, oneDNN packed bf16, oneDNN    int4 codes
====== ===================== ================== =============== ==========
1      8.7                   10.8               7.4             2.3
8      20.3                  13.5               7.2             6.4
16     22.0                  15.5               8.1             12.3
32     25.7                  21.0               9.9             23.4
512    163.5                 167.9              67.5            378.1
====== ===================== ================== =============== ==========

So every fp32 linear layer gets a bf16 copy packed by oneDNN, and the layers the file holds as Q4 also get their
codes: forwards of up to 8 rows (decode steps of up to 8 streams) take the int4 kernel, longer ones (prompts,
bigger batches) and layers without codes (the LM head: the bundled file's embedding is Q8_0) the bf16 copy. Both
kernels take bf16 activations (and give a bf16 output): the int4 layers' weights are the file's (scales rounded to
bf16), the rounding of what multiplies them is bf16's; the bf16 copies round the weights too.

That is why this is not the default. Each row of the int4 kernel's result depends on that row alone (checked bit
for bit), but a batched step does not: a stream's row takes the bf16 copy in a step with more than 8 rows, and
attention over a batch differs from attention alone by fp32 rounding, which rounding to bf16 turns into whole bf16
steps now and then. Greedy answers then depend on the batch, as with ``TTFT_DTYPE=bfloat16``.

Only a layer whose blocks give back exactly the fp32 weight transformers loaded (allowing the row order
transformers' loader permutes q and k into) gets codes, and then drops its fp32 weight, which nothing reads any
more. Attention, norms and the rest stay fp32.
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

from ttft_sse.engine import weights

log = structlog.get_logger("ttft_sse.engine")

BLOCK = 32
"""Inputs per GGUF block, and the group size the int4 kernel is given."""

INT4_ROWS = range(1, 9)
"""Row counts that take the int4 kernel (decode steps of up to 8 streams); more take the bf16 copy, faster from
~10 rows on."""

# GGML type ids (gguf.GGMLQuantizationType) and the bytes of one block: fp16 d (and fp16 m), 16 bytes of codes.
Q4_0, Q4_1 = 2, 3
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20}


@dataclass(frozen=True)
class Codes:
    """One weight as 4-bit codes, ``w = (q - 8) * scale + zero`` a block of :data:`BLOCK` inputs.

    ``q``: ``(out, in)`` uint8 in 0..15; ``scale``, ``zero``: ``(out, in // BLOCK)`` float32.
    """

    q: npt.NDArray[np.uint8]
    scale: npt.NDArray[np.float32]
    zero: npt.NDArray[np.float32]

    def dense(self) -> npt.NDArray[np.float32]:
        """The weight in fp32, as the file's own dequantisation gives it (``d*q + m``, ``d*(q-8)``)."""
        scaled = np.repeat(self.scale, BLOCK, axis=1) * (self.q.astype(np.float32) - 8)
        zero = np.repeat(self.zero, BLOCK, axis=1)
        # Adding a zero of 0 would turn Q4_0's -0.0 (a negative d times code 8) into +0.0: other bits.
        return np.where(zero == 0, scaled, scaled + zero).astype(np.float32)

    def rows(self, order: npt.NDArray[np.intp]) -> Codes:
        return Codes(self.q[order], self.scale[order], self.zero[order])

    def first(self, inputs: int) -> Codes:
        """The first ``inputs`` columns (whole blocks)."""
        blocks = -(-inputs // BLOCK)
        return Codes(self.q[:, : blocks * BLOCK], self.scale[:, :blocks], self.zero[:, :blocks])


def decode(blocks: npt.NDArray[np.uint8], kind: int, shape: tuple[int, int]) -> Codes:
    """Split a Q4_0/Q4_1 tensor's raw bytes into codes, scales and zeros. ``shape`` is ``(out, in)``."""
    out, inputs = shape
    raw = np.ascontiguousarray(blocks).reshape(out, inputs // BLOCK, BLOCK_BYTES[kind])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == Q4_1:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = raw[..., 4:]
        zero = m + 8 * d  # d*q + m == d*(q-8) + (m + 8d)
    else:
        packed = raw[..., 2:]
        zero = np.zeros_like(d)
    # Low nibbles hold a block's first 16 inputs, high nibbles its last 16.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, inputs)
    return Codes(q, d, zero)


def read(path: str | Path) -> list[Codes]:
    """Every Q4_0/Q4_1 matrix in the GGUF file at ``path``."""
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


CACHE_FILE = "int4-codes.npz"
"""Where :func:`apply` keeps the codes it matched, by layer name, in the model's converted directory."""


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
                packed = saved[f"{name}.q"]
                q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
                found[name] = Codes(q, saved[f"{name}.scale"], saved[f"{name}.zero"])
    except (OSError, ValueError, KeyError) as exc:
        log.warning("int4_cache_unreadable", path=str(path), reason=repr(exc))
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
        arrays[f"{name}.q"] = codes.q[:, 0::2] | (codes.q[:, 1::2] << 4)  # two codes a byte
        arrays[f"{name}.scale"], arrays[f"{name}.zero"] = codes.scale, codes.zero
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial.npz")
    try:
        np.savez(partial, **arrays)  # type: ignore[arg-type]  # numpy types the keywords as its own flags
        partial.replace(path)
    except OSError as exc:  # a read-only cache directory: matched again at the next start
        log.warning("int4_cache_not_written", path=str(path), reason=repr(exc))
        partial.unlink(missing_ok=True)


def _codes_of(layers: dict[str, Any], gguf_path: str | Path, cache: Path | None) -> dict[str, Codes]:
    """Each layer's codes, from the cache of an earlier start or else by matching the file's blocks."""
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


def apply(model: Any, gguf_path: str | Path, torch: Any, *, cache: Path | None = None) -> int:
    """Make every fp32 linear layer of ``model`` an ``Int4Linear``: a bf16 oneDNN-packed copy of its weight, and,
    where the file's Q4 blocks give back that weight exactly, its codes. Returns how many got codes (0, logged
    with the reason, when this torch cannot, or its kernels disagree with the fp32 GEMM on a probe: then nothing
    is changed).

    Layers are matched to the file's tensors by their rows' bits, not by name, so no table of each
    architecture's names is needed, and a row order changed by transformers' loader (q and k) is found too.
    Reading and matching the file takes seconds (most of it ``gguf``'s reading of the metadata), so the codes are
    kept in ``cache`` (the model's converted directory) for the next start."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        log.warning("weights_not_int4", reason="this torch has no CPU int4 kernel")
        return 0
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        # The kernel's vectorised path was measured on AVX-512 only; its scalar one (fp32 inputs take it) was 20x
        # slower than the fp32 GEMM at one row.
        log.warning("weights_not_int4", reason=f"the int4 kernel is used on AVX-512 only; this CPU: {capability}")
        return 0
    layers = {
        name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
    }
    found = _codes_of(layers, gguf_path, cache)
    changed: list[Any] = []
    try:
        for name, layer in layers.items():
            _attach(layer, found.get(name), torch)
            changed.append(layer)
        with_codes = [layer for layer in changed if layer.codes is not None]
        if with_codes:
            _check(with_codes[0], torch)  # both kernels: 8 rows take the codes, 9 the bf16 copy
            without_codes = next((layer for layer in changed if layer.codes is None), None)
            if without_codes is not None:  # a bf16 copy alone (the LM head)
                _check(without_codes, torch)
            for layer in with_codes:
                # Never read again, and not shared (a tied LM head has no codes): 424 MB for the bundled model.
                layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            log.info("weights_int4", layers=len(with_codes), bf16_only=len(changed) - len(with_codes))
            return len(with_codes)
        reason = "no linear weight of the model is stored as Q4_0 or Q4_1 in the file"
    except RuntimeError as exc:
        reason = str(exc)
    for layer in changed:  # back to the plain fp32 layers they were
        layer.__class__ = torch.nn.Linear
        del layer.codes, layer.scales, layer.wide
    log.warning("weights_not_int4", reason=reason)
    return 0


def _check(layer: Any, torch: Any) -> None:
    """The layer against the fp32 GEMM of the same bf16-rounded rows, at a row count for each of its kernels."""
    for count in (max(INT4_ROWS), max(INT4_ROWS) + 1):
        rows = weights.probe_rows(torch, count, layer.in_features)
        with torch.no_grad():
            want = torch.nn.functional.linear(rows.to(torch.bfloat16).float(), layer.weight, layer.bias)
            got = layer(rows)
        # bf16 keeps 8 bits: its rounding of the output alone is up to 1/256 of the largest value.
        if float((got - want).abs().max()) > 2e-2 * float(want.abs().max()):
            raise RuntimeError(f"the CPU int4 or bf16 kernel disagrees with the fp32 GEMM at {count} rows")


def _int4_mm(torch: Any, rows: Any, codes: Any, scales: Any) -> Any:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, codes, BLOCK, scales)


@functools.cache
def int4_linear_class() -> type[Any]:
    """``torch.nn.Linear`` with a bf16 oneDNN-packed copy of its weight and, if the file has them, its 4-bit codes:
    up to :data:`INT4_ROWS` rows go through torch's CPU int4 kernel, others (and every row count, without codes)
    through the bf16 copy. bf16 in, the input's dtype out."""
    import torch

    class Int4Linear(torch.nn.Linear):  # type: ignore[misc]
        codes: Any
        scales: Any
        wide: Any

        def forward(self, x: Any) -> Any:
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
            if self.codes is not None and rows.shape[0] in INT4_ROWS:
                y = _int4_mm(torch, rows, self.codes, self.scales)
            else:
                y = weights.packed_linear(torch, rows, self.wide, None)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias

    return Int4Linear


def _attach(layer: Any, codes: Codes | None, torch: Any) -> None:
    """Make ``layer`` (a ``torch.nn.Linear``) an ``Int4Linear``: its bf16 copy, and its codes in the int4 kernel's
    layout if it has them."""
    layer.wide = weights.pack(layer.weight.data.to(torch.bfloat16), torch)
    layer.codes = layer.scales = None
    if codes is not None:
        q = torch.from_numpy(codes.q.astype(np.int32))
        layer.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # (in // BLOCK, out, 2): a block's scale and zero for every output.
        scales = np.stack([codes.scale.T, codes.zero.T], axis=-1)
        layer.scales = torch.from_numpy(np.ascontiguousarray(scales)).to(torch.bfloat16)
    layer.__class__ = int4_linear_class()
