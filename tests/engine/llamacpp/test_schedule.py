"""The llama.cpp engine's step plans: admission by ids and KV cells, a row per decoding stream, prompts chunked, and
the kept tokens of free ids reused by a prompt that starts with them."""

from __future__ import annotations

import math
from dataclasses import replace

from ttft_sse.engine.llamacpp.schedule import Kept, Schedule, Sequence


def schedule(
    *, sequences: int = 4, cells: int = 1000, batch_tokens: int = 32, chunk: int = 4, reuse: bool = False
) -> Schedule:
    return Schedule(sequences=sequences, cells=cells, batch_tokens=batch_tokens, chunk=chunk, reuse=reuse)


def test_a_prompt_alone_is_computed_in_one_step_with_logits_at_its_last_row() -> None:
    plan_of = schedule()
    plan_of.add(Sequence("a", tuple(range(10, 20)), max_tokens=5))
    assert [s.seq for s in plan_of.admit()] == [0]
    plan = plan_of.plan()
    assert [(r.seq, r.token, r.position, r.logits) for r in plan.rows] == [(0, 10 + i, i, i == 9) for i in range(10)]
    assert [(row, s.key) for row, s in plan.outputs] == [(9, "a")]


def test_decoding_streams_get_a_row_each_step_and_a_long_newcomer_goes_in_chunks() -> None:
    plan_of = schedule(batch_tokens=8, chunk=3)
    a = Sequence("a", (1, 2), max_tokens=50)
    plan_of.add(a)
    plan_of.admit()
    plan_of.plan()
    a.generated.append(7)  # its first token
    plan_of.add(Sequence("b", tuple(range(100, 120)), max_tokens=5))  # 20 tokens: longer than a step's room
    plan_of.admit()
    first = plan_of.plan()
    assert [(r.seq, r.token, r.position, r.logits) for r in first.rows] == [
        (0, 7, 2, True),
        (1, 100, 0, False),
        (1, 101, 1, False),
        (1, 102, 2, False),
    ]
    assert first.prompt_rows == 3
    a.generated.append(8)
    second = plan_of.plan()
    assert [(r.seq, r.token, r.position) for r in second.rows] == [(0, 8, 3), (1, 103, 3), (1, 104, 4), (1, 105, 5)]


def test_a_prompt_that_fits_what_is_left_of_the_step_goes_whole_beside_decoding_streams() -> None:
    plan_of = schedule(batch_tokens=16, chunk=2)
    a = Sequence("a", (1,), max_tokens=50)
    plan_of.add(a)
    plan_of.admit()
    plan_of.plan()
    a.generated.append(5)
    plan_of.add(Sequence("b", tuple(range(10)), max_tokens=5))
    plan_of.admit()
    plan = plan_of.plan()
    assert len(plan.rows) == 11
    assert [s.key for _, s in plan.outputs] == ["a", "b"]


def test_admission_waits_for_a_free_id_in_arrival_order() -> None:
    plan_of = schedule(sequences=2)
    for key in "abcd":
        plan_of.add(Sequence(key, (1, 2, 3), max_tokens=4))
    assert [(s.key, s.seq) for s in plan_of.admit()] == [("a", 0), ("b", 1)]
    assert [s.key for s in plan_of.waiting] == ["c", "d"]
    removed = plan_of.remove("a")
    assert removed is not None and removed.seq == 0
    assert [(s.key, s.seq) for s in plan_of.admit()] == [("c", 0)]
    assert [s.key for s in plan_of.waiting] == ["d"]


def test_a_cancelled_waiting_request_leaves_the_queue_and_holds_no_id() -> None:
    plan_of = schedule(sequences=1)
    plan_of.add(Sequence("a", (1,), max_tokens=1))
    plan_of.add(Sequence("b", (1,), max_tokens=1))
    plan_of.admit()
    assert plan_of.remove("b") is None
    assert not plan_of.waiting
    assert plan_of.remove("a") is not None
    assert plan_of.empty


