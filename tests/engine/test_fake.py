"""The scripted engine's modes (engine/fake.py): what an admission controller is tested against without a model."""

from __future__ import annotations

import time
from contextlib import aclosing

import pytest

from tests.support.engines import collect
from ttft_sse.engine.base import Finished, Piece, Prompt, SamplingParams, Usage
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.stages import StageClock

PROMPT = Prompt(text="hello there", token_ids=(0, 1))
PARAMS = SamplingParams(max_tokens=16)


def test_an_engine_without_modes_has_normal_alone_and_refuses_int8() -> None:
    engine = FakeEngine()
    assert (engine.info.modes, engine.mode) == (("normal",), "normal")
    engine.set_mode("normal")
    with pytest.raises(ValueError, match=r"^mode must be one of normal, got 'int8' \(TTFT_DEGRADE=int8 gives"):
        engine.set_mode("int8")
    assert engine.mode == "normal"


def test_scripted_modes_start_normal_and_refuse_a_mode_they_lack() -> None:
    engine = FakeEngine(modes=("normal", "int8"))
    assert (engine.info.modes, engine.mode) == (("normal", "int8"), "normal")
    engine.set_mode("int8")
    assert engine.mode == "int8"
    with pytest.raises(ValueError, match=r"^mode must be one of normal, int8, got 'int4'$"):
        engine.set_mode("int4")
    assert engine.mode == "int8"
    with pytest.raises(ValueError, match="modes must start with 'normal'"):
        FakeEngine(modes=("int8",))


async def test_a_generation_is_degraded_when_it_started_in_int8_or_any_piece_was_int8() -> None:
    engine = FakeEngine(("a", " b", " c"), modes=("normal", "int8"))
    engine.load(StageClock())
    usage, timings = Usage(prompt_tokens=2, completion_tokens=3), {"prefill_ms": 0.0, "decode_ms": 0.0}
    assert await collect(engine.stream(PROMPT, PARAMS)) == ("a b c", Finished("stop", usage, timings, degraded=False))
    engine.set_mode("int8")
    text, finished = await collect(engine.stream(PROMPT, PARAMS))
    assert (text, finished.degraded) == ("a b c", True)
    # Switched back before it starts: its prompt's pass and every piece normal.
    engine.set_mode("normal")
    assert (await collect(engine.stream(PROMPT, PARAMS)))[1].degraded is False


@pytest.mark.parametrize(("before", "after", "degraded"), [("normal", "int8", True), ("int8", "normal", True)])
async def test_a_switch_while_a_stream_runs_takes_effect_at_its_next_piece(
    before: str, after: str, degraded: bool
) -> None:
    engine = FakeEngine(("a", " b", " c", " d"), hold_after=2, modes=("normal", "int8"))
    engine.set_mode(before)
    items: list[Piece | Finished] = []
    async with aclosing(engine.stream(PROMPT, PARAMS)) as stream:
        async for item in stream:
            items.append(item)
            if len(items) == 2:  # held after its second piece: the rest comes after the switch
                engine.set_mode(after)
                engine.release.set()
    assert [i.text for i in items if isinstance(i, Piece)] == ["a", " b", " c", " d"]
    finished = items[-1]
    assert isinstance(finished, Finished)
    assert (finished.finish_reason, finished.usage.completion_tokens, finished.degraded) == ("stop", 4, degraded)


async def test_int8_delay_paces_the_pieces_computed_in_int8() -> None:
    engine = FakeEngine(("a",) * 5, delay=0.05, int8_delay=0.0, modes=("normal", "int8"))
    engine.set_mode("int8")
    started = time.perf_counter()
    text, finished = await collect(engine.stream(PROMPT, PARAMS))
    assert (text, finished.degraded) == ("aaaaa", True)
    assert time.perf_counter() - started < 0.2  # 5 x 0.05 s in normal
    engine.set_mode("normal")
    started = time.perf_counter()
    await collect(engine.stream(PROMPT, PARAMS))
    assert time.perf_counter() - started >= 0.25
