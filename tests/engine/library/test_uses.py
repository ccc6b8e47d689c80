"""The prompts the scheduler notes for the prefix store (engine/library/uses.py): the most hit first, then the most
recent; a bounded number, the least recent forgotten first."""

from __future__ import annotations

from ttft_sse.engine.library.uses import PrefixUses


def test_the_most_hit_prefixes_come_first_then_the_most_recent() -> None:
    uses = PrefixUses()
    uses.seen([1, 2, 3], None, "normal")
    uses.seen([4, 5, 6], None, "normal")
    for _ in range(3):
        uses.hit([1, 2], None, "normal")  # a shared system prompt
    uses.hit([4], 7, "normal")  # another salt: another prefix
    uses.seen([8], None, "int8")
    ranked = [(list(u.ids), u.seed, u.mode, u.hits) for u in uses.ranked()]
    assert ranked == [
        ([1, 2], None, "normal", 3),
        ([4], 7, "normal", 1),
        ([8], None, "int8", 0),
        ([4, 5, 6], None, "normal", 0),
        ([1, 2, 3], None, "normal", 0),
    ]


def test_the_least_recently_noted_are_forgotten_past_the_bound() -> None:
    uses = PrefixUses(limit=2)
    uses.seen([1], None, "normal")
    uses.seen([2], None, "normal")
    uses.seen([1], None, "normal")  # seen again: the most recent
    uses.seen([3], None, "normal")
    assert sorted(list(u.ids) for u in uses.ranked()) == [[1], [3]]


def test_restored_prompts_come_last_and_do_not_push_out_the_seen_ones() -> None:
    uses = PrefixUses(limit=3)
    uses.seen([1], None, "normal")
    uses.extend([([5], None, "normal"), ([6], None, "normal"), ([7], None, "normal")])
    assert [list(u.ids) for u in uses.ranked()] == [[1], [5], [6]]
