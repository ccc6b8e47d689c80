"""The engine's modes with the real bundled model (``TTFT_DEGRADE=int8``; engine/modes.py): switched at run
time, int8 answers are the int8 engine's and normal ones the fp32 engine's, exactly, and each answer says whether int8
rows computed any of it.

The references: the single engine in fp32 (conftest's ``reference``), and a batched engine started with
``TTFT_GGUF_ACTIVATIONS=int8``, whose texts are the int8 single engine's (test_engine.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing

import pytest

from tests.support.engines import collect, eventually_idle, prompt_of
from tests.support.texts import QUESTIONS, STORY, SYSTEM
from ttft_sse.engine.base import Finished, Piece, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.kernels import kernel
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.library.salts import keep_apart
from ttft_sse.engine.modes import Modes
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

ASKS = QUESTIONS[:4]
PARAMS = SamplingParams(max_tokens=24)
LONG = "List the numbers from 1 to 100, separated by commas."  # greedy: longer than 64 tokens


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[BatchedEngine]:
    if not kernel.takes_int8(kernel.build(settings.cache_dir / KERNEL_DIR)):
        pytest.skip("the CPU has neither AVX-512 VNNI nor AVX2 with F16C: no int8 mode (test_degrade.py refuses it)")
    engine = BatchedEngine(settings.replace(degrade="int8"))
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def int8_engine(settings: Settings, engine: BatchedEngine) -> Iterator[BatchedEngine]:
    """An engine started on int8 rows: the int8 mode's reference."""
    own = BatchedEngine(settings.replace(gguf_activations="int8"))
    own.load(StageClock())
    assert own.info.weights == "gguf-blocks-int8"
    yield own
    asyncio.run(own.close())


def outcome(result: tuple[str, Finished]) -> tuple[str, str, int]:
    text, finished = result
    return text, finished.finish_reason, finished.usage.completion_tokens


async def answers(engine: BatchedEngine | SingleEngine, params: SamplingParams = PARAMS) -> list[tuple[str, Finished]]:
    return [await collect(engine.stream(prompt_of(engine, ask, SYSTEM), params)) for ask in ASKS]


async def test_the_engine_says_its_modes_and_refuses_others(engine: BatchedEngine, reference: SingleEngine) -> None:
    assert engine.info.modes == ("normal", "int8") and engine.mode == "normal"
    assert engine.info.weights == "gguf-blocks"  # fp32 rows at start
    with pytest.raises(ValueError, match=r"^mode must be one of normal, int8, got 'fp16'$"):
        engine.set_mode("fp16")
    assert engine.mode == "normal"
    assert reference.info.modes == ("normal",)  # started without TTFT_DEGRADE
    with pytest.raises(ValueError, match="mode must be one of normal, got 'int8'"):
        reference.set_mode("int8")


async def test_int8_mode_answers_as_the_int8_engine_and_normal_mode_as_the_fp32_engine(
    engine: BatchedEngine, int8_engine: BatchedEngine, reference: SingleEngine
) -> None:
    fp32, int8 = await answers(reference), await answers(int8_engine)
    assert [outcome(a) for a in fp32] != [outcome(a) for a in int8]  # else this test could not tell them apart
    assert not any(f.degraded for _, f in fp32 + int8)  # neither engine has another mode
    for mode, want, degraded in (("normal", fp32, False), ("int8", int8, True), ("normal", fp32, False)) * 2:
        engine.set_mode(mode)
        assert engine.mode == mode
        hits = engine.stats().prefix_hits
        got = await answers(engine)
        assert [outcome(a) for a in got] == [outcome(a) for a in want], mode
        assert [f.degraded for _, f in got] == [degraded] * len(ASKS), mode
        # The system prompt's blocks are shared by the requests of one mode, never across modes (the texts say so).
        assert engine.stats().prefix_hits - hits >= len(ASKS) - 1, mode
    # Together, in int8: the same texts (rows are computed alone in either mode).
    engine.set_mode("int8")
    together = await asyncio.gather(*(collect(engine.stream(prompt_of(engine, a, SYSTEM), PARAMS)) for a in ASKS))
    assert [outcome(a) for a in together] == [outcome(a) for a in int8]
    assert all(f.degraded for _, f in together)
    engine.set_mode("normal")


