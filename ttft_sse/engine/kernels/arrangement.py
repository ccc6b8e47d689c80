"""The block kernel's arrays as laid out for it, kept in one file for the next start and mapped from it.

Reading a model's codes from its GGUF file (engine/kernels/stored.py, engine/kernels/codes.py) and laying them out for
the kernel (engine/kernels/layouts.py) costs a start seconds (a minute for a 7B model). What the kernel's layers hold at
the end of it (each layer's arrays, its int8 records where it keeps them, the rows it takes and every layer's GGUF type)
is therefore written into the model's cache directory, one file for each arrangement (fp32 or int8 rows, with or
without the degraded mode), and every start maps that file (copy on write: the process never changes it, and the
page cache shares it between processes). The file is written layer by layer as each is laid out (:func:`save` takes
the entries as they come), and the process holds the mapping alone: a first start's resident memory is the
arrangement, not the arrangement and the arrays it was written from.

A kept file is used only when all of these hold, and is otherwise built again and rewritten, never used:

- its key is this start's: the file's format, the source of the layouts and of the codes' reading, the kernel's
  library (its name is a hash of the kernel's source, the compiler, its flags and the CPU's feature flags), the
  rows and the byte order;
- it holds the same layers, with the same shapes, as the model loaded;
- its arrays' checksum (CRC-32) is the one it was written with, and it is as long as it says;
- for each layer, rows spread over its weight, as the GGUF file's own dequantisation gives them now, have the
  checksum they had when the file was written (another file, or another row order, is laid out again).

The file: the magic, where the header starts and its length (two little-endian 64-bit numbers), the arrays from
byte :data:`ALIGN` on, each at a multiple of :data:`ALIGN`, then the header (JSON: the key, the arrays' length and
checksum, every layer's type, each kept layer's arrays by dtype, shape and offset).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from ttft_sse.engine.cache_files import write_whole
from ttft_sse.engine.kernels.codes import Codes
from ttft_sse.engine.kernels.layouts import panels, records

log = structlog.get_logger("ttft_sse.engine")

FORMAT = 2
"""Bump when the file's layout changes."""
MAGIC = b"TTFTARR\0"
ALIGN = 64
"""Every array starts at a multiple of this many bytes from the file's start."""
CHECKED_ROWS = 32
"""Rows of each layer whose weight is checked against the file's own dequantisation."""
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("layouts.py", "codes.py", "stored.py"))


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
    mapped: bool = False  # its arrays are views of a kept file's mapping (:func:`load`)


@dataclass(frozen=True)
class Kept:
    """An arrangement: every layer's GGUF type, and the entries of those on the kernel."""

    kinds: dict[str, str]
    entries: dict[str, Entry]


def laid_out(codes: Codes, rows: str, degrade: bool, check: int, six: bool = False, five: bool = False) -> Entry:
    """``codes`` laid out for ``rows`` (``"fp32"``: panels, Q6_K's in 6 bits where ``six``, the Q5 types' in 5 where
    ``five``: layouts.panels; ``"int8"``: records), with the records beside them where ``degrade``; ``check`` is
    :func:`rows_checksum` of the weight the codes give back."""
    arrays = (records(codes),) if rows == "int8" else panels(codes, six, five)
    held = records(codes) if degrade and not codes.unquantised else None
    out, inputs = codes.q.shape
    return Entry((out, inputs), codes.bits, rows, arrays, held, check)


def path_for(directory: Path, activations: str, degrade: bool) -> Path:
    """Where the arrangement for ``activations`` rows (and the degraded mode's records) is kept in the model's cache
    ``directory``."""
    return directory / f"kernel-arrays-{activations}{'-degrade' if degrade else ''}.bin"


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


