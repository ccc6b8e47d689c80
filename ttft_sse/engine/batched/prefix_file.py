"""The prefix store's file (``TTFT_PREFIX_STORE_BYTES``): prefixes' KV blocks, written on drain and read at start.

A safetensors file: one tensor of bytes per allocator of the paged cache (its name: ``blocks.<allocator>``), a row
per KV block, holding the block's bytes as the cache holds them (every layer's keys and values of the block's tokens);
and in the file's metadata (``ttft_prefix_store``) a JSON header:

* ``format``: :data:`FORMAT`;
* ``key``: what must be the same for those bytes to be the same KV (the model file, the engine, how its rows compute,
  the cache's dtype and geometry: engine/batched/prefix_store.py's ``key``);
* ``prefixes``: each with its token ids (whole blocks), its cache salt's seed (null: none), the mode that computed it
  and, block by block, the row that holds it (prefixes share rows where they share blocks);
* ``sha256``: of the header without it (its JSON, keys sorted) and of every tensor's bytes, by name.

:func:`read` gives the prefixes back, or :class:`Unusable` saying why not: no file, one that is not a whole
safetensors file (truncated, another kind of file), a checksum that does not match (corrupt), another format, or a
key that is not this server's (foreign: the field that differs). Nothing else of the file is trusted before the
checksum has matched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttft_sse.engine.cache_files import write_whole

FORMAT = 1
"""Bumped when what the file holds changes: a file of another format is not read."""
METADATA = "ttft_prefix_store"
"""The safetensors metadata entry that holds the header."""
TENSOR = "blocks."
"""Each allocator's tensor is named this and the allocator's name."""


@dataclass(frozen=True)
class Prefix:
    """A prefix kept in the file: its tokens (whole blocks), its salt's seed, its mode, and its blocks' rows."""

    tokens: tuple[int, ...]
    seed: int | None
    mode: str
    rows: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "seed": self.seed, "mode": self.mode, "rows": list(self.rows)}


@dataclass(frozen=True)
class Stored:
    """What the file holds: its key, its prefixes (first the ones to keep first) and each allocator's block rows (a
    uint8 tensor of ``[rows, bytes per block]``)."""

    key: Mapping[str, Any]
    prefixes: tuple[Prefix, ...]
    blocks: Mapping[str, Any]

    @property
    def bytes(self) -> int:
        return sum(int(t.numel()) for t in self.blocks.values())


@dataclass(frozen=True)
class Unusable:
    """Why a file is not read: ``what`` is one of ``missing``, ``unreadable``, ``corrupt``, ``foreign``; ``reason``
    the sentence the log says."""

    what: str
    reason: str


def write(path: Path, stored: Stored) -> bool:
    """Write ``stored`` at ``path``, whole or not at all (engine/cache_files.py); False where the directory cannot be
    written (logged there)."""
    from safetensors.torch import save_file

    tensors = {TENSOR + name: tensor.contiguous() for name, tensor in stored.blocks.items()}
    header: dict[str, Any] = {
        "format": FORMAT,
        "key": dict(stored.key),
        "prefixes": [prefix.as_json() for prefix in stored.prefixes],
    }
    header["sha256"] = _checksum(header, tensors)

    def fill(partial: Path) -> None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata={METADATA: json.dumps(header, separators=(",", ":"))})

    return write_whole(path, fill, "prefix_store_not_written")


def read(path: Path, key: Mapping[str, Any]) -> Stored | Unusable:
    """The file at ``path`` if it is whole, its checksum matches and its key is ``key``; else why not."""
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
    if header.get("format") != FORMAT:
        return Unusable("foreign", f"the prefix file {path} is of format {header.get('format')}, not {FORMAT}")
    theirs = header.get("key")
    if theirs != dict(key):
        return Unusable("foreign", f"the prefix file {path} is another server's: {_difference(theirs, key)}")
    try:
        prefixes = tuple(_prefix(entry) for entry in header["prefixes"])
        blocks = {name.removeprefix(TENSOR): tensor for name, tensor in tensors.items() if name.startswith(TENSOR)}
        _check_rows(prefixes, blocks)
    except (KeyError, TypeError, ValueError) as exc:
        return Unusable("corrupt", f"the prefix file {path} has prefixes that do not fit its blocks: {exc}")
    return Stored(dict(key), prefixes, blocks)


def _checksum(header: Mapping[str, Any], tensors: Mapping[str, Any]) -> str:
    import torch

    digest = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"\0{name}\0{list(tensor.shape)}\0{tensor.dtype}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _prefix(entry: Mapping[str, Any]) -> Prefix:
    seed = entry["seed"]
    if seed is not None and not isinstance(seed, int):
        raise TypeError(f"a seed of {seed!r}")
    tokens = tuple(int(t) for t in entry["tokens"])
    rows = tuple(int(r) for r in entry["rows"])
    return Prefix(tokens, seed, str(entry["mode"]), rows)


def _check_rows(prefixes: tuple[Prefix, ...], blocks: Mapping[str, Any]) -> None:
    if not blocks:
        raise ValueError("it holds no blocks")
    rows = min(int(tensor.shape[0]) for tensor in blocks.values())
    for prefix in prefixes:
        if prefix.rows and not 0 <= min(prefix.rows) <= max(prefix.rows) < rows:
            raise ValueError(f"a prefix's rows {min(prefix.rows)}-{max(prefix.rows)} are not within {rows} rows")
        if not prefix.rows or len(prefix.tokens) % len(prefix.rows):
            raise ValueError(f"a prefix of {len(prefix.tokens)} tokens in {len(prefix.rows)} blocks")
        if len({int(tensor.shape[0]) for tensor in blocks.values()}) > 1:
            raise ValueError("its allocators hold different numbers of rows")


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
