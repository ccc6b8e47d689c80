"""The lower lanes' turns at the batch's rows: who sits a step out for the high lane's requests, in turn and within
its patience; and, on the real model, an urgent request that gets a row of a full batch while the others' answers
stay the single engine's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing

import pytest

from tests.support.engines import collect, eventually_idle, prompt_of
from tests.support.texts import QUESTIONS, STORY
from ttft_sse.engine.base import Finished, Piece, Prompt, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.library.turns import DUE_SHARE, PATIENCE_SECONDS, STALE, Turns
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock


def test_where_urgent_rows_are_wanted_the_lower_rows_that_ran_last_sit_out_in_turn() -> None:
    turns = Turns(patience=dict.fromkeys("abc", 1.0))
    turns.ran("abc", 0.0)
    assert turns.sit_out(rows=4, urgent=1, decoding=["a", "b", "c"], others=0, now=0.1) == []  # room for all
    # One row short: of three that ran in the same step, the library's first (the oldest) sits out.
    assert turns.sit_out(rows=3, urgent=1, decoding=["a", "b", "c"], others=0, now=0.1) == ["a"]
    turns.ran(["b", "c", "vip"], 0.1)  # the urgent one has no patience: it is never a candidate
    assert "vip" not in turns.last_ran
    assert turns.sit_out(rows=3, urgent=1, decoding=["b", "c", "a"], others=0, now=0.2) == ["b"]
    turns.ran(["c", "a"], 0.2)
    assert turns.sit_out(rows=3, urgent=1, decoding=["c", "a", "b"], others=0, now=0.3) == ["c"]
    # Two urgent and a prompt still computing (others): two of the three sit out, those that ran last.
    turns.ran(["a", "b"], 0.3)
    assert turns.sit_out(rows=3, urgent=2, decoding=["a", "b", "c"], others=0, now=0.4) == ["a", "b"]
    assert turns.sit_out(rows=4, urgent=2, decoding=["a", "b", "c"], others=1, now=0.4) == ["a", "b"]
    assert turns.sat_out == 7


def test_one_that_has_waited_half_its_patience_runs_next_and_the_urgent_newcomer_waits() -> None:
    turns = Turns(patience={"a": 1.0, "b": 0.2})
    turns.ran("ab", 0.0)
    now = DUE_SHARE * 0.2  # b has waited half of its 0.2 s: due; a, with 1 s, is not
    assert turns.sit_out(rows=2, urgent=1, decoding=["a", "b"], others=0, now=now) == ["a"]
    assert turns.sit_out(rows=1, urgent=1, decoding=["a", "b"], others=0, now=now) == ["a"]  # b cannot sit out
    later = DUE_SHARE * 1.0  # both due: none sits out; the urgent request waits for a row
    assert turns.sit_out(rows=2, urgent=1, decoding=["a", "b"], others=0, now=later) == []
    unknown = Turns()  # a request without a patience of its own has the default
    unknown.last_ran["x"] = 0.0
    assert unknown.sit_out(rows=1, urgent=1, decoding=["x"], others=0, now=DUE_SHARE * PATIENCE_SECONDS) == []


def test_a_prompt_is_held_back_for_urgent_ones_once() -> None:
    turns = Turns()
    for rid in ("early", "late"):
        turns.add(rid, 1.0)
    assert turns.held(["early"]) == ["early"]
    assert turns.held(["early", "late"]) == ["late"]  # early was held back a step already: it starts now
    turns.forget("late")
    turns.add("late", 1.0)  # an id the engine gave again (never, but forgotten means forgotten)
    assert turns.held(["late"]) == ["late"]


def test_requests_that_left_are_forgotten() -> None:
    turns = Turns(patience={"a": 1.0})
    turns.ran(["a"], 0.0)
    turns.forget("a")
    assert turns.patience == {} == turns.last_ran
    turns.patience["b"] = 1.0
    # One that left between a step's look and its note (forget runs in another thread): dropped once many pile up.
    turns.last_ran.update((f"gone-{i}", 0.0) for i in range(STALE + 1))
    turns.ran(["b"], 1.0)
    assert turns.last_ran == {"b": 1.0}


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[BatchedEngine]:
    engine = BatchedEngine(settings.replace(max_concurrency=2, high_extra_slots=0))  # two rows a step
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


async def _read(engine: BatchedEngine, prompt: Prompt, params: SamplingParams, going: asyncio.Event) -> str:
    """The answer's text; ``going`` is set once its third piece has come."""
    pieces: list[str] = []
    finished: list[Finished] = []
    async with aclosing(engine.stream(prompt, params)) as items:
        async for item in items:
            if isinstance(item, Piece):
                pieces.append(item.text)
                if len(pieces) == 3:
                    going.set()
            elif isinstance(item, Finished):
                finished.append(item)
    assert len(finished) == 1 and finished[0].usage.completion_tokens == params.max_tokens
    return "".join(pieces)


async def test_an_urgent_request_gets_a_row_of_a_full_batch_while_the_others_sit_out_in_turn_unchanged(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    """Two rows a step, both decoding long answers of the normal lane: an urgent request gets a row at once (not when
    one of them ends), the two sit its steps out in turn and go on after it, and every answer is the single engine's,
    token for token (greedy): a step sat out changes when a token comes, not which."""
    normal = SamplingParams(max_tokens=48, patience=60.0)  # never due here, however slow the shared machine's steps
    urgent = SamplingParams(max_tokens=8, urgent=True)
    prompts = [prompt_of(engine, STORY), prompt_of(engine, QUESTIONS[6])]
    vip = prompt_of(engine, QUESTIONS[0])
    expected = [(await collect(reference.stream(p, normal)))[0] for p in prompts]
    expected_vip, _ = await collect(reference.stream(vip, urgent))
    sat_out = engine.stats().rows_sat_out
    engine.batch_log.clear()
    going = [asyncio.Event(), asyncio.Event()]
    readers = [asyncio.create_task(_read(engine, p, normal, g)) for p, g in zip(prompts, going, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(g.wait() for g in going)), 120)
    arrived = len(engine.batch_log)
    texts = await asyncio.gather(*readers, _read(engine, vip, urgent, asyncio.Event()))
    await eventually_idle(engine)
    assert texts == [*expected, expected_vip]

    log = list(engine.batch_log)
    assert all(len(step) <= 2 for step in log)  # the batch's rows
    normals = {i for step in log[:arrived] for i in step}
    (urgent_id,) = {i for step in log for i in step} - normals
    assert len(normals) == 2
    urgent_steps = [n for n, step in enumerate(log) if urgent_id in step]
    # Its first row came while both normal answers still had tokens to make, and it had one in each step to its end.
    assert all(urgent_steps[0] < max(n for n, step in enumerate(log) if rid in step) for rid in normals)
    assert urgent_steps == list(range(urgent_steps[0], urgent_steps[-1] + 1))
    # The normal ones had the other row in turn, and both went on once it was done.
    assert all(any(rid in log[n] for n in urgent_steps) for rid in normals)
    assert all(any(rid in step for step in log[urgent_steps[-1] + 1 :]) for rid in normals)
    assert engine.stats().rows_sat_out - sat_out >= len(urgent_steps)  # one of the two, in each of its steps