def test_a_sequence_too_big_for_the_cache_never_fits() -> None:
    plan_of = schedule(cells=64)  # a sequence's cells
    assert plan_of.fits(Sequence("a", tuple(range(32)), max_tokens=32))
    assert not plan_of.fits(Sequence("b", tuple(range(32)), max_tokens=33))


def run_to_end(plan_of: Schedule, sequence: Sequence, generated: tuple[int, ...]) -> None:
    """Admit ``sequence``, compute its prompt, give it ``generated`` and take it out."""
    plan_of.add(sequence)
    plan_of.admit()
    while sequence.computed < len(sequence.prompt):
        plan_of.plan()
    sequence.generated.extend(generated)
    plan_of.remove(sequence.key)


def test_a_free_id_keeps_its_prompt_and_fed_back_tokens_and_a_request_sharing_them_computes_only_the_rest() -> None:
    plan_of = schedule(reuse=True)
    run_to_end(plan_of, Sequence("a", (1, 2, 3, 4, 5), max_tokens=8), generated=(6, 7, 8))
    assert plan_of.kept[0] == Kept("", (1, 2, 3, 4, 5, 6, 7))  # the last generated token is never fed back
    plan_of.add(Sequence("b", (9, 9), max_tokens=4))  # shares nothing: the id left longest ago (an unused one)
    plan_of.add(Sequence("c", (1, 2, 3, 4, 5, 6, 7, 20, 21), max_tokens=4))
    b, c = plan_of.admit()
    assert (b.seq, b.cached) == (1, 0)
    assert (c.seq, c.cached, c.computed) == (0, 7, 7)
    assert plan_of.kept[0] == Kept()  # a running id's cells are its request's
    rows = plan_of.plan().rows
    assert [(r.seq, r.token, r.position, r.logits) for r in rows if r.seq == 0] == [
        (0, 20, 7, False),
        (0, 21, 8, True),
    ]


def test_the_same_prompt_again_computes_only_its_last_token_for_its_logits() -> None:
    plan_of = schedule(reuse=True)
    run_to_end(plan_of, Sequence("a", (1, 2, 3), max_tokens=4), generated=(4,))
    again = Sequence("b", (1, 2, 3), max_tokens=4)
    plan_of.add(again)
    plan_of.admit()
    assert again.cached == 2
    assert [(r.token, r.position, r.logits) for r in plan_of.plan().rows] == [(3, 2, True)]


def test_kept_tokens_are_reused_only_under_the_same_salt() -> None:
    plan_of = schedule(sequences=1, reuse=True)
    run_to_end(plan_of, Sequence("a", (1, 2, 3, 4), max_tokens=4, salt="key:1"), generated=(5,))
    assert plan_of.cached((1, 2, 3, 4, 9), "key:1") == 4
    assert plan_of.cached((1, 2, 3, 4, 9), "key:2") == 0
    assert plan_of.cached((1, 2, 3, 4, 9), "") == 0
    other = Sequence("b", (1, 2, 3, 4, 9), max_tokens=4, salt="key:2")
    plan_of.add(other)
    plan_of.admit()
    assert (other.seq, other.cached, other.computed) == (0, 0, 0)


def test_a_cancelled_prompt_keeps_only_what_was_computed_of_it() -> None:
    plan_of = schedule(batch_tokens=4, reuse=True)
    sequence = Sequence("a", tuple(range(10)), max_tokens=4)
    plan_of.add(sequence)
    plan_of.admit()
    plan_of.plan()  # 4 of its 10 tokens
    plan_of.remove("a")
    assert plan_of.kept[0].tokens == (0, 1, 2, 3)


