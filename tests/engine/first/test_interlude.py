"""Interludes (engine/first/interlude.py): first tokens computed between two layers of the batch's step in flight,
whose
KV the batch then reuses from its paged cache, with the single engine's text either way.

Whether an interlude or the batch's own step gives a request its first token depends on where the step in flight
is when the request arrives; the texts must not. The tests read which one did from the interlude's counters and
the prefix hits from ``stats()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager, nullcontext

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, eventually_idle, prompt_of
from tests.support.texts import QUESTIONS, STORY, SYSTEM
from ttft_sse.engine.base import Finished, Piece, SamplingParams, Usage
from ttft_sse.engine.batched.engine import BLOCK_TOKENS, BatchedEngine
from ttft_sse.engine.first import interlude
from ttft_sse.engine.first.interlude import Interlude
from ttft_sse.engine.library import stack
from ttft_sse.engine.library.in_place import InPlace
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

NEWCOMERS = 6
"""Requests sent, one after another, to a batch that decodes a long answer: each arrives during a step, and an
interlude computes it unless the next step was being prepared at that instant (then the step does)."""


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[BatchedEngine]:
    engine = BatchedEngine(settings.replace(prefill_between_layers=True))
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


def answer(result: tuple[str, Finished]) -> tuple[str, str, Usage]:
    text, finished = result
    # Cached tokens are the engine's own (the single engine keeps no prefix cache): the answer is the rest.
    return text, finished.finish_reason, dataclasses.replace(finished.usage, cached_tokens=0)


def served(engine: BatchedEngine) -> int:
    assert engine.interludes is not None
    return engine.interludes.served


@asynccontextmanager
async def busy(engine: BatchedEngine) -> AsyncIterator[None]:
    """The batch decodes a long greedy answer for as long as the block runs."""
    async with aclosing(engine.stream(prompt_of(engine, STORY), SamplingParams(max_tokens=400))) as story:
        assert isinstance(await anext(story), Piece)
        yield


async def newcomers(
    engine: BatchedEngine, reference: SingleEngine, label: str, *, between_steps_only: bool = False
) -> int:
    """Newcomers sent one after another to a busy batch: each gets the single engine's text, and each whose first
    token an interlude computed is then a prefix hit in the batch. Returns how many an interlude computed."""
    params = SamplingParams(max_tokens=10)
    asks = [f"{label} {i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(NEWCOMERS)]
    want = [await collect(reference.stream(prompt_of(reference, ask, SYSTEM), params)) for ask in asks]
    await collect(engine.stream(prompt_of(engine, "Hi", SYSTEM), SamplingParams(max_tokens=1)))  # the prefix known
    by_interlude = 0
    with capture_logs() as logs:
        async with busy(engine):
            with steps_only(engine) if between_steps_only else nullcontext():
                for ask, expected in zip(asks, want, strict=True):
                    prompt = prompt_of(engine, ask, SYSTEM)
                    before, hits = served(engine), engine.stats().prefix_hit_tokens
                    assert answer(await collect(engine.stream(prompt, params))) == answer(expected)
                    if served(engine) > before:
                        by_interlude += 1
                        # The batch took the interlude's KV: it computed only the prompt's last block, 1 to 4 rows.
                        assert engine.stats().prefix_hit_tokens - hits >= prompt.n_tokens - BLOCK_TOKENS
    assert not [e for e in logs if e["event"] in ("first_token_mismatch", "interlude_failed", "generation_failed")]
    await eventually_idle(engine)
    assert (engine._claims._open, engine._claims._side) == (set(), {})
    return by_interlude


@contextmanager
def steps_only(engine: BatchedEngine) -> Iterator[None]:
    """The running batch's interludes before each layer of a step left out: only those between two steps run."""
    in_place = engine._manager.batch_processor.cache.in_place
    serve = in_place.between

    def between_steps_only(cache: InPlace) -> None:
        if sys._getframe(1).f_code.co_name == "schedule_batch":
            serve(cache)

    in_place.between = between_steps_only
    try:
        yield
    finally:
        in_place.between = serve


