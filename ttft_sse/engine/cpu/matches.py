"""Which of a model's linear layers a GGUF file holds, in which type, and their codes (engine/cpu/codes.py).

Layers are matched to the file's tensors by their rows' bits, not by name (no table of names; rows reordered by
transformers' loader, q and k, are found too), and get codes only if these give back exactly the fp32 weight
transformers loaded. Every matrix is known by a hash of its rows' first columns, so each layer's GGUF type is known
whether it gets codes or not (:class:`Found`). Reading and matching takes seconds, so the codes and types are kept
in the model's converted directory for the next start (:data:`CACHE_FILE`). :func:`by_type` gives the account of
each type's path that ``/readyz`` and the log show.
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
from ttft_sse.engine.cpu.codes import DENSE, FORMATS, Codes, decode

log = structlog.get_logger("ttft_sse.engine")

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


NOT_QUANTISED = "not quantised: int8 rows multiply quantised blocks"
"""Why a layer on the kernel keeps fp32 rows where int8 rows are asked for: its type is a dense one
(``Codes.unquantised``), and every quantised type has int8 records (engine/cpu/layouts.py's ``records``)."""


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


CACHE_FILE = "gguf-codes-5.npz"
"""Where :func:`of_layers` keeps what it found, by layer name, in the model's converted directory (its name
changes with the types read into codes and what they keep, so that a cache of fewer types, or without Q5_K's
factors, is not taken for one of all of them)."""


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
                    kept = f"{name}.kd" in saved.files  # a K-quant's factors
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
            path = (1, f"blocks, fp32 rows: {{}} ({NOT_QUANTISED})")
        paths.setdefault(kind, Counter())[path] += 1
    return {
        kind: "; ".join(text.format(count) for (_, text), count in sorted(counted.items()))
        for kind, counted in sorted(paths.items())
    }