def test_without_reuse_nothing_is_kept_and_every_prompt_is_computed_whole() -> None:
    plan_of = schedule(sequences=1)
    run_to_end(plan_of, Sequence("a", (1, 2, 3), max_tokens=4), generated=(4, 5))
    assert plan_of.kept == [Kept()]
    again = Sequence("b", (1, 2, 3), max_tokens=4)
    plan_of.add(again)
    plan_of.admit()
    assert again.cached == again.computed == 0


def test_when_reuse_ends_the_admitted_compute_their_whole_prompts_and_nothing_is_kept() -> None:
    plan_of = schedule(reuse=True)
    run_to_end(plan_of, Sequence("a", (1, 2, 3), max_tokens=4), generated=(4, 5))
    again = Sequence("b", (1, 2, 3, 4), max_tokens=4)
    plan_of.add(again)
    admitted = plan_of.admit()
    assert again.cached == 3
    plan_of.end_reuse(admitted)
    assert again.cached == again.computed == 0
    assert not plan_of.reuse and all(kept == Kept() for kept in plan_of.kept)


def prefill(key: str, prompt: tuple[int, ...], *, salt: str = "", owner: str = "") -> Sequence:
    return Sequence(key, prompt, max_tokens=0, salt=salt, background=True, owner=owner)


def test_a_prefill_computes_its_prompt_in_chunks_without_logits_and_its_id_keeps_it() -> None:
    plan_of = schedule(sequences=2, chunk=4, reuse=True)
    p = prefill("p", tuple(range(10)))
    plan_of.add(p)
    assert plan_of.admit() == [p]
    steps = [plan_of.plan() for _ in range(3)]
    assert [[(r.token, r.logits) for r in s.rows] for s in steps] == [
        [(0, False), (1, False), (2, False), (3, False)],
        [(4, False), (5, False), (6, False), (7, False)],
        [(8, False), (9, False)],
    ]
    assert [s.prefilled for s in steps] == [(), (), (p,)] and not any(s.outputs for s in steps)
    assert plan_of.remove("p") is p
    assert plan_of.take_ended() == [p] and p.rows == 10
    assert plan_of.kept[p.seq].tokens == tuple(range(10))
    # The request that follows takes that id and computes the rest of its prompt.
    request = Sequence("r", (*range(10), 50, 51), max_tokens=4)
    plan_of.add(request)
    plan_of.admit()
    assert (request.seq, request.cached) == (p.seq, 10)


def test_a_prefill_gets_what_keeps_the_steps_prompt_rows_within_a_chunk_after_the_requests_and_none_while_held() -> (
    None
):
    plan_of = schedule(sequences=3, batch_tokens=32, chunk=4, reuse=True)
    a = Sequence("a", (1,), max_tokens=50)
    plan_of.add(a)
    plan_of.admit()
    plan_of.plan()
    a.generated.append(2)  # a stream decodes
    b = Sequence("b", (7, 7, 7), max_tokens=4)  # a short prompt: it goes whole, its 3 rows first
    plan_of.add(b)
    p = prefill("p", tuple(range(100, 120)))
    plan_of.add(p)
    plan_of.admit()
    rows = plan_of.plan().rows
    assert [(r.seq, r.token) for r in rows] == [(0, 2), (1, 7), (1, 7), (1, 7), (2, 100)]
    a.generated.append(3)
    b.generated.append(8)
    assert [(r.seq, r.token) for r in plan_of.plan(held=True).rows] == [(0, 3), (1, 8)]
    a.generated.append(4)
    b.generated.append(9)
    assert [(r.seq, r.token) for r in plan_of.plan().rows] == [(0, 4), (1, 9), (2, 101), (2, 102), (2, 103), (2, 104)]


