"""The block kernel's arrays as laid out for it, kept in one file for the next start and mapped from it.

Reading a model's codes (engine/cpu/codes.py) and laying them out for the kernel (engine/cpu/layouts.py) costs a
start about a second for the bundled model. What the kernel's layers hold at the end of it (each layer's arrays, its
int8 records where it keeps them, the rows it takes and every layer's GGUF type) is therefore written once into the
model's converted directory, one file for each arrangement (fp32 or int8 rows, with or without the degraded mode),
and later starts map that file (copy on write: the process never changes it, and the page cache shares it between
processes) instead.

A kept file is used only when all of these hold, and is otherwise built again and rewritten, never used:

- its key is this start's: the file's format, the source of the layouts and of the codes' reading, the kernel's
  library (its name is a hash of the kernel's source, the compiler, its flags and the CPU's feature flags), the
  rows and the byte order;
- it holds the same layers, with the same shapes, as the model loaded;
- its arrays' checksum (CRC-32) is the one it was written with, and it is as long as it says;
- for each layer, rows spread over its weight, as the codes give them back, have the checksum they had against the
  fp32 weight loaded now (a changed loader's row order, as ``codes`` guards against in its own cache).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from ttft_sse.engine.cache_files import write_whole
from ttft_sse.engine.cpu.codes import Codes
from ttft_sse.engine.cpu.layouts import panels, records

log = structlog.get_logger("ttft_sse.engine")

FORMAT = 1
"""Bump when the file's layout changes."""
MAGIC = b"TTFTARR\0"
ALIGN = 64
"""Every array starts at a multiple of this many bytes from the file's start."""
CHECKED_ROWS = 32
"""Rows of each layer whose weight is checked against the fp32 weight loaded."""
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("layouts.py", "codes.py", "matches.py"))


@dataclass(frozen=True)
class Entry:
    """What one layer on the kernel holds: its weight's shape (outputs, inputs), its codes' bits, the rows it takes
    (``"fp32"`` or ``"int8"``), its arrays in the kernel's layout, its int8 records beside them (the degraded mode)
    or None, and the checksum of :func:`checked_rows` of its weight."""

    shape: tuple[int, int]
    bits: int
    rows: str
    arrays: tuple[npt.NDArray[Any], ...]
    records: npt.NDArray[Any] | None
    check: int


@dataclass(frozen=True)
class Kept:
    """An arrangement: every layer's GGUF type, and the entries of those on the kernel."""

    kinds: dict[str, str]
    entries: dict[str, Entry]


def laid_out(
    codes: Codes, rows: str, degrade: bool, weight: npt.NDArray[np.float32], six: bool = False, five: bool = False
) -> Entry:
    """``codes`` laid out for ``rows`` (``"fp32"``: panels, Q6_K's in 6 bits where ``six``, the Q5 types' in 5 where
    ``five``: layouts.panels; ``"int8"``: records), with the records beside them where ``degrade``; ``weight`` is the
    fp32 weight the codes give back, as loaded."""
    arrays = (records(codes),) if rows == "int8" else panels(codes, six, five)
    held = records(codes) if degrade and not codes.unquantised else None
    out, inputs = codes.q.shape
    return Entry((out, inputs), codes.bits, rows, arrays, held, rows_checksum(weight))


def path_for(codes_cache: Path, activations: str, degrade: bool) -> Path:
    """Where the arrangement for ``activations`` rows (and the degraded mode's records) is kept: beside the codes'
    cache, in the model's converted directory."""
    return codes_cache.with_name(f"kernel-arrays-{activations}{'-degrade' if degrade else ''}.bin")


def key(library: Path, activations: str, degrade: bool) -> str:
    """What a kept arrangement must have been written for (the module docstring)."""
    digest = hashlib.sha256(f"{FORMAT}:{library.name}:{activations}:{degrade}:{sys.byteorder}".encode())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:32]


def checked_rows(outputs: int) -> npt.NDArray[np.intp]:
    """The rows of an ``outputs``-row weight whose checksum is kept: the first, the last and evenly spaced ones."""
    return np.unique(np.linspace(0, outputs - 1, min(outputs, CHECKED_ROWS)).round().astype(np.intp))


def rows_checksum(weight: npt.NDArray[np.float32]) -> int:
    """The CRC-32 of :func:`checked_rows` of ``weight`` (outputs x inputs, fp32)."""
    return zlib.crc32(np.ascontiguousarray(weight[checked_rows(weight.shape[0])], dtype=np.float32).data)


