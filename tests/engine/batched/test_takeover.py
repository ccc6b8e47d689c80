"""A request that arrives while its prompt's prefill still computes takes the prefill over
(engine/library/scheduler.py): the prefill ends where it got to, the request finds everything it computed in the
cache, computes the rest itself, and answers as without the prefill. Observed through the engine's state, never
through timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, eventually_idle, prompt_of
from ttft_sse.engine.base import Prompt, SamplingParams
from ttft_sse.engine.batched.engine import BLOCK_TOKENS, BatchedEngine
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

SYSTEM = " ".join(f"Rule {i} of the ferry desk: answer briefly, kindly and only about timetables." for i in range(60))
QUESTION = "When does the first ferry leave on Sundays?"


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[BatchedEngine]:
    engine = BatchedEngine(settings)
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


async def until(check: object, what: str) -> None:
    for _ in range(1200):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_request_arriving_mid_prefill_takes_it_over_and_answers_as_without_it(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    """Beside it, a prefill of another prompt is not taken over: it computes its whole prompt."""
    full = prompt_of(engine, QUESTION, SYSTEM)
    typed = Prompt(text="", token_ids=full.token_ids[:-6])  # what the prefill had: the question less its end
    other = Prompt(text="", token_ids=prompt_of(engine, QUESTION, "Other desk. " + SYSTEM).token_ids[:-6])
    assert typed.n_tokens > 800
    before, other_before = engine.cached(typed), engine.cached(other)  # the chat template's first blocks
    frozen = threading.Event()  # the prefills' hold: once set, they compute nothing more until the request comes

    with capture_logs() as logs:
        prefill = asyncio.create_task(engine.prefill(typed, hold=frozen.is_set))
        beside = asyncio.create_task(engine.prefill(other, hold=frozen.is_set))
        await until(lambda: engine.cached(typed) >= before + 64, "the prefill's first blocks")
        frozen.set()
        text, finished = await collect(engine.stream(full, SamplingParams(max_tokens=24)))
        frozen.clear()  # on a server that does not hand it over, the prefill goes on from here to its end
        computed = await asyncio.wait_for(prefill, 120)
        computed_beside = await asyncio.wait_for(beside, 120)

    assert 64 <= computed < typed.n_tokens - before  # it ended where it got to
    assert finished.usage.cached_tokens >= (before + computed) // BLOCK_TOKENS * BLOCK_TOKENS  # all of it found
    assert [e["cached"] for e in logs if e["event"] == "prefill_taken_over"] == [before + computed]
    want_text, want = await collect(reference.stream(prompt_of(reference, QUESTION, SYSTEM), SamplingParams(24)))
    assert (text, finished.finish_reason) == (want_text, want.finish_reason)
    assert computed_beside == other.n_tokens - other_before
    assert engine.cached(other) == (other.n_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    await eventually_idle(engine)  # both prefills left the library
