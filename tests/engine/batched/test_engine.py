"""The batched engine with the real bundled model, against the single-request engine as the reference.

Everything is observed through the engine's state (``stats()``, ``batch_log``), never through timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from contextlib import aclosing
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, prompt_of
from tests.support.servers import eventually
from tests.support.texts import STORY
from ttft_sse.engine.base import Finished, Piece, SamplingParams
from ttft_sse.engine.batched.engine import BLOCK_TOKENS, BatchedEngine
from ttft_sse.engine.kernels import argmax, attention
from ttft_sse.engine.library import grouped, stack
from ttft_sse.engine.loaded import CacheJanitor
from ttft_sse.engine.single import SingleEngine
from ttft_sse.errors import EngineError
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

QUESTION = "What is the capital of France?"
LONG = "List the numbers from 1 to 100, separated by commas."  # greedy: longer than 64 tokens
SYSTEM = (
    "You are a meticulous assistant for a railway company. You answer questions about timetables, tickets, "
    "luggage, bicycles, pets and accessibility. You keep every answer short, you never invent a train that does "
    "not exist, and when you do not know something you say so and point the traveller to the help desk."
)


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[BatchedEngine]:
    engine = BatchedEngine(settings)
    clock = StageClock()
    engine.load(clock)
    assert "batching_ms" in clock.as_dict()
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def gathers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry for every ``torch.index_select`` call while the test runs: the library's gathers of a step's keys
    and values out of its paged cache."""
    import torch

    calls: list[int] = []
    real = torch.index_select

    def gather(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "index_select", gather)
    return calls


def outcome(text: str, finished: Finished) -> tuple[str, str, int]:
    return text, finished.finish_reason, finished.usage.completion_tokens


async def settle(engine: BatchedEngine) -> None:
    """Run one tiny request to its end. The library reads new requests and cancellations together at the start of
    a step, so once this one has finished, every cancellation sent before it has been applied."""
    await collect(engine.stream(prompt_of(engine, "Hi"), SamplingParams(max_tokens=1)))


@pytest.mark.parametrize("way", ["paged", "grouped-kv", "repeated-kv"])
async def test_concurrent_greedy_requests_give_the_single_engines_text(
    engine: BatchedEngine, reference: SingleEngine, way: str, monkeypatch: pytest.MonkeyPatch, gathers: list[int]
) -> None:
    # paged (the default on CPU): each request's rows attend to its own keys, read from the KV cache in place
    # (engine/kernels/attention.c); grouped-kv: the batch's one masked SDPA over the gathered keys, grouped KV heads
    # read in place (engine/library/grouped.py); repeated-kv: as transformers does it, each KV head copied for its 3
    # query heads.
    import torch

    paged = [m for m in engine.model.modules() if getattr(m, attention.PAGED, None) is not None]
    marked = [m for m in engine.model.modules() if getattr(m, grouped.MARK, False)]
    assert len(paged) == len(marked) == 30
    for module in paged if way != "paged" else []:
        monkeypatch.delattr(module, attention.PAGED)
    for module in marked if way == "repeated-kv" else []:
        monkeypatch.delattr(module, grouped.MARK)
    heads: set[int] = set()  # KV heads SDPA is given in the batch's steps of more than one row
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        # A step of one row has its 9 query heads folded into 3 rows per KV head (transformers' own way either way).
        if query.shape[1] == 9 and query.shape[2] > 1:
            heads.add(key.shape[1])
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    # Steps whose decoder layers all ran in one C call (engine/library/stack.py's run_layers), and layers run alone.
    stacked: list[int] = []
    alone: list[int] = []
    run_layers, whole = stack.run_layers, stack.whole

    def in_one_call(*arguments: Any, between: bool, **named: Any) -> Any:
        stacked.extend([1] if between else [])  # a step's, not an interlude's pass
        return run_layers(*arguments, between=between, **named)

    monkeypatch.setattr(stack, "run_layers", in_one_call)
    monkeypatch.setattr(stack, "whole", lambda *arguments: alone.append(1) or whole(*arguments))
    picks: list[int] = []  # rows of each step's greedy pick in C (engine/kernels/argmax.py)
    rows = argmax.Argmax.rows
    monkeypatch.setattr(
        argmax.Argmax, "rows", lambda self, scores, torch: picks.append(len(scores)) or rows(self, scores, torch)
    )
    asks = [
        (QUESTION, 32),
        ("Name three colors.", 24),
        ("Write a haiku about the sea.", 20),
        ("What is 2+2?", 16),
        ("Tell me a joke.", 28),
    ]
    before = engine.stats().steps
    got = await asyncio.gather(
        *(collect(engine.stream(prompt_of(engine, q), SamplingParams(max_tokens=n))) for q, n in asks)
    )
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)
    steps = engine.stats().steps - before
    # Every attention call of the batch went the way asked; paged, the library gathered nothing (and no prompt is
    # long enough for SDPA), and every step ran its 30 layers in one C call (engine/library/stack.py). The other ways
    # gather in engine/kernels/attention.py: the engine's cache reads in place.
    assert heads == {"paged": set(), "grouped-kv": {3}, "repeated-kv": {9}}[way]
    assert (len(stacked), alone) == ((steps if way == "paged" else 0), [])
    # Every step picked its tokens in C, one row a request that had a token to pick (torch.argmax: none).
    assert len(picks) == steps and max(picks) == len(asks) and min(picks) >= 1
    if way == "paged":
        assert gathers == []
    for (question, max_tokens), (text, finished) in zip(asks, got, strict=True):
        want_text, want = await collect(reference.stream(prompt_of(reference, question), SamplingParams(max_tokens)))
        assert outcome(text, finished) == outcome(want_text, want), question
        # Cached tokens are the batched engine's own (the single engine keeps no prefix cache).
        assert dataclasses.replace(finished.usage, cached_tokens=0) == want.usage
    assert got[0][0] == "The capital of France is Paris."
    # They shared forward passes: far fewer steps than the tokens they generated together.
    generated = sum(finished.usage.completion_tokens for _, finished in got)
    assert steps < generated / 2