def test_a_prefill_waits_while_held_or_while_a_request_waits_and_gives_its_id_up_to_a_request() -> None:
    plan_of = schedule(sequences=1, batch_tokens=4, chunk=4, reuse=True)
    p = prefill("p", tuple(range(100, 120)))
    plan_of.add(p)
    assert plan_of.admit(held=True) == [] and list(plan_of.prefills) == [p]
    assert plan_of.admit() == [p]
    plan_of.plan()  # 4 of its 20 tokens
    request = Sequence("r", (100, 101, 9, 9), max_tokens=4)  # not a continuation of the prefill's prompt
    plan_of.add(request)
    assert plan_of.admit() == [request]
    assert (request.seq, request.cached) == (0, 2)  # the prefill's id, with what it shares of its computed part
    assert list(plan_of.prefills) == [p] and (p.seq, p.computed) == (-1, 0)  # waiting again
    assert plan_of.take_ended() == []
    plan_of.plan()
    request.generated.append(5)
    assert plan_of.admit() == []  # the id is the request's until it leaves
    plan_of.remove("r")
    assert plan_of.admit() == [p] and p.cached == 2  # what the request's cells share with its prompt


def test_a_request_that_starts_with_a_prefills_prompt_ends_it_and_finds_what_it_computed() -> None:
    plan_of = schedule(sequences=2, batch_tokens=8, chunk=8, reuse=True)
    p = prefill("p", tuple(range(100, 120)), salt="s")
    plan_of.add(p)
    plan_of.admit()
    plan_of.plan()  # 8 of its 20 tokens
    request = Sequence("r", (*range(100, 120), 7), max_tokens=4, salt="s")
    plan_of.add(request)
    assert plan_of.admit() == [request]
    assert plan_of.take_ended() == [p] and p.rows == 8
    assert (request.seq, request.cached) == (p.seq, 8)
    assert not plan_of.prefills and list(plan_of.running) == ["r"]


def test_a_newer_prefill_of_the_same_owner_ends_the_older_and_the_keep_of_its_prompt() -> None:
    now = [0.0]
    plan_of = Schedule(
        sequences=3, cells=1000, batch_tokens=4, chunk=4, reuse=True, keep_seconds=60, clock=lambda: now[0]
    )
    done = prefill("done", (1, 2, 3, 4), owner="tab")
    plan_of.add(done)
    plan_of.admit()
    [step] = [plan_of.plan()]
    assert step.prefilled == (done,)
    plan_of.remove("done")
    assert plan_of.kept[done.seq] == Kept("", (1, 2, 3, 4), "tab", 60.0)
    older = prefill("older", tuple(range(100, 120)), owner="tab")
    plan_of.add(older)
    plan_of.admit()
    plan_of.plan()
    newer = prefill("newer", (1, 2, 3, 4, 5, 6), owner="tab")
    plan_of.add(newer)
    assert plan_of.take_ended() == [done, older]
    assert plan_of.kept[done.seq] == Kept("", (1, 2, 3, 4))  # kept no longer for the request that follows
    assert plan_of.kept[older.seq].tokens == (100, 101, 102, 103)  # what it computed stays
    assert plan_of.admit() == [newer] and (newer.seq, newer.cached) == (done.seq, 4)


def test_a_prefills_prompt_is_kept_for_the_request_that_starts_with_it_unless_no_other_id_is_free() -> None:
    now = [0.0]
    plan_of = Schedule(
        sequences=2, cells=1000, batch_tokens=8, chunk=8, reuse=True, keep_seconds=60, clock=lambda: now[0]
    )
    p = prefill("p", (1, 2, 3, 4))
    plan_of.add(p)
    plan_of.admit()
    plan_of.plan()
    plan_of.remove("p")
    other = Sequence("other", (1, 2, 9), max_tokens=4)  # shares 2 tokens with it, but does not start with it
    plan_of.add(other)
    plan_of.admit()
    assert other.seq != p.seq
    follows = Sequence("follows", (1, 2, 3, 4, 5), max_tokens=4)
    plan_of.add(follows)
    plan_of.admit()
    assert (follows.seq, follows.cached) == (p.seq, 4)
    for key in ("other", "follows"):
        plan_of.remove(key)
    # Expired, it is evicted like any kept prefix: the longest shared prefix wins.
    p2 = prefill("p2", (1, 2, 3, 4, 8))
    plan_of.add(p2)
    plan_of.admit()
    plan_of.plan()
    plan_of.remove("p2")
    now[0] = 61.0
    again = Sequence("again", (1, 2, 3, 7), max_tokens=4)
    plan_of.add(again)
    plan_of.admit()
    assert (again.seq, again.cached) == (p2.seq, 3)


