"""The batching loop's scheduler: chunked prefill beside decoding streams, observed through the engine's step log."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import dataclass

import pytest

from tests.support.engines import collect, eventually_idle, prompt_of
from tests.support.texts import PASSAGE, STORY
from ttft_sse.engine.base import Finished, Piece, Prompt, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

CHUNK = 16
BUDGET = 128  # prompt tokens a step (TTFT_BATCH_TOKENS): the long prompt below is longer, the chat one shorter


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[BatchedEngine]:
    engine = BatchedEngine(settings.replace(prefill_chunk_tokens=CHUNK, batch_tokens=BUDGET))
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


@dataclass(frozen=True)
class Beside:
    """A newcomer sent while a story streams: its answer, and the step log from its arrival."""

    text: str
    steps: list[tuple[str, ...]]  # the request ids that got a token, step by step, from the newcomer's arrival
    teller: str  # the story's request id
    newcomer: str

    @property
    def first(self) -> int:
        """Steps from the newcomer's arrival to the one that gave its first token."""
        return next(i for i, step in enumerate(self.steps) if self.newcomer in step)


async def beside_a_story(engine: BatchedEngine, newcomer: Prompt, max_tokens: int) -> Beside:
    """Stream a long story; after its third piece send ``newcomer``; stop the story once the newcomer has ended."""
    engine.batch_log.clear()
    late: asyncio.Task[tuple[str, Finished]] | None = None
    arrived = pieces = 0
    async with aclosing(engine.stream(prompt_of(engine, STORY), SamplingParams(max_tokens=600))) as story:
        async for item in story:
            pieces += isinstance(item, Piece)
            if pieces == 3:
                arrived = len(engine.batch_log)
                late = asyncio.create_task(collect(engine.stream(newcomer, SamplingParams(max_tokens=max_tokens))))
            if late is not None and late.done():
                break
    assert late is not None
    text, _ = await late
    await eventually_idle(engine)
    log = list(engine.batch_log)
    teller = log[0][0]
    (other,) = {rid for step in log for rid in step} - {teller}
    return Beside(text, log[arrived:], teller, other)


