"""Racing the batch for first tokens (engine/first/race.py): whose mode a first token given beside the batch
counts in, and when the prefill process is asked. No model: the interlude's computation is scripted."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ttft_sse.engine.base import Prompt, SamplingParams
from ttft_sse.engine.first.claims import Claims, FirstToken
from ttft_sse.engine.first.interlude import Interlude
from ttft_sse.engine.first.race import Race
from ttft_sse.engine.modes import Modes

PROMPT = Prompt(text="hi", token_ids=(1, 2, 3))


async def _given(
    monkeypatch: pytest.MonkeyPatch, computed_in: str, *, batch_first: bool
) -> tuple[list[tuple[str, FirstToken]], Modes]:
    """A request raced with an interlude that computes its first token (7) in ``computed_in`` mode, in a thread of
    its own as the batching thread would; with ``batch_first`` the batch's step has picked one before it came."""
    interlude, claims, modes = Interlude(model=None), Claims(), Modes(("normal", "int8"))
    monkeypatch.setattr(interlude, "_compute", lambda in_place, asks, *salted: [7] * len(asks))
    given: list[tuple[str, FirstToken]] = []
    race = Race(interlude, claims, modes, given.extend)
    modes.open("r1")
    race.start("r1", PROMPT, SamplingParams(max_tokens=4))
    await asyncio.sleep(0)  # the ask is waiting

    def batching_thread() -> None:
        modes.want(computed_in)
        modes.step()
        if batch_first:
            claims.batch(["r1"])
        interlude.serve(in_place=object())

    thread = threading.Thread(target=batching_thread)
    thread.start()
    thread.join()
    await race.ended()
    return given, modes


@pytest.mark.parametrize("mode", ["normal", "int8"])
async def test_an_interludes_first_token_counts_in_the_mode_it_was_computed_in(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    given, modes = await _given(monkeypatch, mode, batch_first=False)
    assert given == [("r1", FirstToken(7))]
    assert modes.degraded("r1") is (mode == "int8")


async def test_an_interludes_first_token_the_batch_did_not_take_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nobody wants it any more (the batch's step picked the first token): not computed, not given, not noted.
    given, modes = await _given(monkeypatch, "int8", batch_first=True)
    assert given == [] and modes.degraded("r1") is False


class _Process:
    """What Race asks of the prefill process."""

    async def first_token(self, *args: Any) -> int | None:
        return 5


def test_the_prefill_process_is_asked_in_normal_mode_only() -> None:
    modes = Modes(("normal", "int8"))
    race = Race(_Process(), Claims(), modes, list)  # type: ignore[arg-type]
    assert race.open
    modes.want("int8")
    assert not race.open
    modes.want("normal")
    assert race.open
    assert Race(Interlude(model=None), Claims(), modes, list).open