def save(path: Path, key: str, kept: Kept) -> None:
    """Write ``kept`` at ``path`` (atomically); a directory that cannot be written is logged and left alone."""
    layers: dict[str, Any] = {}
    placed: list[tuple[int, npt.NDArray[Any]]] = []
    offset = 0

    def place(array: npt.NDArray[Any]) -> list[Any]:
        nonlocal offset
        offset = -(-offset // ALIGN) * ALIGN
        placed.append((offset, np.ascontiguousarray(array)))
        where = [array.dtype.str, list(array.shape), offset]
        offset += array.nbytes
        return where

    for name, entry in kept.entries.items():
        layers[name] = {
            "shape": list(entry.shape),
            "bits": entry.bits,
            "rows": entry.rows,
            "check": entry.check,
            "arrays": [place(a) for a in entry.arrays],
            "records": None if entry.records is None else place(entry.records),
        }
    data = bytearray(offset)
    for at, array in placed:
        data[at : at + array.nbytes] = array.view(np.uint8).reshape(-1).data
    header = json.dumps(
        {"key": key, "size": len(data), "crc32": zlib.crc32(data), "kinds": kept.kinds, "layers": layers}
    ).encode()
    start = _data_start(len(header))

    def write(partial: Path) -> None:
        with partial.open("wb") as fh:
            fh.write(MAGIC + struct.pack("<Q", len(header)) + header)
            fh.write(b"\0" * (start - fh.tell()))
            fh.write(data)

    if not write_whole(path, write, "arrangement_not_written"):  # a read-only cache directory: laid out again
        return
    log.info("arrangement_kept", path=str(path), layers=len(layers), mib=round(len(data) / 2**20, 1))


def load(path: Path, key: str, weights: dict[str, npt.NDArray[np.float32]]) -> Kept | None:
    """The arrangement kept at ``path``, mapped, if it is usable for ``weights`` (each layer's fp32 weight by name,
    as loaded) with this ``key``; else None, with the reason logged where there was a file (the module docstring)."""
    if not path.is_file():
        return None
    try:
        kept, reason = _read(path, key, weights)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        kept, reason = None, f"unreadable: {exc!r}"
    if kept is None:
        log.info("arrangement_rebuilt", path=str(path), reason=reason)
    return kept


def _read(path: Path, key: str, weights: dict[str, npt.NDArray[np.float32]]) -> tuple[Kept | None, str]:
    with path.open("rb") as fh:
        if fh.read(len(MAGIC)) != MAGIC:
            return None, "not an arrangement file"
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > path.stat().st_size:
            return None, "truncated"
        header = json.loads(fh.read(length))
        if header["key"] != key:
            return None, "written for another layout, kernel or CPU"
        start, size = _data_start(length), int(header["size"])
        if os.fstat(fh.fileno()).st_size != start + size:
            return None, "truncated or extended"
        if set(header["kinds"]) != set(weights):
            return None, "written for other layers"
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if start + size else None
    data = np.frombuffer(mapped, np.uint8, size, start) if mapped is not None else np.zeros(0, np.uint8)
    if zlib.crc32(data.data) != header["crc32"]:
        return None, "checksum mismatch"
    entries = {}
    for name, layer in header["layers"].items():
        arrays = tuple(_view(data, where) for where in layer["arrays"])
        records = None if layer["records"] is None else _view(data, layer["records"])
        weight, shape = weights[name], (int(layer["shape"][0]), int(layer["shape"][1]))
        if weight.shape != shape or rows_checksum(weight) != layer["check"]:
            return None, f"written for another weight of {name}"
        entries[name] = Entry(shape, int(layer["bits"]), str(layer["rows"]), arrays, records, int(layer["check"]))
    return Kept({str(k): str(v) for k, v in header["kinds"].items()}, entries), ""


def _view(data: npt.NDArray[np.uint8], where: list[Any]) -> npt.NDArray[Any]:
    dtype, shape, offset = np.dtype(where[0]), tuple(int(n) for n in where[1]), int(where[2])
    count = int(np.prod(shape)) * dtype.itemsize
    if offset % ALIGN or offset + count > data.size:
        raise ValueError("an array lies outside the file")
    array: npt.NDArray[Any] = data[offset : offset + count].view(dtype).reshape(shape)
    return array


def _data_start(header_length: int) -> int:
    return -(-(len(MAGIC) + 8 + header_length) // ALIGN) * ALIGN
