"""A GGUF file's tensors, found by the model's own names, read from the file as they are stored.

The loader (engine/loading/assembly.py) names, for each of the model's weights, the file's tensor that holds it and
the order in which the model takes that tensor's rows (:class:`Place`: transformers reorders Llama's q and k rows as it
loads them). From then on a weight is read as the file stores it: its type's blocks as codes for the block kernel
(:meth:`Stored.codes`), a few rows through gguf's own dequantisation to check those codes against
(:meth:`Stored.rows`), or the whole of it in fp32 for a layer the kernel does not run (:meth:`Stored.dense`).

Reads go through the file (``os.pread``), not a mapping of all of it: what one layer's read brings in is the page
cache's, never held by the process once the layer is laid out, so a load's resident memory is what it keeps, not the
file as well. :meth:`Stored.mapped` maps one tensor alone (the token embedding, whose rows are read as tokens come).
"""

from __future__ import annotations

import functools
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ttft_sse.engine.cache_files import write_whole
from ttft_sse.engine.kernels.codes import DENSE, FORMATS, Codes, decode

UNKNOWN = "unknown"
"""The type of a weight the file holds no tensor for."""


@dataclass(frozen=True)
class Place:
    """Where a weight lies in the file: its tensor's name, and the order of its rows (row ``i`` of the weight is row
    ``order[i]`` of the tensor; None: the same order)."""

    tensor: str
    order: npt.NDArray[np.intp] | None = None


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: its GGML type (id and name), its shape as the model takes it (outputs first), where
    its bytes start and how many there are."""

    kind: int
    kind_name: str
    shape: tuple[int, ...]
    offset: int
    size: int

    @property
    def row_bytes(self) -> int:
        return self.size // self.shape[0] if len(self.shape) > 1 else self.size


def table(path: str | Path, keep: Path | None = None) -> dict[str, Tensor]:
    """The tensors of the GGUF file at ``path`` by name (:func:`header`)."""
    return header(path, keep)[0]


def header(path: str | Path, keep: Path | None = None) -> tuple[dict[str, Tensor], str]:
    """The tensors of the GGUF file at ``path`` by name, and its ``general.architecture``. gguf's reader parses every
    metadata field (seconds for a large vocabulary's tokens and merges), so what it found is kept in ``keep`` (a JSON
    file in the model's cache folder, which is keyed by the file) and read from there at later starts; and once a
    process."""
    stat = os.stat(path)
    return _header(str(path), stat.st_size, stat.st_mtime_ns, keep)


@functools.lru_cache(maxsize=4)
def _header(path: str, size: int, mtime: int, keep: Path | None) -> tuple[dict[str, Tensor], str]:
    if keep is not None:
        try:
            kept = json.loads(keep.read_text())
            if kept["format"] == HEADER_FORMAT and kept["size"] == size:
                tensors = {
                    name: Tensor(int(kind), str(kind_name), tuple(shape), int(offset), int(size_))
                    for name, (kind, kind_name, shape, offset, size_) in kept["tensors"].items()
                }
                return tensors, str(kept["arch"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # parsed again, and kept again
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(int(t.tensor_type))
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest-moving dimension first
        tensors[t.name] = Tensor(int(kind), kind.name, shape, int(t.data_offset), int(t.n_bytes))
    field = reader.fields.get("general.architecture")
    architecture = "" if field is None else str(field.contents())
    del reader  # its mapping of the whole file goes with it
    if keep is not None and keep.parent.is_dir():
        body = {"format": HEADER_FORMAT, "size": size, "arch": architecture}
        body["tensors"] = {name: [t.kind, t.kind_name, list(t.shape), t.offset, t.size] for name, t in tensors.items()}

        def write(partial: Path) -> None:
            partial.write_text(json.dumps(body))

        write_whole(keep, write, "gguf_header_not_kept")
    return tensors, architecture


HEADER_FORMAT = 1
"""Bump when what :func:`header` keeps changes."""
HEADER_FILE = "gguf-tensors.json"
"""Where :func:`header` keeps a file's table: in the model's cache folder."""


class Stored:
    """The file's tensors for the weights ``places`` names (by the model's names)."""

    def __init__(self, path: str | Path, places: dict[str, Place], tensors: dict[str, Tensor] | None = None) -> None:
        self.path = Path(path)
        self.places = places
        self.tensors = table(path) if tensors is None else tensors
        self._fd = os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def tensor(self, name: str) -> Tensor | None:
        place = self.places.get(name)
        return None if place is None else self.tensors.get(place.tensor)

    def kind(self, name: str) -> str:
        """The GGUF type's name of the weight ``name`` (:data:`UNKNOWN` where the file holds none)."""
        tensor = self.tensor(name)
        return UNKNOWN if tensor is None else tensor.kind_name

    def _tensor(self, name: str) -> tuple[Tensor, Place]:
        tensor = self.tensor(name)
        if tensor is None:
            raise KeyError(f"the file holds no tensor for {name}")
        return tensor, self.places[name]

    def _file_rows(self, place: Place, rows: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        return rows if place.order is None else place.order[rows]

    def raw(self, name: str, rows: npt.NDArray[np.intp] | None = None) -> npt.NDArray[np.uint8]:
        """The stored bytes of the weight ``name``'s rows (all of them where ``rows`` is None), in the model's row
        order: ``(rows, bytes a row)``."""
        tensor, place = self._tensor(name)
        width = tensor.row_bytes
        if rows is None and place.order is None:
            return self._read(tensor.offset, tensor.size).reshape(-1, width)
        if rows is None:
            whole = self._read(tensor.offset, tensor.size).reshape(-1, width)
            return whole[place.order]
        picked = self._file_rows(place, np.asarray(rows, np.intp))
        out = np.empty((len(picked), width), np.uint8)
        for i, row in enumerate(picked):
            out[i] = self._read(tensor.offset + int(row) * width, width)
        return out

    def _read(self, offset: int, size: int) -> npt.NDArray[np.uint8]:
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        while done < size:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path} ends before the tensor at {offset} ({size} bytes)")
            done += got
        return np.frombuffer(buffer, np.uint8)

    def codes(self, name: str) -> Codes | None:
        """The weight ``name`` as :class:`Codes`, in the model's row order; None where its type has none (the
        kernel's :data:`codes.FORMATS` and :data:`codes.DENSE` types) or it is not a matrix."""
        tensor, _ = self._tensor(name)
        if len(tensor.shape) != 2 or (tensor.kind not in FORMATS and tensor.kind not in DENSE):
            return None
        return decode(self.raw(name), tensor.kind, (tensor.shape[0], tensor.shape[1]))

    def rows(self, name: str, rows: npt.NDArray[np.intp]) -> npt.NDArray[np.float32]:
        """Rows ``rows`` of the weight ``name`` in fp32, as gguf's own dequantisation gives them (what transformers'
        loader gives the fp32 model)."""
        import gguf

        tensor, _ = self._tensor(name)
        raw = self.raw(name, rows)
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(tensor.kind))
        return np.asarray(values, np.float32).reshape(len(rows), -1)

    def dense(self, name: str) -> npt.NDArray[np.float32]:
        """The whole weight ``name`` in fp32 (gguf's dequantisation), in the model's row order."""
        import gguf

        tensor, _ = self._tensor(name)
        values = gguf.quants.dequantize(self.raw(name), gguf.GGMLQuantizationType(tensor.kind))
        return np.asarray(values, np.float32).reshape(tensor.shape)

    def mapped(self, name: str) -> tuple[npt.NDArray[np.uint8], Tensor]:
        """The weight ``name``'s stored bytes, ``(rows, bytes a row)`` in the file's row order, mapped read-only from
        the file alone (a row's pages are read when it is first touched), and its tensor."""
        tensor, _ = self._tensor(name)
        start = tensor.offset - tensor.offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._fd, tensor.offset - start + tensor.size, offset=start, access=mmap.ACCESS_READ)
        data: Any = np.frombuffer(mapping, np.uint8, tensor.size, tensor.offset - start)
        return data.reshape(-1, tensor.row_bytes), tensor
