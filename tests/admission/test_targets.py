"""First-token targets: parsing, the prediction made at admission, and the degrader's switches with hysteresis."""

from __future__ import annotations

import re

import pytest
from structlog.testing import capture_logs

from ttft_sse.admission.gate import Gate, Lane
from ttft_sse.admission.targets import MIN_SAMPLES, RECOVER_SECONDS, WINDOW_SECONDS, Degrader, Targets, parse_targets
from ttft_sse.errors import Overloaded
from ttft_sse.settings import Settings, SettingsError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Modes:
    """A scripted engine's switch: records every mode it is put in."""

    def __init__(self) -> None:
        self.mode = "normal"
        self.seen: list[str] = []

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.seen.append(mode)


def test_targets_are_parsed_per_lane_in_seconds() -> None:
    assert parse_targets("high:200, normal:1000,low:5000") == {Lane.HIGH: 0.2, Lane.NORMAL: 1.0, Lane.LOW: 5.0}
    assert parse_targets(None) == {} == parse_targets("")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("jobs:100", "lanes high, normal, low"),
        ("normal", "lane:milliseconds pairs"),
        ("normal:fast", "must be a number of milliseconds, got 'fast'"),
        ("normal:-5", "must be more than 0 ms"),
        ("normal:nan", "must be more than 0 ms"),
        ("high:1,high:2", "names the high lane twice"),
    ],
)
def test_a_bad_target_is_refused_at_start_naming_it(spec: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({"TTFT_SLA_MS": spec})


def test_a_high_target_gives_the_high_lane_rows_past_the_others_cap() -> None:
    settings = Settings(sla_ms="high:200,normal:1000", max_concurrency=8)
    assert (settings.extra_slots, settings.reserved_slots, settings.engine_rows) == (4, 0, 12)
    assert Settings(sla_ms="high:200", max_concurrency=1).extra_slots == 1
    assert Settings(sla_ms="normal:1000").extra_slots == 0 == Settings().extra_slots
    assert Settings(sla_ms="high:200", high_extra_slots=0, high_reserved_slots=1).engine_rows == 8
    assert Settings(sla_ms="high:200", high_reserved_slots=1).reserved_slots == 1
    with pytest.raises(SettingsError, match="high_extra_slots must be -1 \\(auto\\) or 0 to 8"):
        Settings.from_env({"TTFT_HIGH_EXTRA_SLOTS": "9"})


def test_the_prediction_is_the_slot_wait_plus_admission_to_first_token() -> None:
    clock = Clock()
    gate = Gate(slots=2, max_queue=8, timeout=30)
    targets = Targets({Lane.NORMAL: 1.0}, gate, clock=clock)
    assert targets.predict(Lane.NORMAL) is None  # nothing measured: nothing is refused
    targets.check(Lane.NORMAL)
    for engine_seconds in [0.1] * 9 + [0.3]:
        targets.observe(Lane.NORMAL, engine_seconds, engine_seconds)
    assert targets.engine_seconds() == pytest.approx(0.1)  # p90 by nearest rank of nine 0.1 s and one 0.3 s
    targets.observe(Lane.NORMAL, 0.3, 0.3)
    assert targets.engine_seconds() == pytest.approx(0.3)  # two of eleven past the 90th percentile's rank
    assert targets.predict(Lane.NORMAL) == pytest.approx(0.3)  # a slot is free
    held = [gate.reserve(Lane.NORMAL), gate.reserve(Lane.NORMAL)]
    for seconds in (2.0, 2.0, 2.0):
        gate.record_service(seconds, Lane.NORMAL)
    # No slot: the next one frees in about (0 ahead + 1) / 2 slots x 2 s median hold.
    assert targets.predict(Lane.NORMAL) == pytest.approx(1.0 + 0.3)
    with pytest.raises(Overloaded) as refused:
        targets.check(Lane.NORMAL)
    assert refused.value.code == "first_token_target"
    assert "past the normal lane's target of 1000 ms (TTFT_SLA_MS)" in str(refused.value)
    assert "/jobs" in str(refused.value)
    assert refused.value.retry_after == pytest.approx(1.0)  # at least a second (0.3 s past the target)
    targets.check(Lane.LOW)  # a lane without a target is never refused here
    for ticket in held:
        ticket.release()
    targets.check(Lane.NORMAL)


def test_a_high_request_is_admitted_while_normal_work_fills_the_slots_and_refused_when_its_own_fills_the_rows() -> None:
    """The engine's rows (slots + extra: 3) are busy, two of them with normal answers: the high lane's newcomer is
    admitted (the batched engine leaves normal rows out of steps for it). Once the high lane's own work fills the
    rows, a high newcomer's first token waits for one of them to end: refused at once, with a Retry-After."""
    gate = Gate(slots=2, max_queue=8, timeout=30, extra=1)
    targets = Targets({Lane.HIGH: 0.2, Lane.NORMAL: 1.0}, gate, clock=Clock())
    targets.warmed(0.05, tokens=48, max_tokens=48, generating_seconds=47 * 0.05)  # 50 ms a token, 2.4 s an answer
    running = [gate.reserve(Lane.NORMAL, max_tokens=48) for _ in range(2)] + [gate.reserve(Lane.HIGH, max_tokens=48)]
    assert gate.running == 3 == gate.usable(Lane.HIGH)  # every row of the engine is busy
    assert targets.slot_wait(Lane.HIGH, 48) == 0.0 and targets.predict(Lane.HIGH, 48) == pytest.approx(0.05)
    targets.check(Lane.HIGH, 48)
    running += [gate.reserve(Lane.HIGH, max_tokens=48) for _ in range(2)]
    assert all(ticket.admitted for ticket in running) and (gate.running, gate.running_high) == (5, 3)
    with pytest.raises(Overloaded) as refused:
        targets.check(Lane.HIGH, 48)
    assert refused.value.code == "first_token_target" and "high lane's target of 200 ms" in str(refused.value)
    assert refused.value.retry_after is not None and refused.value.retry_after >= 1.0
    running.pop().release()  # one of the high lane's own ends: room again
    targets.check(Lane.HIGH, 48)
    with pytest.raises(Overloaded):  # the normal lane is still past its cap: its newcomer would wait ~2 s
        targets.check(Lane.NORMAL, 48)
    for ticket in running:
        ticket.release()


def test_with_a_free_slot_a_slow_engine_is_not_a_reason_to_refuse() -> None:
    """Refusing at once spares a client a wait; an engine slower than the target is the degrader's to fix."""
    targets = Targets({Lane.NORMAL: 0.3}, Gate(slots=1, max_queue=1, timeout=1), clock=Clock())
    targets.observe(Lane.NORMAL, 2.0, 2.0)
    assert targets.predict(Lane.NORMAL) == 2.0
    targets.check(Lane.NORMAL)


def test_old_first_tokens_leave_the_window() -> None:
    clock = Clock()
    targets = Targets({Lane.NORMAL: 1.0}, Gate(slots=1, max_queue=1, timeout=1), clock=clock)
    targets.observe(Lane.NORMAL, 5.0, 5.0)
    clock.now += WINDOW_SECONDS + 1
    assert targets.engine_seconds() is None


def test_the_degrader_switches_on_a_missed_p99_and_back_after_a_calm_spell() -> None:
    clock = Clock()
    targets = Targets({Lane.HIGH: 0.2, Lane.NORMAL: 1.0}, Gate(slots=2, max_queue=1, timeout=1), clock=clock)
    modes = Modes()
    degrader = Degrader(targets, modes)
    for _ in range(MIN_SAMPLES - 1):  # too few to judge a p99 by
        targets.observe(Lane.NORMAL, 3.0, 0.1)
    degrader.evaluate()
    assert not degrader.degraded and modes.seen == []
    targets.observe(Lane.NORMAL, 3.0, 0.1)
    with capture_logs() as logs:
        degrader.evaluate()
    assert degrader.degraded and modes.seen == ["int8"]
    assert [(e["event"], e["mode"]) for e in logs] == [("degraded", "int8")]
    assert "the normal lane's first-token p99 is 3000 ms, over its 1000 ms target" in logs[0]["reason"]
    clock.now += RECOVER_SECONDS / 2
    targets.observe(Lane.HIGH, 0.05, 0.05)
    degrader.evaluate()  # the mode holds at least RECOVER_SECONDS
    assert degrader.degraded
    clock.now += RECOVER_SECONDS / 2 + 1
    targets.observe(Lane.NORMAL, 0.8, 0.1)  # under the target, but over 70 % of it: not calm yet
    degrader.evaluate()
    assert degrader.degraded
    clock.now += RECOVER_SECONDS + 1  # then nothing slow for a whole spell (no traffic at all counts as calm)
    degrader.evaluate()
    assert not degrader.degraded and modes.seen == ["int8", "normal"] and degrader.switches == 2
    targets.observe(Lane.NORMAL, 0.1, 0.1)  # the slow first tokens of before the switch are still in the window,
    degrader.evaluate()  # but they were made in the other mode: no flapping back
    assert not degrader.degraded and degrader.switches == 2


def test_better_lanes_arriving_stretch_the_wait_and_can_take_every_slot() -> None:
    clock = Clock()
    gate = Gate(slots=2, max_queue=8, timeout=30)
    targets = Targets({Lane.NORMAL: 5.0}, gate, clock=clock)
    targets.observe(Lane.NORMAL, 0.1, 0.1)
    held = [gate.reserve(Lane.HIGH), gate.reserve(Lane.HIGH)]  # the engine's rows: the high lane's, and every slot
    for seconds in (1.0, 1.0, 1.0):
        gate.record_service(seconds, Lane.NORMAL)
    assert targets.predict(Lane.NORMAL) == pytest.approx(0.5 + 0.1)  # (0 + 1) / 2 slots x 1 s, plus 0.1 s
    for _ in range(10):  # high requests let through at 1 a second over the last 10 s: they take half the slots
        targets.check(Lane.HIGH)
    assert targets.predict(Lane.NORMAL) == pytest.approx(0.5 / (1 - 1.0 * 1.0 / 2) + 0.1)
    assert targets.predict(Lane.HIGH) == pytest.approx(0.5 + 0.1)  # no lane is better than the high one
    for _ in range(10):  # now they take every slot: a normal request would never get one
        targets.check(Lane.HIGH)
    with pytest.raises(Overloaded, match="cannot come in time"):
        targets.check(Lane.NORMAL)
    clock.now += 11  # the high arrivals leave the rate's window
    assert targets.predict(Lane.NORMAL) == pytest.approx(0.6)
    for ticket in held:
        ticket.release()


def test_a_queued_request_may_wait_its_target_less_the_first_tokens_own_time() -> None:
    targets = Targets({Lane.NORMAL: 1.0}, Gate(slots=1, max_queue=1, timeout=30), clock=Clock())
    assert targets.queue_limit(Lane.LOW) == (None, None)
    targets.observe(Lane.NORMAL, 0.25, 0.25)
    wait, late = targets.queue_limit(Lane.NORMAL)
    assert wait == pytest.approx(0.75) and late is not None
    refusal = late()
    assert refusal.code == "first_token_target" and "can no longer come in time after this wait" in str(refusal)


async def test_the_gate_ends_a_wait_at_a_tickets_own_deadline_with_its_own_error() -> None:
    gate = Gate(slots=1, max_queue=2, timeout=30)
    held = gate.reserve(Lane.NORMAL)
    queued = gate.reserve(Lane.NORMAL, wait=0.05, late=lambda: Overloaded("late", code="first_token_target"))
    with pytest.raises(Overloaded) as ended:
        async for _ in queued.wait():
            pass
    assert ended.value.code == "first_token_target" and gate.waiting == 0
    held.release()


def test_a_request_refused_at_its_deadline_counts_as_slower_than_any_first_token() -> None:
    clock = Clock()
    targets = Targets({Lane.HIGH: 0.3}, Gate(slots=1, max_queue=1, timeout=1), clock=clock)
    degrader = Degrader(targets, Modes())
    for _ in range(MIN_SAMPLES - 1):
        targets.observe(Lane.HIGH, 0.05, 0.05)
    targets.missed(Lane.HIGH)
    degrader.evaluate()
    assert degrader.degraded  # one refusal in ten puts the p99 past the target


def test_a_burst_is_judged_by_the_work_admitted_in_the_same_instant() -> None:
    """Known costs: admission to first token 0.1 s, a token 0.05 s with one row running (x sqrt(rows) with more),
    answers of their whole max_tokens. Four slots and two more for the high lane; a burst of normal requests fills
    the slots, and each newcomer after that is judged by when the generations admitted before it, in the same
    instant, free a slot: none of them has a history yet."""
    clock = Clock()
    gate = Gate(slots=4, max_queue=16, timeout=30, extra=2)
    targets = Targets({Lane.HIGH: 0.3, Lane.NORMAL: 1.0}, gate, clock=clock)
    targets.warmed(0.1, tokens=9, max_tokens=9, generating_seconds=0.4)  # 8 gaps of 0.05 s, one row
    assert targets.pace(1) == pytest.approx(0.05) and targets.pace(4) == pytest.approx(0.1)
    running = []
    for _ in range(4):  # a free slot each: admitted, whatever the pace
        targets.check(Lane.NORMAL, 10)
        running.append(gate.reserve(Lane.NORMAL, max_tokens=10))
    # The slots free when the four end: 0.1 s to a first token, then 9 more at 0.1 s (4 rows): 1 s (less the few
    # microseconds since they were admitted).
    assert targets.slot_wait(Lane.NORMAL, 10) == pytest.approx(0.1 + 9 * 0.1, abs=0.01)
    with pytest.raises(Overloaded) as refused:
        targets.check(Lane.NORMAL, 10)
    # About 1100 ms, less the time since the four were admitted (real time: milliseconds on a loaded machine).
    found = re.search(r"the first token would come in about (\d+) ms, past the normal lane", str(refused.value))
    assert refused.value.code == "first_token_target" and found is not None, str(refused.value)
    assert int(found.group(1)) == pytest.approx(1100, abs=10)
    assert refused.value.retry_after == pytest.approx(1.0, abs=0.01)  # when a slot is free for it
    # Shorter answers fit: a newcomer asking for 2 tokens is still judged by the others' 10.
    with pytest.raises(Overloaded):
        targets.check(Lane.NORMAL, 2)
    # The running ones get going: one has made 9 of its 10 tokens at 0.02 s each (its own pace, now trusted).
    clock_now = running[0].created
    running[0].produced(1, clock_now)
    for _ in range(8):
        running[0].produced(1, clock_now + 0.16)
    wait = targets.slot_wait(Lane.NORMAL, 10)
    assert wait is not None and wait < 0.9  # its last token soon: that slot frees first
    # A high request is admitted past the normal cap: no wait, nothing to predict. The engine's 6 rows count the high
    # lane's own work only (the normal rows sit steps out for it).
    assert targets.slot_wait(Lane.HIGH, 10) == 0.0
    vips = [gate.reserve(Lane.HIGH, max_tokens=10) for _ in range(6)]
    assert all(v.admitted for v in vips) and (gate.running, gate.running_high) == (10, 6)
    # Its own work fills every row: the next high request waits for the first of those to end (0.1 s to their first
    # tokens, then 9 more at the pace of the 6 rows a step computes), not for the nearly done normal one.
    seventh = targets.slot_wait(Lane.HIGH, 10)
    assert seventh == pytest.approx(0.1 + 9 * 0.05 * 6**0.5, abs=0.01)
    for ticket in running + vips:
        ticket.release()


def test_requests_queued_in_the_same_instant_take_the_slots_in_turn() -> None:
    """Two slots, nothing running yet has a first token; two requests queued ahead: the newcomer is third in line,
    so it gets the slot the first queued one frees, after that one's own expected time."""
    clock = Clock()
    gate = Gate(slots=2, max_queue=16, timeout=30)
    targets = Targets({Lane.NORMAL: 60.0}, gate, clock=clock)
    targets.warmed(0.0, tokens=11, max_tokens=11, generating_seconds=1.0)  # 0.1 s a token, one row
    pace = 0.1 * 2**0.5  # two rows run while it waits
    held = [gate.reserve(Lane.NORMAL, max_tokens=5) for _ in range(2)]
    queued = [gate.reserve(Lane.NORMAL, max_tokens=20) for _ in range(2)]
    assert not any(t.admitted for t in queued)
    first_free = 4 * pace  # both running end together, 4 tokens after their first
    # queued[0] and queued[1] take those two slots; the newcomer waits for the first of them to end: 19 more tokens
    # after its first (the first token's own time is 0 here).
    assert targets.slot_wait(Lane.NORMAL, 1) == pytest.approx(first_free + 19 * pace, abs=0.01)
    for ticket in held + queued:
        ticket.release()
