"""The llama.cpp engine's prefills (``LlamaCppEngine.prefill``, behind ``POST /prefill``) with the real bundled model,
on one sequence (``TTFT_MAX_CONCURRENCY=1``): the request that follows a prefill finds its prompt as
``cached_tokens`` and answers as without it; a newer prefill of the same owner stops the older, and a cancelled one
stops; a prefill that holds the only sequence gives it up to a request, and computes on once it is free.

Observed through the engine's state (``state()``, the schedule's sequences), never through timing. A hold (what a
prefill asks between steps) freezes a prefill where a test needs it still.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from tests.support.engines import collect, llama_cpp_or_skip
from ttft_sse.engine.base import ChatMessage, KeepsWarm, Prompt, SamplingParams
from ttft_sse.engine.llamacpp.engine import LlamaCppEngine
from ttft_sse.engine.llamacpp.schedule import Sequence
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

QUESTION = "Can I take my bicycle on the night train?"


def system(topic: str) -> ChatMessage:
    """A system prompt of about 200 tokens, unique to ``topic``: computed over several steps."""
    rule = "desk: answer briefly, kindly and only about facts."
    return ChatMessage("system", " ".join(f"Rule {i} of the {topic} {rule}" for i in range(14)))


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[LlamaCppEngine]:
    llama_cpp_or_skip()
    engine = LlamaCppEngine(settings.replace(max_concurrency=1))
    engine.load(StageClock())
    assert engine.runner.shape.sequences == 1
    yield engine
    asyncio.run(engine.close())


async def until(check: Callable[[], bool], timeout: float = 60) -> None:
    """Poll ``check`` while the event loop runs (the prefill's task must run to post it), bounded."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def prefill_of(engine: LlamaCppEngine, prompt: Prompt) -> Sequence | None:
    """The loop's prefill of ``prompt``, computing or waiting for a sequence, if there is one."""
    schedule = engine._schedule
    assert schedule is not None
    found = [s for s in [*schedule.running.values(), *schedule.prefills] if s.background]
    return next((s for s in found if s.prompt == prompt.token_ids), None)


def held_after_a_step(engine: LlamaCppEngine, prompt: Prompt, released: threading.Event) -> Callable[[], bool]:
    """A hold that holds the prefill of ``prompt`` still once it has computed a step, until ``released``."""

    def hold() -> bool:
        prefill = prefill_of(engine, prompt)
        return not released.is_set() and prefill is not None and prefill.rows > 0

    return hold


async def test_a_prefill_then_the_request_finds_the_prefix_cached_and_answers_the_same(
    engine: LlamaCppEngine, settings: Settings
) -> None:
    typed = [system("lighthouse"), ChatMessage("user", QUESTION[:-12])]  # the user is still typing
    prefix = engine.prepare_prefix(prompt=None, messages=typed, raw=False)
    full = engine.prepare(prompt=None, messages=[system("lighthouse"), ChatMessage("user", QUESTION)], raw=False)
    assert full.token_ids[: prefix.n_tokens] == prefix.token_ids
    alone_text, alone = await collect(engine.stream(full, SamplingParams(max_tokens=24, cache_salt="alone")))
    assert alone.usage.cached_tokens == 0

    assert await engine.prefill(prefix, cache_salt="typed", owner="tab") == prefix.n_tokens
    assert engine.cached(full, "typed") == prefix.n_tokens
    text, finished = await collect(engine.stream(full, SamplingParams(max_tokens=24, cache_salt="typed")))
    assert finished.usage.cached_tokens == prefix.n_tokens
    assert text == alone_text
    assert replace(finished.usage, cached_tokens=0) == alone.usage
    assert await engine.prefill(prefix, cache_salt="typed") == 0  # the request's sequence holds it now
    # Without prefix reuse there is nowhere to keep it: nothing is computed.
    assert await LlamaCppEngine(settings.replace(prefix_cache=False)).prefill(prefix) == 0


async def test_a_newer_prefill_of_the_same_owner_stops_the_older_and_a_cancelled_one_stops(
    engine: LlamaCppEngine, settings: Settings
) -> None:
    older = engine.prepare(prompt=None, messages=[system("tickets")], raw=False)
    newer = engine.prepare(prompt=None, messages=[system("tickets"), ChatMessage("user", QUESTION)], raw=False)
    released = threading.Event()  # never set: the older one would compute no further
    hold = held_after_a_step(engine, older, released)
    first = asyncio.create_task(engine.prefill(older, cache_salt="owned", owner="tab", hold=hold))
    await until(lambda: (prefill := prefill_of(engine, older)) is not None and prefill.rows > 0)
    assert not first.done()

    computed = await engine.prefill(newer, cache_salt="owned", owner="tab")
    assert await asyncio.wait_for(first, 60) == settings.prefill_chunk_tokens  # where it was held, it stopped
    assert computed == newer.n_tokens - settings.prefill_chunk_tokens  # it went on from the older one's cells
    assert engine.cached(newer, "owned") == newer.n_tokens
    assert engine.state().prefills == 0

    # Cancelled (its caller superseded it, or the server drains): it leaves the loop.
    held = asyncio.create_task(engine.prefill(older, cache_salt="cancelled", hold=lambda: True))
    await until(lambda: engine.state().prefills == 1)
    held.cancel()
    await until(lambda: engine.state().prefills == 0)
    assert held.cancelled()


async def test_a_prefill_gives_the_only_sequence_up_to_a_request_and_computes_on_once_it_is_free(
    engine: LlamaCppEngine, settings: Settings
) -> None:
    prompt = engine.prepare(prompt=None, messages=[system("luggage")], raw=False)
    question = engine.prepare(prompt=QUESTION, messages=None, raw=False)
    params = SamplingParams(max_tokens=16, cache_salt="other")
    expected, _ = await collect(engine.stream(question, params))
    released = threading.Event()
    hold = held_after_a_step(engine, prompt, released)
    task = asyncio.create_task(engine.prefill(prompt, cache_salt="mine", hold=hold))
    await until(lambda: (prefill := prefill_of(engine, prompt)) is not None and prefill.seq == 0 and prefill.rows > 0)

    # The request needs the only sequence, which the prefill holds: it gets it, and answers as before.
    text, _ = await asyncio.wait_for(collect(engine.stream(question, params)), 120)
    assert text == expected
    prefill = prefill_of(engine, prompt)
    assert prefill is not None and prefill.seq == -1 and not task.done()  # waiting for a sequence again

    released.set()
    # The request's cells took its sequence (another salt): it computes its prompt again, whole.
    assert await asyncio.wait_for(task, 120) == settings.prefill_chunk_tokens + prompt.n_tokens
    assert engine.cached(prompt, "mine") == prompt.n_tokens


def test_a_warm_prompt_keeps_its_sequence_for_good_past_the_prefills_keep(settings: Settings) -> None:
    """Two sequences, prefills kept 0 s: the warm prompt's sequence is not given to the unrelated requests after it
    (they take the other one, though it holds their own earlier prompt), and the question behind it finds it whole.
    One warm prompt is the bound with two sequences: a second is computed as a prefill, not kept (0)."""
    llama_cpp_or_skip()
    engine = LlamaCppEngine(settings.replace(max_concurrency=2, prefill_keep_seconds=0))
    engine.load(StageClock())

    async def run() -> None:
        warm = engine.prepare_prefix(prompt=None, messages=[system("harbour")], raw=False)
        assert isinstance(engine, KeepsWarm)
        assert await engine.warm(warm) == warm.n_tokens
        for topic in ("museum", "bakery", "station"):
            other = engine.prepare(prompt=None, messages=[system(topic), ChatMessage("user", QUESTION)], raw=False)
            _, finished = await collect(engine.stream(other, SamplingParams(2)))
            assert finished.usage.cached_tokens < 16, topic  # the template's start at most: not the warm sequence
        asked = engine.prepare(prompt=None, messages=[system("harbour"), ChatMessage("user", QUESTION)], raw=False)
        assert asked.token_ids[: warm.n_tokens] == warm.token_ids
        _, finished = await collect(engine.stream(asked, SamplingParams(2)))
        assert finished.usage.cached_tokens == warm.n_tokens
        second = engine.prepare_prefix(prompt=None, messages=[system("orchard")], raw=False)
        assert await engine.warm(second) == 0

    try:
        asyncio.run(run())
    finally:
        asyncio.run(engine.close())
