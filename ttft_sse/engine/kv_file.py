"""A prefix store's file (``TTFT_PREFIX_STORE_MB``): prefixes' KV as bytes, written on drain and read at start, by
every engine that stores prefixes (engine/batched/prefix_file.py: paged-cache blocks; engine/llamacpp/prefix_store.py:
llama.cpp's sequence states).

A safetensors file: the engine's tensors of bytes, and in the file's metadata (``ttft_prefix_store``) a JSON header:

* ``format``: the engine's file format (bumped when what the file holds changes);
* ``key``: what must be the same for those bytes to be the same KV (the model file, the engine and every choice of
  its arithmetic and layout: each engine's store says what);
* ``prefixes``: each prefix's token ids and what the engine needs to put it back (its salt, where its bytes are);
* ``sha256``: of the header without it (its JSON, keys sorted) and of every tensor's bytes, by name.

:func:`read` gives the header's prefixes and the tensors back, or :class:`Unusable` saying why not: no file, one that
is not a whole safetensors file (truncated, another kind of file), a checksum that does not match (corrupt), another
format, or a key that is not this server's (foreign: the field that differs). Nothing else of the file is trusted
before the checksum has matched; the engine's ``parse`` then checks that the prefixes fit the tensors.

The file of a model lives in the cache directory's ``prefixes`` folder, named by the model file and its key
(:func:`path_of`), one per engine.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ttft_sse.engine.cache_files import write_whole

METADATA = "ttft_prefix_store"
"""The safetensors metadata entry that holds the header."""
FOLDER = "prefixes"
"""The cache directory's folder of prefix files, one per model file and engine."""

T = TypeVar("T")


@dataclass(frozen=True)
class Unusable:
    """Why a file is not read: ``what`` is one of ``missing``, ``unreadable``, ``corrupt``, ``foreign``; ``reason``
    the sentence the log says."""

    what: str
    reason: str


def write(
    path: Path,
    key: Mapping[str, Any],
    file_format: int,
    prefixes: Sequence[Mapping[str, Any]],
    tensors: Mapping[str, Any],
) -> bool:
    """Write ``prefixes`` (JSON) and ``tensors`` (torch, contiguous) at ``path`` under ``key``, whole or not at all
    (engine/cache_files.py); False where the directory cannot be written (logged there)."""
    from safetensors.torch import save_file

    header: dict[str, Any] = {"format": file_format, "key": dict(key), "prefixes": list(prefixes)}
    header["sha256"] = _checksum(header, tensors)

    def fill(partial: Path) -> None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        save_file(dict(tensors), str(partial), metadata={METADATA: json.dumps(header, separators=(",", ":"))})

    return write_whole(path, fill, "prefix_store_not_written")


def read(
    path: Path,
    key: Mapping[str, Any],
    file_format: int,
    parse: Callable[[Sequence[Any], Mapping[str, Any]], T],
) -> T | Unusable:
    """``parse(prefixes, tensors)`` of the file at ``path`` if it is whole, its checksum matches and its format and
    key are these; else why not. A ``parse`` that raises KeyError, TypeError or ValueError (prefixes that do not fit
    the tensors) makes the file corrupt."""
    import safetensors

    if not path.is_file():
        return Unusable("missing", f"no prefix file at {path}")
    try:
        with safetensors.safe_open(str(path), "pt") as opened:
            text = (opened.metadata() or {}).get(METADATA)
            names = opened.keys()  # a safe_open is not iterable
            tensors = {name: opened.get_tensor(name) for name in names}
    except (OSError, safetensors.SafetensorError) as exc:
        return Unusable("unreadable", f"the prefix file {path} cannot be read as a safetensors file: {exc}")
    if text is None:
        return Unusable("unreadable", f"the prefix file {path} has no {METADATA} header")
    try:
        header = json.loads(text)
        checksum = header.pop("sha256")
    except (ValueError, AttributeError, KeyError, TypeError):
        return Unusable("corrupt", f"the prefix file {path} has a header that is not its JSON with a sha256")
    if checksum != _checksum(header, tensors):
        return Unusable("corrupt", f"the prefix file {path} does not match its sha256 (a changed or damaged file)")
    if header.get("format") != file_format:
        return Unusable("foreign", f"the prefix file {path} is of format {header.get('format')}, not {file_format}")
    theirs = header.get("key")
    if theirs != dict(key):
        return Unusable("foreign", f"the prefix file {path} is another server's: {_difference(theirs, key)}")
    try:
        return parse(header["prefixes"], tensors)
    except (KeyError, TypeError, ValueError) as exc:
        return Unusable("corrupt", f"the prefix file {path} has prefixes that do not fit its tensors: {exc}")


class _Prefix(Protocol):
    @property
    def tokens(self) -> tuple[int, ...]: ...


class Contents(Protocol):
    """What a store read or writes: its prefixes (each with its tokens) and its bytes of KV."""

    @property
    def prefixes(self) -> tuple[_Prefix, ...]: ...

    @property
    def bytes(self) -> int: ...


def sizes(contents: Contents, started: float) -> dict[str, Any]:
    """What a store's log line says of a file: its prefixes, their tokens, its bytes of KV, and the milliseconds since
    ``started``."""
    return {
        "prefixes": len(contents.prefixes),
        "tokens": sum(len(p.tokens) for p in contents.prefixes),
        "bytes": contents.bytes,
        "ms": round((time.perf_counter() - started) * 1000, 1),
    }


def path_of(cache_dir: Path, source: str, engine: str = "") -> Path:
    """The prefix file of the model at ``source`` (a file, a directory or a model id) in ``cache_dir``; ``engine``
    names the file of an engine other than the batched one."""
    name = Path(source).stem or "model"
    tail = f"-{engine}" if engine else ""
    return cache_dir / FOLDER / f"{name}-{model_key(source)}{tail}.safetensors"


def model_key(source: str) -> str:
    """The model file's key: a GGUF's from its size and the bytes at both ends (engine/loading/sources.py's), a
    directory's from its files' names, sizes and times; a model id is its own key."""
    from ttft_sse.engine.loading.sources import gguf_key

    path = Path(source)
    if path.is_file():
        return gguf_key(path)
    digest = hashlib.sha256(source.encode())
    if path.is_dir():
        for entry in sorted(path.iterdir()):
            if entry.is_file():
                stat = entry.stat()
                digest.update(f"\0{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _checksum(header: Mapping[str, Any], tensors: Mapping[str, Any]) -> str:
    import torch

    digest = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"\0{name}\0{list(tensor.shape)}\0{tensor.dtype}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _difference(theirs: Any, ours: Mapping[str, Any]) -> str:
    """The first field of the key that differs, in the key's order (the most telling first), as the log says it."""
    if not isinstance(theirs, dict):
        return "it has no key"
    for name in [*ours, *(name for name in theirs if name not in ours)]:
        if theirs.get(name) != ours.get(name):
            return f"its {name} is {_short(theirs.get(name))}, this server's {_short(ours.get(name))}"
    return "its key differs"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