async def test_newcomers_at_a_busy_batch_get_the_single_engines_text_and_their_prompt_is_computed_once(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    assert await newcomers(engine, reference, "Newcomer") >= 1


@contextmanager
def recorded(engine: BatchedEngine, calls: list[tuple[int, int]], *, flag: bool = False) -> Iterator[stack.Chain]:
    """The model's layers run in one call through a wrapper that records each call's first layer and what it
    returned; with ``flag``, the interludes' flag is raised before each call from the first layer, as a newcomer that
    came during it would."""
    layers = list(engine.model.model.layers)
    chain = layers[0].chain
    assert chain is not None and all(layer.chain is chain for layer in layers)
    assert engine.interludes is not None
    waiting = engine.interludes.waiting

    def run(stack: int, start: int, *arguments: int) -> int:
        if flag and start == 0:
            waiting.value = 1
        status = int(chain.run(stack, start, *arguments))
        calls.append((start, status))
        return status

    recording = stack.Chain(chain.layers, chain.addresses, run)
    for layer in layers:
        layer.chain = recording
    try:
        yield chain
    finally:
        for layer in layers:
            layer.chain = chain
        waiting.value = 0


async def test_a_steps_layers_run_in_one_call_that_stops_where_a_newcomer_waits_and_goes_on_from_there(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    """Every decoder layer is fused, so a batched step's first layer runs them all in one C call (stack.run_layers).
    The interludes' flag, raised while it runs the first layer, stops it before the second: the interlude runs
    there, and the call goes on from that layer. The text is the single engine's."""
    params = SamplingParams(max_tokens=12)
    want = answer(await collect(reference.stream(prompt_of(reference, STORY, SYSTEM), params)))
    in_place = engine._manager.batch_processor.cache.in_place
    serve = in_place.between
    flags: list[int] = []

    def between(cache: InPlace) -> None:
        if sys._getframe(1).f_code.co_name == "run_layers":  # not between two steps (schedule_batch)
            flags.append(in_place.waiting.value)
        in_place.waiting.value = 0  # as the interlude's serving a newcomer would
        serve(cache)

    calls: list[tuple[int, int]] = []
    in_place.between = between
    try:
        with recorded(engine, calls, flag=True) as chain:
            assert answer(await collect(engine.stream(prompt_of(engine, STORY, SYSTEM), params))) == want
    finally:
        in_place.between = serve
    count = len(chain.layers)
    # Each step: a call from the first layer that stops before the second, then one from the second to the end.
    assert len(calls) >= 2 * params.max_tokens - 2 and len(calls) % 2 == 0
    assert calls == [(0, 1), (1, count)] * (len(calls) // 2)
    # Within the steps, the interlude ran before each one's first layer (no flag), and where the call stopped.
    assert flags == [0, 1] * (len(calls) // 2)


async def test_in_one_call_newcomers_get_the_single_engines_text_and_no_layer_is_called_on_its_own(
    engine: BatchedEngine, reference: SingleEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With real newcomers at a busy batch: the steps and the interludes' own passes run their layers in one call,
    never one layer alone (stack.whole), and where a newcomer stopped a call it went on from that layer."""
    alone: list[int] = []
    whole = stack.whole
    monkeypatch.setattr(stack, "whole", lambda *arguments: alone.append(1) or whole(*arguments))
    calls: list[tuple[int, int]] = []
    with recorded(engine, calls) as chain:
        assert await newcomers(engine, reference, "Stopped") >= 1
    count = len(chain.layers)
    assert calls and alone == []
    assert all(0 <= start < status <= count for start, status in calls)
    stopped = [i for i, (_, status) in enumerate(calls) if status < count]
    assert all(any(start == calls[i][1] for start, _ in calls[i + 1 :]) for i in stopped)


async def test_a_newcomer_after_a_steps_last_layer_gets_its_first_token_between_two_steps(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    """Interludes run before each layer of a step, and before the next step is scheduled: a newcomer that comes
    after a step's last layer (its output layer, sampling, the next step's preparation) is computed there, not in
    the next step beside the streams' rows. Here the layers' interludes are left out, so that every newcomer comes
    after the last one; each is computed between two steps unless it came while the next one was being scheduled
    (5 of 6 here; none without them)."""
    assert await newcomers(engine, reference, "Late", between_steps_only=True) >= NEWCOMERS // 2


async def test_a_one_token_answer_from_an_interlude_ends_the_request(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    params = SamplingParams(max_tokens=1)
    before = served(engine)
    async with busy(engine):
        for i in range(NEWCOMERS):
            ask = f"Briefly ({i}): {QUESTIONS[i % len(QUESTIONS)]}"
            want = answer(await collect(reference.stream(prompt_of(reference, ask), params)))
            assert want[1] == "length"
            assert answer(await collect(engine.stream(prompt_of(engine, ask), params))) == want
    assert served(engine) > before
    await eventually_idle(engine)


async def test_sampled_newcomers_are_drawn_in_an_interlude_and_the_batch_goes_on_from_that_token(
    engine: BatchedEngine,
) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.95)
    before = served(engine)
    with capture_logs() as logs:
        async with busy(engine):
            ends = []
            for i in range(NEWCOMERS):
                _, finished = await collect(engine.stream(prompt_of(engine, f"Sampled ({i}): {QUESTIONS[i]}"), params))
                ends.append((finished.finish_reason, finished.usage.completion_tokens))
    # Every answer whole: its 4 tokens, or up to 4 ending on the end-of-text token (unseeded sampling).
    assert all(end == ("length", 4) or (end[0] == "stop" and 1 <= end[1] <= 4) for end in ends), ends
    assert served(engine) > before
    assert not [e for e in logs if e["event"] in ("first_token_mismatch", "interlude_failed")]
    await eventually_idle(engine)


async def test_a_prompt_of_many_new_tokens_is_left_to_the_batch(engine: BatchedEngine, reference: SingleEngine) -> None:
    params = SamplingParams(max_tokens=6)
    ask = ("Summarise this.", f"A case of its own. {SYSTEM} {SYSTEM}")  # ~200 tokens new to the cache
    assert prompt_of(engine, *ask).n_tokens > interlude.NEW_TOKENS + 40
    want = answer(await collect(reference.stream(prompt_of(reference, *ask), params)))
    interludes = engine.interludes
    assert interludes is not None
    before, declined = interludes.served, interludes.declined
    async with busy(engine):
        assert answer(await collect(engine.stream(prompt_of(engine, *ask), params))) == want
    assert interludes.served == before
    assert interludes.declined in (declined, declined + 1)  # declined, unless the next step took it first


async def test_a_failing_interlude_leaves_the_batch_to_answer_and_says_so(
    settings: Settings, reference: SingleEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> int:
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(interlude, "first_tokens", broken)
    own = BatchedEngine(settings.replace(prefill_between_layers=True))
    own.load(StageClock())
    try:
        params = SamplingParams(max_tokens=8)
        with capture_logs() as logs:
            async with busy(own):
                for i in range(NEWCOMERS):
                    ask = QUESTIONS[i]
                    want = answer(await collect(reference.stream(prompt_of(reference, ask), params)))
                    assert answer(await collect(own.stream(prompt_of(own, ask), params))) == want
        failures = [e for e in logs if e["event"] == "interlude_failed"]
        assert len(failures) == 1 and "broken on purpose" in failures[0]["error"]
        assert (own.stats().interludes, own.info.beside_batch) == ("failed", "interludes failed")
    finally:
        await own.close()


async def test_waiting_prompts_are_answered_none_when_nobody_wants_them_or_the_engine_stops() -> None:
    side = Interlude(model=None)
    wanted = {"a": True, "b": False}
    assert side.waiting.value == 0
    a = asyncio.ensure_future(side.first_token((1, 2, 3), lambda: wanted["a"]))
    b = asyncio.ensure_future(side.first_token((4, 5, 6), lambda: wanted["b"]))
    await asyncio.sleep(0)
    assert side.waiting.value == 2  # what the decoder layers in one call read: stop, a newcomer waits
    side.sweep()
    assert await asyncio.wait_for(b, 5) is None
    assert not a.done() and side.waiting.value == 1
    side.stop()
    assert await asyncio.wait_for(a, 5) is None
    assert side.waiting.value == 0
    assert await side.first_token((7,), lambda: True) is None  # stopped: not even queued
    assert side.state == "stopped" and side.waiting.value == 0


async def test_where_interludes_run_the_prefill_process_does_not(settings: Settings) -> None:
    both = BatchedEngine(settings.replace(prefill_process=True, kernel_helpers=0))  # interludes by default
    with capture_logs() as logs:
        both.load(StageClock())
    try:
        assert both.interludes is not None and both.prefill_process is None
        assert (both.stats().interludes, both.stats().prefill) == ("ready", "off")
        assert both.info.beside_batch == "interludes ready"
        assert [e["event"] for e in logs if "interludes" in e["event"] or "prefill_process" in e["event"]] == [
            "interludes_on"
        ]
    finally:
        await both.close()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"fused_layers": False}, "they need the decoder layers in C (TTFT_FUSED_LAYERS)"),
        ({"prefix_cache": False}, "they hand their KV to the batch through the prefix cache (TTFT_PREFIX_CACHE)"),
        (
            {"paged_attention": False},
            "they need the block kernel and the C attention (a GGUF model, on CPU, in fp32)",
        ),
    ],
    ids=["unfused", "no-prefix-cache", "masked-attention"],
)
async def test_no_interludes_where_they_cannot_run_and_the_log_says_why(
    settings: Settings, changes: dict[str, bool], reason: str
) -> None:
    engine = BatchedEngine(settings.replace(**changes))
    with capture_logs() as logs:
        engine.load(StageClock())
    try:
        assert engine.interludes is None and engine.stats().interludes == "off"
        assert engine.info.beside_batch == "none"  # the suite's settings: no prefill process
        assert [e["reason"] for e in logs if e["event"] == "interludes_off"] == [reason]
    finally:
        await engine.close()


async def test_an_urgent_prompt_is_computed_at_the_next_layer_alone_and_the_others_at_the_layer_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = Interlude(model=None)
    computed: list[list[tuple[int, ...]]] = []

    def compute(
        in_place: object, asks: list[tuple[tuple[int, ...], float, float]], *salted: object
    ) -> list[int | None]:
        computed.append([ask[0] for ask in asks])
        return [ask[0][0] for ask in asks]

    monkeypatch.setattr(side, "_compute", compute)
    first = asyncio.ensure_future(side.first_token((1,), lambda: True))
    second = asyncio.ensure_future(side.first_token((2,), lambda: True))
    vip = asyncio.ensure_future(side.first_token((3,), lambda: True, urgent=True))
    await asyncio.sleep(0)
    side.serve(object())  # a layer: the urgent prompt alone; the others still wait, in their order
    assert computed == [[(3,)]] and side.waiting.value == 2
    assert await asyncio.wait_for(vip, 5) == 3 and not first.done()
    side.serve(object())  # the next layer: the rest together
    assert computed == [[(3,)], [(1,), (2,)]] and side.waiting.value == 0
    assert (await first, await second) == (1, 2)
