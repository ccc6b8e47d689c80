"""Warm prompts' bound (engine/batched/pins.py): past a quarter of the KV cache, a warm prompt is not kept, nor computed
by it; within it, it is held for good (a chore for the batching thread, and no expiry)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ttft_sse.engine.base import Prompt
from ttft_sse.engine.batched.pins import WARM_SHARE, Pinned, Pins
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


class Holds:
    """The batching thread's cache, as the chores see it: what is held and what is let go, by name."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.freed: list[str] = []

    def search_prefix_match(self, name: str, ids: list[int]) -> int:
        self.held[name] = ids
        return len(ids)

    def free_blocks(self, name: str) -> None:
        self.freed.append(name)


def run_chores(made: Pins, cache: Holds) -> None:
    while made._counters.chores:
        made._counters.chores.popleft()(cache)


def restored(made: Pins, tokens: int, first: int = 0) -> Pinned:
    return Pinned(made.name(), tuple(range(first, first + tokens)), None, tokens)


def test_restored_prefixes_are_kept_within_the_warm_share_and_the_rest_let_go(monkeypatch: Any) -> None:
    made = pins(capacity=1024)
    share = 1024 // WARM_SHARE
    first, second, third = restored(made, share - 64), restored(made, 128, 1000), restored(made, 64, 2000)
    cache = Holds()
    assert made.keep_restored([first, second, third]) == share  # the second is past the share, the third fits
    run_chores(made, cache)
    assert cache.freed == [second.name]
    assert made.kept == share
    assert made.held() == [(first.ids, None), (third.ids, None)]


def test_a_warm_prompt_takes_the_room_of_the_last_restored_prefixes(monkeypatch: Any) -> None:
    made = pins(capacity=1024)
    monkeypatch.setattr(made, "cached", lambda p, salt="": p.n_tokens)
    share = 1024 // WARM_SHARE
    older, newer = restored(made, 128, 1000), restored(made, 96, 2000)
    made.keep_restored([older, newer])
    cache = Holds()

    kept = asyncio.run(made.warm(prompt(64)))  # 128 + 96 + 64 > 256: the last restored one makes room

    run_chores(made, cache)
    assert kept and cache.freed == [newer.name]
    assert made.kept == 128 + 64 <= share
    assert [ids for ids, _ in made.held()] == [tuple(range(64)), older.ids]  # the warm prompt first


def test_a_warm_prompt_a_restored_prefix_holds_takes_its_pin_over_without_computing(monkeypatch: Any) -> None:
    made = pins(capacity=1024)
    computed: list[int] = []
    monkeypatch.setattr(made, "_compute", lambda p, salt, hold: computed.append(p.n_tokens))
    held = restored(made, 64)  # the whole blocks of a 65-token prompt (its last token is the request's)
    made.keep_restored([held])
    cache = Holds()

    assert asyncio.run(made.warm(prompt(65)))

    run_chores(made, cache)
    assert computed == [] and cache.held == {} and cache.freed == []
    assert made.kept == 64 and made.held() == [(held.ids, None)]


def test_the_prefills_pins_come_after_the_kept_ones_the_newest_first() -> None:
    made = pins(capacity=4096)
    made.keep_restored([restored(made, 16, 500)])

    async def run() -> None:
        made.pin("a", prompt(8), None)
        made.pin("b", Prompt(text="", token_ids=(7, 7, 7, 7, 7)), 42)

    asyncio.run(run())
    assert made.held() == [(tuple(range(500, 516)), None), ((7, 7, 7, 7, 7), 42), (tuple(range(8)), None)]