async def test_seeded_and_single_engine_generations_take_the_mode_at_their_start(
    engine: BatchedEngine, int8_engine: BatchedEngine, reference: SingleEngine
) -> None:
    single = engine._single  # seeded requests and those too long for the batch's cache
    want_fp32, want_int8 = await answers(reference), await answers(int8_engine)
    engine.set_mode("int8")
    got = await answers(single)
    assert [outcome(a) for a in got] == [outcome(a) for a in want_int8]
    assert all(f.degraded for _, f in got)
    # A switch while a generation runs leaves it in the mode it started in.
    engine.set_mode("normal")
    prompt = prompt_of(single, ASKS[0], SYSTEM)
    items: list[Piece | Finished] = []
    async with aclosing(single.stream(prompt, PARAMS)) as stream:
        async for item in stream:
            items.append(item)
            if len(items) == 1:
                engine.set_mode("int8")
    engine.set_mode("normal")
    text = "".join(i.text for i in items if isinstance(i, Piece))
    assert isinstance(items[-1], Finished)
    assert (outcome((text, items[-1])), items[-1].degraded) == (outcome(want_fp32[0]), False)


async def test_threads_in_either_mode_side_by_side_keep_their_own_arithmetic(
    engine: BatchedEngine, int8_engine: BatchedEngine, reference: SingleEngine
) -> None:
    # The mode is the thread's (kernel.ROWS): the single engine's generations in int8 rows while the batching
    # thread computes fp32 rows, at once, each gives its own reference's text.
    want_fp32, want_int8 = await answers(reference), await answers(int8_engine)
    engine.set_mode("normal")
    engine._single.set_mode("int8")
    try:
        batched = [collect(engine.stream(prompt_of(engine, ask, SYSTEM), PARAMS)) for ask in ASKS]
        single = [collect(engine._single.stream(prompt_of(engine, ask, SYSTEM), PARAMS)) for ask in ASKS]
        got = await asyncio.gather(*batched, *single)
    finally:
        engine._single.set_mode("normal")
    assert [outcome(a) for a in got] == [outcome(a) for a in want_fp32 + want_int8]
    assert [f.degraded for _, f in got] == [False] * len(ASKS) + [True] * len(ASKS)


@pytest.mark.parametrize(("before", "after"), [("normal", "int8"), ("int8", "normal")])
async def test_a_switch_while_a_stream_decodes_comes_between_two_steps_and_the_stream_says_so(
    engine: BatchedEngine, int8_engine: BatchedEngine, reference: SingleEngine, before: str, after: str
) -> None:
    params = SamplingParams(max_tokens=48)
    first = reference if before == "normal" else int8_engine
    want, _ = await collect(first.stream(prompt_of(first, LONG), params))
    engine.set_mode(before)
    steps = dict(engine._modes.steps)
    items: list[Piece | Finished] = []
    async with aclosing(engine.stream(prompt_of(engine, LONG), params)) as stream:
        async for item in stream:
            items.append(item)
            if len(items) == 2:
                engine.set_mode(after)
    pieces = [i for i in items if isinstance(i, Piece)]
    finished = items[-1]
    # Never left half-way: every token came, in order, and the answer ended as asked.
    assert isinstance(finished, Finished) and [p.index for p in pieces] == list(range(len(pieces)))
    assert (finished.finish_reason, finished.usage.completion_tokens, finished.degraded) == ("length", 48, True)
    assert want.startswith(pieces[0].text + pieces[1].text)  # the steps before the switch: the first mode's
    assert engine._modes.steps[before] > steps[before] and engine._modes.steps[after] > steps[after]
    await eventually_idle(engine)
    # The request computed in both modes shared none of its blocks: the same prompt in each mode now answers as that
    # mode's reference, from the blocks its own mode computed.
    for mode, source in (("normal", reference), ("int8", int8_engine)):
        engine.set_mode(mode)
        expected = await collect(source.stream(prompt_of(source, LONG), params))
        got = await collect(engine.stream(prompt_of(engine, LONG), params))
        assert (outcome(got), got[1].degraded) == (outcome(expected), mode == "int8")
    engine.set_mode("normal")