async def test_a_request_arriving_while_another_decodes_joins_its_batch(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    engine.batch_log.clear()
    late: asyncio.Task[tuple[str, Finished]] | None = None
    pieces = 0
    async with aclosing(engine.stream(prompt_of(engine, LONG), SamplingParams(max_tokens=64))) as first:
        async for item in first:
            pieces += isinstance(item, Piece)
            if pieces == 3 and late is None:
                late = asyncio.create_task(collect(engine.stream(prompt_of(engine, QUESTION), SamplingParams(8))))
    assert late is not None
    text, finished = await late
    assert outcome(text, finished) == ("The capital of France is Paris.", "stop", 8)

    log = list(engine.batch_log)
    early = log[0][0]
    (joined,) = {rid for step in log for rid in step} - {early}
    with_late = [i for i, step in enumerate(log) if joined in step]
    # The late request's prefill ran in a step that also decoded the early one, the early one had decoded alone
    # before it, and went on decoding with it: one running batch, not one request after the other.
    assert all(early in log[i] for i in with_late)
    assert with_late[0] > 0 and all(step == (early,) for step in log[: with_late[0]])
    assert len(with_late) == 8  # one step per token of the late request, each shared with the early one


async def test_each_request_keeps_its_own_max_tokens_and_stop_sequences(engine: BatchedEngine) -> None:
    prompt = prompt_of(engine, QUESTION)
    short, stopped, full = await asyncio.gather(
        collect(engine.stream(prompt, SamplingParams(max_tokens=3))),
        collect(engine.stream(prompt, SamplingParams(max_tokens=32, stop=(" is",)))),
        collect(engine.stream(prompt, SamplingParams(max_tokens=32))),
    )
    assert outcome(*short) == ("The capital of", "length", 3)
    # Stopped on the token that completed the stop text, which is not returned (the single engine gives 5 too).
    assert outcome(*stopped) == ("The capital of France", "stop", 5)
    assert outcome(*full) == ("The capital of France is Paris.", "stop", 8)
    await settle(engine)
    stats = engine.stats()
    assert (stats.requests, stats.streams, stats.kv_tokens_in_use) == (0, 0, 0)


async def test_a_client_leaving_cancels_its_request_alone_and_frees_its_slot(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    # The one staying writes to its limit (greedy), far past the leaver's third piece: a stall of the event loop
    # cannot let it finish first. (It asked "Name three colors." before, 12 tokens: a ~9-step stall was enough.)
    want, _ = await collect(reference.stream(prompt_of(reference, STORY), SamplingParams(64)))
    engine.batch_log.clear()
    with capture_logs() as logs:
        leaving = engine.stream(prompt_of(engine, LONG), SamplingParams(max_tokens=200))
        staying = asyncio.create_task(collect(engine.stream(prompt_of(engine, STORY), SamplingParams(64))))
        async with aclosing(leaving) as items:
            async for item in items:
                assert isinstance(item, Piece)
                if item.index == 2:
                    break
        assert engine.active == 1  # the one still reading
        text, finished = await staying
    assert text == want and finished.usage.completion_tokens == 64
    cancelled = [e for e in logs if e["event"] == "generation_cancelled"]
    assert len(cancelled) == 1 and 3 <= cancelled[0]["completion_tokens"] < 50

    await settle(engine)
    stats = engine.stats()
    # Nothing of the cancelled request is left: not in the scheduler, not holding cache, not being read.
    assert (stats.requests, stats.streams, stats.kv_tokens_in_use) == (0, 0, 0)
    assert engine.active == 0


async def test_a_failure_in_the_batching_loop_reaches_every_request_as_engine_error(engine: BatchedEngine) -> None:
    calls = {"n": 0}

    def explode(module: Any, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def doomed(question: str) -> BaseException:
        with pytest.raises(EngineError) as info:
            await collect(engine.stream(prompt_of(engine, question), SamplingParams(max_tokens=32)))
        return info.value

    handle = engine._single.model.register_forward_hook(explode)
    try:
        errors = await asyncio.gather(doomed(QUESTION), doomed("Name three colors."))
    finally:
        handle.remove()
    for error in errors:
        assert isinstance(error, EngineError)
        assert error.message.startswith("generation failed")
        assert "illegal memory" not in error.message  # internals stay in the log
    assert engine.active == 0

    # The loop died with the error; the next request starts it again and is served normally.
    text, finished = await collect(engine.stream(prompt_of(engine, QUESTION), SamplingParams(max_tokens=32)))
    assert outcome(text, finished) == ("The capital of France is Paris.", "stop", 8)
    assert engine.stats().running


async def test_a_shared_prefix_is_reused_and_gives_the_same_text(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    questions = ["Can I bring my bicycle on the train?", "Is my dog allowed on board?"]
    first, second = (prompt_of(engine, q, SYSTEM) for q in questions)
    results = [await collect(engine.stream(first, SamplingParams(24)))]
    before = engine.stats()
    results.append(await collect(engine.stream(second, SamplingParams(24))))  # finds the first one's blocks
    after = engine.stats()
    for question, (text, finished) in zip(questions, results, strict=True):
        want_text, want = await collect(reference.stream(prompt_of(reference, question, SYSTEM), SamplingParams(24)))
        assert outcome(text, finished) == outcome(want_text, want)

    common = next(i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids, strict=False)) if a != b)
    assert common > 64  # the system prompt and the template around it
    assert after.prefix_hits - before.prefix_hits == 1
    # Every whole block of the common part was shared: only the rest of the second prompt was computed.
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == common // BLOCK_TOKENS * BLOCK_TOKENS
    assert after.prompt_tokens - before.prompt_tokens == second.n_tokens
    assert after.kv_tokens_cached > 0


async def test_batched_generations_count_towards_the_cuda_cache_janitor_and_it_empties_off_the_loop(
    engine: BatchedEngine,
) -> None:
    calls: list[str] = []
    saved = engine.janitor
    engine._loaded.janitor = CacheJanitor(2, lambda: calls.append(threading.current_thread().name))  # as on CUDA
    try:
        await collect(engine.stream(prompt_of(engine, QUESTION), SamplingParams(4)))
        assert (engine.janitor.generations, calls) == (1, [])
        async with aclosing(engine.stream(prompt_of(engine, LONG), SamplingParams(64))) as items:
            await anext(items)  # a client that leaves after its first piece counts too: the 2nd generation
        assert engine.janitor.generations == 2
        # The cache is emptied in a worker thread: wait for it (a condition, not a speed), off the event loop.
        await asyncio.to_thread(eventually, lambda: bool(calls), 5)
        assert len(calls) == 1 and calls[0] != threading.current_thread().name
        assert engine.janitor.emptied == 1
    finally:
        engine._loaded.janitor = saved
    await settle(engine)


async def test_sampled_requests_without_a_seed_share_the_batch_with_greedy_ones(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    engine.batch_log.clear()
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9)
    results = await asyncio.gather(
        collect(engine.stream(prompt_of(engine, QUESTION), SamplingParams(8))),
        collect(engine.stream(prompt_of(engine, "Write a poem about the sea."), sampled)),
        collect(engine.stream(prompt_of(engine, "Write a poem about the sea."), sampled)),
    )
    (greedy, greedy_end), *draws = results
    assert outcome(greedy, greedy_end) == ("The capital of France is Paris.", "stop", 8)  # still the argmax
    for text, finished in draws:
        assert text and finished.usage.completion_tokens <= 16
    assert draws[0][0] != draws[1][0]  # two draws of 16 tokens from one prompt (equal: a chance below 1e-6)
    # One running batch: the three requests shared steps. (Not necessarily the first: the library's loop thread may
    # take a step before the third request is added, if this thread is preempted between the adds.)
    assert any(len(step) == 3 for step in engine.batch_log)


async def test_sampled_requests_run_on_the_single_engine_with_their_own_seed(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=7)
    steps = engine.stats().steps
    text, _ = await collect(engine.stream(prompt_of(engine, "Write a word."), params))
    assert engine.stats().steps == steps  # no batched step ran
    want, _ = await collect(reference.stream(prompt_of(reference, "Write a word."), params))
    assert text == want


async def test_a_seeded_request_while_the_batch_decodes_gives_the_text_it_gives_alone(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    # The batch's steps once told the model's config that attention was not causal for as long as each step ran: a
    # seeded prompt prefilled meanwhile, on the single engine in another thread, attended to its later tokens too.
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=7)
    asked = "Explain in detail how a steam engine works."
    want, _ = await collect(reference.stream(prompt_of(reference, asked), params))
    async with aclosing(engine.stream(prompt_of(engine, STORY), SamplingParams(max_tokens=400))) as story:
        await anext(story)  # the batch decodes from here on, a step every few ms
        steps = engine.stats().steps
        text, _ = await collect(engine.stream(prompt_of(engine, asked), params))
        assert engine.stats().steps > steps  # it ran beside the batch's steps
    assert text == want
    await settle(engine)


async def test_a_request_too_long_for_the_shared_cache_runs_on_the_single_engine(settings: Settings) -> None:
    small = BatchedEngine(settings.replace(kv_cache_tokens=64))
    small.load(StageClock())
    try:
        prompt = prompt_of(small, QUESTION)  # 37 tokens + 32 to generate: more than 64 - one block
        text, _ = await collect(small.stream(prompt, SamplingParams(max_tokens=32)))
        assert text == "The capital of France is Paris."
        assert small.stats().steps == 0
        text, _ = await collect(small.stream(prompt, SamplingParams(max_tokens=8)))
        assert text == "The capital of France is Paris." and small.stats().steps == 8
    finally:
        await small.close()


async def test_with_paged_attention_off_the_library_gathers_the_keys_and_the_text_is_the_same(
    settings: Settings, reference: SingleEngine, gathers: list[int]
) -> None:
    own = BatchedEngine(settings.replace(paged_attention=False))
    own.load(StageClock())
    try:
        assert not any(hasattr(m, attention.PAGED) for m in own.model.modules())
        gathers.clear()
        got = await collect(own.stream(prompt_of(own, QUESTION), SamplingParams(max_tokens=12)))
        # Keys and values, in every layer, in every step after the prompt's (a new engine: nothing to read then).
        assert len(gathers) == 2 * 30 * (got[1].usage.completion_tokens - 1)
        want = await collect(reference.stream(prompt_of(reference, QUESTION), SamplingParams(max_tokens=12)))
        assert outcome(*got) == outcome(*want)
    finally:
        await own.close()


@pytest.mark.parametrize("activations", ["fp32", "int8"])
async def test_a_requests_text_depends_neither_on_its_batch_nor_on_the_engine(
    settings: Settings, activations: str
) -> None:
    # Every layer computes a request's rows from its own rows alone (the block kernel's linear layers, attention
    # request by request), and the single-request engine attends with the same C function. So even int8 rows, whose
    # steps of max|x| / 127 turn fp32 roundings into other tokens, give a request the same text alone, among others
    # and on the single engine (with the masked attention, 3 of 11 prompts kept theirs among others, 5 of 11 on
    # the single engine).
    own = BatchedEngine(settings.replace(gguf_activations=activations))
    own.load(StageClock())
    try:
        if own.info.weights != ("gguf-blocks-int8" if activations == "int8" else "gguf-blocks"):
            pytest.skip(f"the block kernel with {activations} rows does not run on this CPU")
        asks = [QUESTION, "Name three colors.", "Why is the sky blue?", "Write a haiku about the sea.", "What is 2+2?"]
        params = SamplingParams(max_tokens=24)
        alone = [await collect(own.stream(prompt_of(own, ask), params)) for ask in asks]
        together = await asyncio.gather(*(collect(own.stream(prompt_of(own, ask), params)) for ask in asks))
        single = [await collect(own._single.stream(prompt_of(own, ask), params)) for ask in asks]
        want = [outcome(*got) for got in alone]
        assert [outcome(*got) for got in together] == want
        assert [outcome(*got) for got in single] == want
    finally:
        await own.close()


async def test_close_ends_running_generations_and_stops_the_loops_thread(settings: Settings) -> None:
    before = set(_loop_threads())
    own = BatchedEngine(settings)
    own.load(StageClock())
    (thread,) = set(_loop_threads()) - before
    assert thread.daemon  # a process whose close() never ran can still exit
    items: list[Piece | Finished] = []
    async with aclosing(own.stream(prompt_of(own, LONG), SamplingParams(max_tokens=200))) as stream:
        async for item in stream:
            items.append(item)
            if len(items) == 2:
                await own.close()
    # The stream ended without a result (the generation layer reports the cut), and the loop's thread is gone.
    assert all(isinstance(i, Piece) for i in items)
    assert own.active == 0
    assert not own.stats().running and not thread.is_alive()
    with pytest.raises(EngineError, match="not running"):
        await collect(own.stream(prompt_of(own, QUESTION), SamplingParams(max_tokens=4)))


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "_run_generation_loop" in t.name]