def test_a_prefill_whose_prompt_a_free_id_holds_computes_nothing() -> None:
    plan_of = schedule(reuse=True)
    run_to_end(plan_of, Sequence("a", (1, 2, 3), max_tokens=4), generated=(4, 5))
    p = prefill("p", (1, 2, 3, 4))
    plan_of.add(p)
    assert plan_of.admit() == [] and plan_of.take_ended() == [p] and p.rows == 0


def test_the_prefix_store_ranks_prefills_prompts_first_then_the_ids_left_last_and_puts_back_into_vacant_ids() -> None:
    now = [0.0]
    plan_of = Schedule(
        sequences=4, cells=1000, batch_tokens=8, chunk=8, reuse=True, keep_seconds=60, clock=lambda: now[0]
    )
    for key, prompt in (("old", (1, 2)), ("new", (3, 4))):
        plan_of.add(Sequence(key, prompt, max_tokens=1))
        plan_of.admit()
        plan_of.plan()
        plan_of.remove(key)
        now[0] += 1
    warm = prefill("warm", (5, 6, 7))
    plan_of.add(warm)
    plan_of.admit()
    plan_of.plan()
    plan_of.remove("warm")
    # A prefill's prompt first; then the request left last first. Ids that hold nothing are not ranked.
    assert [plan_of.kept[seq].tokens for seq in plan_of.ranked()] == [(5, 6, 7), (3, 4), (1, 2)]
    vacant = plan_of.vacant()
    assert [plan_of.kept[seq].tokens for seq in vacant] == [(), (1, 2), (3, 4), (5, 6, 7)]
    now[0] += 1
    plan_of.hold(vacant[0], "s", (8, 9), keep=True)  # put back by the prefix store, a prefill's prompt
    assert plan_of.kept[vacant[0]] == Kept("s", (8, 9), "", 63.0)
    assert plan_of.ranked()[0] == vacant[0]  # kept for the request to come, the newest keep
    request = Sequence("r", (8, 9, 10), max_tokens=2, salt="s")
    plan_of.add(request)
    assert plan_of.admit() == [request] and (request.seq, request.cached) == (vacant[0], 2)


def test_a_warm_prompt_is_kept_for_good_and_a_warm_prompt_a_free_id_holds_keeps_that_id() -> None:
    now = [0.0]
    plan_of = Schedule(
        sequences=2, cells=1000, batch_tokens=8, chunk=8, reuse=True, keep_seconds=60, clock=lambda: now[0]
    )
    warm = replace(prefill("warm", (1, 2, 3, 4)), keep=math.inf)
    plan_of.add(warm)
    plan_of.admit()
    plan_of.plan()
    plan_of.remove("warm")
    now[0] = 1e9  # any prefill's keep long over
    other = Sequence("other", (1, 2, 9), max_tokens=4)  # shares 2 tokens with it: it would take it, were it not kept
    plan_of.add(other)
    plan_of.admit()
    assert other.seq != warm.seq
    plan_of.remove("other")
    # A free id that holds a warm prompt already (put back by the prefix store, kept 60 s): the warm prompt computes
    # nothing and keeps that id for good.
    plan_of.hold(other.seq, "", (5, 6, 7), keep=True)
    again = replace(prefill("again", (5, 6, 7)), keep=math.inf)
    plan_of.take_ended()  # the first warm prompt's end
    plan_of.add(again)
    assert plan_of.admit() == [] and plan_of.take_ended() == [again]
    assert plan_of.kept[other.seq].until == math.inf