async def test_newcomers_at_a_busy_int8_batch_get_their_first_token_from_an_int8_interlude(
    engine: BatchedEngine, int8_engine: BatchedEngine
) -> None:
    assert engine.interludes is not None
    params = SamplingParams(max_tokens=10)
    asks = [f"Newcomer {i}: {QUESTIONS[i]}" for i in range(6)]
    want = [await collect(int8_engine.stream(prompt_of(int8_engine, a, SYSTEM), params)) for a in asks]
    engine.set_mode("int8")
    served = engine.interludes.served
    await collect(engine.stream(prompt_of(engine, "Hi", SYSTEM), SamplingParams(max_tokens=1)))  # the prefix known
    async with aclosing(engine.stream(prompt_of(engine, STORY), SamplingParams(max_tokens=400))) as story:
        assert isinstance(await anext(story), Piece)
        got = [await collect(engine.stream(prompt_of(engine, a, SYSTEM), params)) for a in asks]
    engine.set_mode("normal")
    assert [outcome(a) for a in got] == [outcome(a) for a in want]
    assert all(f.degraded for _, f in got)
    assert engine.interludes.served > served
    await eventually_idle(engine)


class _Allocator:
    """What keep_apart wraps of one of the library's cache allocators: the token ids it would hash."""

    def __init__(self) -> None:
        self.hashed: list[list[int]] = []

    def match_prefix_blocks(self, prompt_ids: list[int]) -> list[int]:
        self.hashed.append(prompt_ids)
        return []

    def mark_complete_blocks(self, request_id: str, token_ids: list[int], blocks: int) -> None:
        self.hashed.append(token_ids)


class _Cache:
    def __init__(self) -> None:
        self.cache_allocators = {"full": _Allocator()}
        self.registered: list[str] = []

    def mark_complete_blocks(self, state: object, complete_blocks: dict[str, int]) -> None:
        self.registered.append(getattr(state, "request_id", ""))


class _State:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def test_each_mode_hashes_its_own_blocks_and_a_request_of_two_modes_registers_none() -> None:
    modes = Modes(("normal", "int8"))
    cache = _Cache()
    keep_apart(cache, modes)
    allocator = cache.cache_allocators["full"]
    for request_id in ("pure", "mixed"):
        modes.open(request_id)
    try:
        modes.step()  # normal
        modes.saw(["pure", "mixed", "not-open"], "normal")
        allocator.match_prefix_blocks([0, 5, 7])
        cache.mark_complete_blocks(_State("mixed"), {"full": 1})
        modes.want("int8")
        assert modes.step() == "int8" and kernel.ROWS.int8
        modes.saw(["mixed"], "int8")
        allocator.match_prefix_blocks([0, 5, 7])
        allocator.mark_complete_blocks("x", [3], 1)
        cache.mark_complete_blocks(_State("pure"), {"full": 1})
        cache.mark_complete_blocks(_State("mixed"), {"full": 1})  # both modes now: not registered
    finally:
        modes.want("normal")
        modes.step()
    assert not kernel.ROWS.int8
    assert allocator.hashed == [[0, 5, 7], [-1, -6, -8], [-4]]
    assert cache.registered == ["mixed", "pure"]
    assert (modes.degraded("pure"), modes.degraded("mixed"), modes.degraded("not-open")) == (False, True, False)
    assert modes.steps == {"normal": 2, "int8": 1}
    modes.close("mixed")
    assert not modes.degraded("mixed") and not modes.mixed("mixed")