async def test_a_long_prompt_beside_a_decoding_stream_is_computed_a_chunk_a_step(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    """Beside a stream that decodes, each step computes at most CHUNK of the long prompt's tokens, and the stream
    gets a token in every one of those steps; the long prompt's answer is the single engine's all the same."""
    long = engine.prepare(prompt=PASSAGE * 4, messages=None, raw=True)
    assert long.n_tokens > 300 > BUDGET
    seen = await beside_a_story(engine, long, max_tokens=8)
    expected, _ = await collect(reference.stream(long, SamplingParams(max_tokens=8)))
    assert seen.text == expected
    # Every step from the newcomer's arrival to its first token decoded the story too, and there were at least as
    # many as its prompt has chunks (whatever the prefix cache held of it, at most a few blocks).
    assert all(seen.teller in step for step in seen.steps[: seen.first + 1])
    assert seen.first >= (long.n_tokens - 32) // CHUNK


async def test_a_prompt_that_fits_a_step_is_computed_in_one_beside_a_decoding_stream(engine: BatchedEngine) -> None:
    """Chunking is for prompts longer than a step's budget: a chat message's prompt gets its first token in the first
    step that holds it, as when nothing decodes."""
    short = engine.prepare(prompt="Once again: " + PASSAGE, messages=None, raw=True)
    assert CHUNK < short.n_tokens < BUDGET - 8
    seen = await beside_a_story(engine, short, max_tokens=2)
    assert seen.first <= 2  # the step in flight, then the one that computed it whole (not one per chunk)


async def test_a_long_prompt_alone_takes_the_whole_token_budget(engine: BatchedEngine) -> None:
    """With nothing decoding, chunked prefill does not apply: the prompt is computed TTFT_BATCH_TOKENS a step."""
    long = engine.prepare(prompt="Once more: " + PASSAGE * 4, messages=None, raw=True)
    steps = engine.stats().steps
    engine.batch_log.clear()
    _, finished = await collect(engine.stream(long, SamplingParams(max_tokens=2)))
    assert finished.usage.completion_tokens == 2
    # A step that produced no token is not counted; the prompt's steps end in the first token's step.
    assert engine.stats().steps - steps == 2


def test_a_chunk_shrinks_as_a_long_prompts_attention_grows() -> None:
    from ttft_sse.engine.library.scheduler import CHUNK_CONTEXT, MIN_CHUNK, chunk_rows

    assert chunk_rows(64, 0) == chunk_rows(64, CHUNK_CONTEXT) == 64
    assert chunk_rows(64, 2 * CHUNK_CONTEXT) == 32  # twice the keys: half the rows
    assert chunk_rows(64, 5000) == MIN_CHUNK  # 13 by the proportion, but never below the floor
    assert chunk_rows(8, 100_000) == 8  # a chunk set below the floor is kept as set


def test_urgent_requests_waiting_beside_others_are_scheduled_first_and_alone() -> None:
    """The scheduler's choice of waiting requests for a step: where urgent ones (the high lane's) wait, the others
    are left out of it and put back after, in their order, unless the library scheduled them meanwhile."""
    from collections import deque

    from ttft_sse.engine.library.scheduler import PrefixCounters, scheduler_class

    counters = PrefixCounters()
    cls = scheduler_class(counters)
    scheduler = cls.__new__(cls)  # the choice alone: no cache, no library step
    scheduler.waiting_requests_order = deque(["a", "b", "vip", "c"])
    scheduler.waiting_requests = dict.fromkeys(["a", "b", "vip", "c"])
    assert scheduler._hold_back_all_but_urgent() == []  # nothing urgent: the library's FIFO as it is
    assert list(scheduler.waiting_requests_order) == ["a", "b", "vip", "c"]
    counters.urgent.add("vip")
    later = scheduler._hold_back_all_but_urgent()
    assert later == ["a", "b", "c"] and list(scheduler.waiting_requests_order) == ["vip"]
    # The next step, with another urgent newcomer: those held back once start beside it, after it; a new one waits.
    counters.urgent.add("vip2")
    scheduler.waiting_requests_order = deque(["a", "b", "c", "d", "vip2"])
    later = scheduler._hold_back_all_but_urgent()
    assert later == ["d"] and list(scheduler.waiting_requests_order) == ["vip2", "a", "b", "c"]
    counters.urgent.add("other")  # urgent, but not waiting
    scheduler.waiting_requests_order = deque(["e"])
    assert scheduler._hold_back_all_but_urgent() == []


def test_lower_lane_decoding_rows_sit_out_where_urgent_ones_want_the_step_s_rows() -> None:
    """The scheduler's look before the library's choice: three rows a step, two normal requests decoding and one
    computing its prompt, an urgent one waiting: one decoding normal request is taken out of the library's view for
    the step (not the one computing its prompt, whose first token has not gone out), then put back."""
    from collections import deque
    from types import SimpleNamespace

    from transformers.generation.continuous_batching.requests import RequestStatus

    from ttft_sse.engine.library.scheduler import PrefixCounters, scheduler_class

    counters = PrefixCounters()
    cls = scheduler_class(counters)
    scheduler = cls.__new__(cls)  # the choice alone: no cache, no library step
    scheduler.max_requests_per_batch = 3
    decoding = SimpleNamespace(status=RequestStatus.DECODING)
    prompt = SimpleNamespace(status=RequestStatus.PREFILLING)
    scheduler.active_requests = {"a": decoding, "b": decoding, "long": prompt}
    scheduler.waiting_requests = {"vip": SimpleNamespace(status=RequestStatus.PENDING)}
    scheduler.waiting_requests_order = deque(["vip"])
    counters.turns.patience.update(a=1.0, b=1.0, long=1.0)
    counters.turns.ran(["a", "b", "long"], 0.0)
    assert scheduler._sit_out(0.0) == {}  # nothing urgent: the library's FIFO as it is
    counters.urgent.add("vip")
    assert scheduler._sit_out(0.0) == {"a": decoding} and list(scheduler.active_requests) == ["b", "long"]
    scheduler.active_requests.update({"a": decoding, "vip": decoding})  # put back; the urgent one started
    del scheduler.waiting_requests["vip"]
    scheduler.waiting_requests_order.clear()
    counters.turns.ran(["b", "long", "vip"], 0.1)
    assert scheduler._sit_out(0.2) == {"b": decoding}  # in turn: a sat the last step out
    scheduler.active_requests["b"] = decoding
    # A normal newcomer may start in this step (no urgent one waits): its prompt has a row before their tokens.
    scheduler.waiting_requests_order.append("new")
    assert scheduler._sit_out(0.3) == {"a": decoding, "b": decoding}
    assert counters.turns.sat_out == 4
