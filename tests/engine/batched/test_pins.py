"""Warm prompts' bound (engine/batched/pins.py): past a quarter of the KV cache, a warm prompt is not kept, nor computed
by it; within it, it is held for good (a chore for the batching thread, and no expiry)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ttft_sse.engine.base import Prompt
from ttft_sse.engine.batched.pins import WARM_SHARE, Pins
from ttft_sse.engine.library.scheduler import PrefixCounters
from ttft_sse.engine.threads import Mailboxes


class FullCache:
    """The batching thread's cache, as the chores see it: what they hold."""

    def __init__(self) -> None:
        self.held: list[tuple[str, list[int]]] = []

    def search_prefix_match(self, name: str, ids: list[int]) -> int:
        self.held.append((name, ids))
        return len(ids)


def pins(capacity: int) -> Pins:
    counters = PrefixCounters()
    made = Pins(counters, Mailboxes(alive=lambda: True, dead=RuntimeError), itertools.count(1), keep_seconds=60)
    made.attach(manager=object(), capacity=capacity)
    return made


def prompt(tokens: int) -> Prompt:
    return Prompt(text="", token_ids=tuple(range(tokens)))


def test_a_warm_prompt_within_the_share_is_held_for_good_and_one_past_it_is_not(monkeypatch: Any) -> None:
    made = pins(capacity=1024)
    monkeypatch.setattr(made, "cached", lambda p, salt="": p.n_tokens)  # every block there: nothing to compute
    share = 1024 // WARM_SHARE
    cache: Any = FullCache()

    async def run() -> tuple[bool, bool, bool]:
        first = await made.warm(prompt(share - 16))
        second = await made.warm(prompt(32))  # past the share with the first
        third = await made.warm(prompt(16))  # fits beside the first
        return first, second, third

    assert asyncio.run(run()) == (True, False, True)
    assert made.kept == share and made.pinned == 0
    while made._counters.chores:
        made._counters.chores.popleft()(cache)
    assert [len(ids) for _, ids in cache.held] == [share - 16, 16]