def save(path: Path, key: str, kinds: dict[str, str], entries: Iterable[tuple[str, Entry]]) -> bool:
    """Write the arrangement of ``kinds`` (every layer's type) and ``entries`` (those on the kernel, taken one at a
    time as they come: none is held after it is written) at ``path``, atomically; False where the directory cannot
    be written (logged), with the entries not taken all consumed."""
    layers: dict[str, Any] = {}
    total = 0

    def write(partial: Path) -> None:
        nonlocal total
        crc, offset = 0, ALIGN
        with partial.open("wb") as fh:
            fh.write(b"\0" * ALIGN)

            def place(array: npt.NDArray[Any]) -> list[Any]:
                nonlocal crc, offset
                start = -(-offset // ALIGN) * ALIGN
                padding = b"\0" * (start - offset)
                data = np.ascontiguousarray(array).view(np.uint8).reshape(-1).data
                fh.write(padding)
                fh.write(data)
                crc = zlib.crc32(data, zlib.crc32(padding, crc))
                offset = start + array.nbytes
                return [array.dtype.str, list(array.shape), start - ALIGN]

            for name, entry in entries:
                layers[name] = {
                    "shape": list(entry.shape),
                    "bits": entry.bits,
                    "rows": entry.rows,
                    "check": entry.check,
                    "arrays": [place(a) for a in entry.arrays],
                    "records": None if entry.records is None else place(entry.records),
                }
            total = offset - ALIGN
            header = json.dumps({"key": key, "size": total, "crc32": crc, "kinds": kinds, "layers": layers}).encode()
            fh.write(header)
            fh.seek(0)
            fh.write(MAGIC + struct.pack("<QQ", offset, len(header)))

    if not write_whole(path, write, "arrangement_not_written"):  # a read-only cache directory: laid out again
        for _ in entries:  # what a generator had not yet laid out is not needed
            pass
        return False
    log.info("arrangement_kept", path=str(path), layers=len(layers), mib=round(total / 2**20, 1))
    return True


Checks = dict[str, tuple[tuple[int, int], int]]
"""The shape and :func:`rows_checksum` of each layer the kernel may take, by name."""


def load(path: Path, key: str, kinds: dict[str, str], checks: Checks) -> Kept | None:
    """The arrangement kept at ``path``, mapped, if it is usable with this ``key`` for layers of ``kinds`` (every
    layer's GGUF type) and ``checks``; else None, with the reason logged where there was a file (the module
    docstring)."""
    if not path.is_file():
        return None
    try:
        kept, reason = _read(path, key, kinds, checks)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        kept, reason = None, f"unreadable: {exc!r}"
    if kept is None:
        log.info("arrangement_rebuilt", path=str(path), reason=reason)
    return kept


def _read(path: Path, key: str, kinds: dict[str, str], checks: Checks) -> tuple[Kept | None, str]:
    with path.open("rb") as fh:
        if fh.read(len(MAGIC)) != MAGIC:
            return None, "not an arrangement file"
        at, length = struct.unpack("<QQ", fh.read(16))
        size = os.fstat(fh.fileno()).st_size
        if at < ALIGN or at + length != size:
            return None, "truncated or extended"
        fh.seek(at)
        header = json.loads(fh.read(length))
        if header["key"] != key:
            return None, "written for another layout, kernel or CPU"
        if int(header["size"]) != at - ALIGN:
            return None, "truncated or extended"
        if header["kinds"] != kinds or not set(header["layers"]) <= set(checks):
            return None, "written for other layers"
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    data = np.frombuffer(mapped, np.uint8, at - ALIGN, ALIGN)
    if zlib.crc32(data.data) != header["crc32"]:
        return None, "checksum mismatch"
    entries = {}
    for name, layer in header["layers"].items():
        arrays = tuple(_view(data, where) for where in layer["arrays"])
        records = None if layer["records"] is None else _view(data, layer["records"])
        (want_shape, want_check), shape = checks[name], (int(layer["shape"][0]), int(layer["shape"][1]))
        if want_shape != shape or want_check != layer["check"]:
            return None, f"written for another weight of {name}"
        entries[name] = Entry(shape, int(layer["bits"]), str(layer["rows"]), arrays, records, layer["check"], True)
    return Kept({str(k): str(v) for k, v in header["kinds"].items()}, entries), ""


def _view(data: npt.NDArray[np.uint8], where: list[Any]) -> npt.NDArray[Any]:
    dtype, shape, offset = np.dtype(where[0]), tuple(int(n) for n in where[1]), int(where[2])
    count = int(np.prod(shape)) * dtype.itemsize
    if offset % ALIGN or offset + count > data.size:
        raise ValueError("an array lies outside the file")
    array: npt.NDArray[Any] = data[offset : offset + count].view(dtype).reshape(shape)
    return array


def release(tensors: tuple[Any, ...]) -> None:
    """Hand back the pages of a kept file's mapping that only ``tensors`` (views of it: an :attr:`Entry.mapped`
    layer's arrays) lie on, once no layer reads them any more (joined into one layer's arrays of their own:
    kernel.join). The mapping is private and the file is never written through it, so a page handed back
    (``MADV_DONTNEED``) would be read from the file again if touched, and nothing touches it: the process's resident
    memory is the joined copy alone, not the copy and the pages it was made from."""
    page = mmap.PAGESIZE
    for tensor in tensors:
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
        if end > start:
            _madvise(start, end - start)


def _madvise(start: int, length: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(start, length, mmap.MADV_DONTNEED)
