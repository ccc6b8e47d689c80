"""First-token targets: parsing, the prediction made at admission, and the degrader's switches with hysteresis."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from ttft_sse.errors import Overloaded
from ttft_sse.gate import Gate, Lane
from ttft_sse.settings import Settings, SettingsError
from ttft_sse.targets import MIN_SAMPLES, RECOVER_SECONDS, WINDOW_SECONDS, Degrader, Targets, parse_targets


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


def test_a_high_target_keeps_a_slot_for_the_high_lane() -> None:
    assert Settings(sla_ms="high:200,normal:1000").reserved_slots == 1
    assert Settings(sla_ms="normal:1000").reserved_slots == 0
    assert Settings(sla_ms="high:200", high_reserved_slots=0).reserved_slots == 0


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
    held = [gate.reserve(Lane.NORMAL), gate.reserve(Lane.NORMAL)]
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
