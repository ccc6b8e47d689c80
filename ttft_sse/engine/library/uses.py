"""The prompts the batched engine saw lately, and how often a request found each prefix in the cache: after the
pinned prompts, what the prefix store keeps on drain (engine/batched/prefix_store.py), the most used first.

The scheduler (engine/library/scheduler.py) notes each request's prompt when it is first scheduled
(:meth:`PrefixUses.seen`) and, where a request's prompt starts with blocks the cache holds, that prefix
(:meth:`PrefixUses.hit`): a system prompt that every user's first turn starts with is hit by each of them. At most
:data:`MAX_PROMPTS` are noted, the least recently seen or hit forgotten first. Written by the batching thread; read
(and written, by a restore) while the batching loop is paused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_PROMPTS = 64
"""Prompts noted at most (a few MB of token ids for long ones)."""


@dataclass
class Use:
    """A prompt (or the prefix of one that a request found cached), its salt's seed, the mode of the step that saw
    it, and the requests that found it cached."""

    ids: array[int]
    seed: int | None
    mode: str
    hits: int = 0


class PrefixUses:
    """The last :data:`MAX_PROMPTS` prompts and prefixes noted, with their hits."""

    def __init__(self, limit: int = MAX_PROMPTS) -> None:
        self._limit = limit
        self._uses: OrderedDict[tuple[int | None, str, bytes], Use] = OrderedDict()

    def __len__(self) -> int:
        return len(self._uses)

    def seen(self, ids: Sequence[int], seed: int | None, mode: str) -> None:
        """A request's prompt, first scheduled."""
        self._note(ids, seed, mode)

    def hit(self, ids: Sequence[int], seed: int | None, mode: str) -> None:
        """A request found the blocks of ``ids`` (a prefix of its prompt) in the cache."""
        self._note(ids, seed, mode).hits += 1

    def ranked(self) -> list[Use]:
        """Most hits first; among as many hits, the most recently noted first."""
        recent = list(reversed(self._uses.values()))
        return sorted(recent, key=lambda use: -use.hits)

    def extend(self, prompts: Iterable[tuple[Sequence[int], int | None, str]]) -> None:
        """Note ``prompts`` (ids, seed, mode) as the least recent ones, with no hits (a restore's)."""
        for ids, seed, mode in prompts:
            if len(self._uses) >= self._limit:
                return
            key, packed = _key(ids, seed, mode)
            if key not in self._uses:
                self._uses[key] = Use(packed, seed, mode)
                self._uses.move_to_end(key, last=False)

    def _note(self, ids: Sequence[int], seed: int | None, mode: str) -> Use:
        key, packed = _key(ids, seed, mode)
        use = self._uses.get(key)
        if use is None:
            use = self._uses[key] = Use(packed, seed, mode)
            while len(self._uses) > self._limit:
                self._uses.popitem(last=False)
        else:
            self._uses.move_to_end(key)
        return use


def _key(ids: Sequence[int], seed: int | None, mode: str) -> tuple[tuple[int | None, str, bytes], array[int]]:
    packed = array("q", ids)
    return (seed, mode, hashlib.blake2b(packed.tobytes(), digest_size=16).digest()), packed
