"""Int4 linear layers from a GGUF file's own Q4_0/Q4_1 blocks, on torch's CPU int4 kernel (``TTFT_INT4_WEIGHTS``).

A GGUF quantised to Q4_0 or Q4_1 (the bundled SmolLM2 is Q4_1) stores each linear weight in blocks of 32 inputs: 4-bit
codes ``q`` with one scale ``d`` (and, for Q4_1, one minimum ``m``) a block, ``w = d*q + m`` (Q4_0: ``w = d*(q-8)``).
transformers loads the file by expanding every weight to fp32, and a decode step then streams those fp32 weights
from memory. torch's CPU kernel for weight-only int4 (``_weight_int4pack_mm_for_cpu``, the one torchao's int4
weight-only mode calls) multiplies by the codes directly, ``w = (q-8)*scale + zero`` a block of 32: the file's own
formula with ``scale = d``, ``zero = m + 8d``. Measured on this machine (one thread, 30 weights of 576x1536, ms,
fp32 input cast to bf16 and the output back; ``/tmp`` script, run once):

====== ============ ================= ==========
rows   column-major oneDNN pre-packed int4 codes
====== ============ ================= ==========
1      8.7          10.8              2.2
8      20.3         13.5              6.4
16     22.0         15.5              11.7
32     25.7         21.0              22.9
48     22.8         25.6              33.4
512    163.5        167.9             343.1
====== ============ ================= ==========

So a layer keeps its fp32 weight (column-major, engine/weights.py) and gains the codes: forwards of up to 32 rows
(decode steps, short prompts) take the kernel, longer ones the fp32 GEMM. The kernel's activations are bf16 (its
scales and zeros too, and its output): the weights are the file's, the rounding of what multiplies them is bf16's.
That is why this is not the default: each row of the kernel's result depends on that row alone (checked bit for
bit), but the rest of a batched step does not. A stream's row goes through the fp32 GEMM in a step with more than
32 rows (a newcomer's prompt), and attention over a batch differs from attention alone by fp32 rounding, which
rounding to bf16 turns into whole bf16 steps now and then. Greedy answers then depend on the batch (measured: 53
of 64 differ from the single engine's), as with bf16.

Only a layer whose blocks give back exactly the fp32 weight transformers loaded (allowing the row order
transformers' loader permutes q and k into) gets codes; every other layer, and the LM head (the bundled file's
embedding is Q8_0), stays fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

log = structlog.get_logger("ttft_sse.engine")

BLOCK = 32
"""Inputs per GGUF block, and the group size the int4 kernel is given."""

INT4_ROWS = range(1, 33)
"""Row counts that take the int4 kernel (decode steps of up to 32 streams, short prompts); more take the fp32
weight, which is faster from ~36 rows on."""

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
        candidate = _Candidate(codes, _row_hashes(codes.first(HASHED_COLUMNS).dense()))
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


def apply(model: Any, gguf_path: str | Path, torch: Any) -> int:
    """Give every linear layer of ``model`` whose fp32 weight the file's Q4 blocks give back exactly its codes
    (it becomes an ``Int4Linear``); returns how many got them (0, logged with the reason, when this torch cannot
    or its kernel disagrees on a probe).

    Layers are matched to the file's tensors by their rows' bits, not by name, so no table of each
    architecture's names is needed, and a row order changed by transformers' loader (q and k) is found too."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        log.warning("weights_not_int4", reason="this torch has no CPU int4 kernel")
        return 0
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        # The kernel's vectorised path was measured on AVX-512 only; its scalar one (fp32 inputs take it) was 20x
        # slower than the fp32 GEMM at one row.
        log.warning("weights_not_int4", reason=f"the int4 kernel is used on AVX-512 only; this CPU: {capability}")
        return 0
    candidates = _index(read(gguf_path))
    attached: list[Any] = []
    try:
        for layer in list(model.modules()):
            if type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32:
                codes = _match(layer.weight.detach().numpy(), candidates)
                if codes is not None:
                    _attach(layer, codes, torch)
                    attached.append(layer)
        if attached:
            _check(attached[0], torch)
    except RuntimeError as exc:
        for layer in attached:  # back to the plain fp32 layers they were
            layer.__class__ = torch.nn.Linear
            del layer.codes, layer.scales
        log.warning("weights_not_int4", reason=str(exc))
        return 0
    return len(attached)


def _check(layer: Any, torch: Any) -> None:
    """The kernel against the fp32 GEMM of the same bf16-rounded rows, on one layer."""
    rows = torch.linspace(-1.0, 1.0, 8 * layer.in_features).reshape(8, layer.in_features)
    with torch.no_grad():
        want = torch.nn.functional.linear(rows.to(torch.bfloat16).float(), layer.weight, layer.bias)
        got = layer(rows)
    # bf16 keeps 8 bits: its rounding of the output alone is up to 1/256 of the largest value.
    if float((got - want).abs().max()) > 2e-2 * float(want.abs().max()):
        raise RuntimeError("the CPU int4 kernel disagrees with the fp32 GEMM on the same weights")


def _int4_mm(torch: Any, rows: Any, codes: Any, scales: Any) -> Any:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, codes, BLOCK, scales)


@functools.cache
def int4_linear_class() -> type[Any]:
    """``torch.nn.Linear`` with its weight's 4-bit codes beside it: up to :data:`INT4_ROWS` rows go through torch's
    CPU int4 kernel (bf16 in, the input's dtype out), more through the fp32 weight."""
    import torch

    class Int4Linear(torch.nn.Linear):  # type: ignore[misc]
        codes: Any
        scales: Any

        def forward(self, x: Any) -> Any:
            if x.numel() // x.shape[-1] not in INT4_ROWS:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = _int4_mm(torch, rows, self.codes, self.scales).to(x.dtype)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias

    return Int4Linear


def _attach(layer: Any, codes: Codes, torch: Any) -> None:
    """Give ``layer`` (a ``torch.nn.Linear``) its codes in the kernel's layout and make it an ``Int4Linear``."""
    q = torch.from_numpy(codes.q.astype(np.int32))
    layer.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # (in // BLOCK, out, 2): a block's scale and zero for every output.
    scales = np.stack([codes.scale.T, codes.zero.T], axis=-1)
    layer.scales = torch.from_numpy(np.ascontiguousarray(scales)).to(torch.bfloat16)
    layer.__class__ = int4_linear_class()
