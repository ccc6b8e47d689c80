"""The batched prefix store's file (``TTFT_PREFIX_STORE_MB``): prefixes' KV blocks, written on drain and read at
start, in the prefix stores' checksummed file (engine/kv_file.py: its header, checksum, key and why a file is not read).

Its tensors: one tensor of bytes per allocator of the paged cache (its name: ``blocks.<allocator>``), a row per KV
block, holding the block's bytes as the cache holds them (every layer's keys and values of the block's tokens). Its
header's ``key`` is engine/batched/prefix_store.py's ``key`` (the model file, the engine, how its rows compute, the
cache's dtype and geometry); its ``prefixes``, each with its token ids (whole blocks), its cache salt's seed (null:
none), the mode that computed it and, block by block, the row that holds it (prefixes share rows where they share
blocks).

:func:`read` gives the prefixes back, or :class:`~ttft_sse.engine.kv_file.Unusable` saying why not; a file whose
prefixes point past its rows is corrupt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttft_sse.engine import kv_file
from ttft_sse.engine.kv_file import Unusable

FORMAT = 1
"""Bumped when what the file holds changes: a file of another format is not read."""
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


def write(path: Path, stored: Stored) -> bool:
    """Write ``stored`` at ``path``, whole or not at all; False where the directory cannot be written (logged)."""
    tensors = {TENSOR + name: tensor.contiguous() for name, tensor in stored.blocks.items()}
    prefixes = [prefix.as_json() for prefix in stored.prefixes]
    return kv_file.write(path, stored.key, FORMAT, prefixes, tensors)


def read(path: Path, key: Mapping[str, Any]) -> Stored | Unusable:
    """The file at ``path`` if it is whole, its checksum matches and its key is ``key``; else why not."""

    def parse(entries: Sequence[Any], tensors: Mapping[str, Any]) -> Stored:
        prefixes = tuple(_prefix(entry) for entry in entries)
        blocks = {name.removeprefix(TENSOR): tensor for name, tensor in tensors.items() if name.startswith(TENSOR)}
        _check_rows(prefixes, blocks)
        return Stored(dict(key), prefixes, blocks)

    return kv_file.read(path, key, FORMAT, parse)


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
