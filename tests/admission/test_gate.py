from __future__ import annotations

import asyncio

import pytest

from ttft_sse.admission.gate import MAX_RETRY_AFTER_SECONDS, Gate, Lane, queue_seconds
from ttft_sse.errors import Overloaded, Unavailable


async def test_slots_then_queue_then_overload_with_retry_after() -> None:
    gate = Gate(slots=2, max_queue=1, timeout=5)
    a, b = gate.reserve(), gate.reserve()
    assert a.admitted and b.admitted and gate.running == 2
    c = gate.reserve()
    assert not c.admitted and c.position == 1 and gate.waiting == 1
    with pytest.raises(Overloaded) as info:
        gate.reserve()
    assert "2 generations running and 1 waiting" in info.value.message
    assert int(info.value.headers()["Retry-After"]) >= 1


async def test_queued_request_is_admitted_when_a_slot_frees_and_sees_its_positions() -> None:
    gate = Gate(slots=1, max_queue=3, timeout=5)
    first = gate.reserve()
    second, third = gate.reserve(), gate.reserve()
    seen: list[int] = []

    async def wait_third() -> None:
        async for position in third.wait():
            seen.append(position)

    waiter = asyncio.create_task(wait_third())
    await asyncio.sleep(0)
    first.release()  # second admitted, third moves to position 1
    async with asyncio.timeout(1):
        while len(seen) < 2:
            await asyncio.sleep(0.001)
    assert second.admitted and not third.admitted
    second.release()
    await asyncio.wait_for(waiter, 1)
    assert seen == [2, 1]
    assert third.admitted and gate.running == 1 and gate.waiting == 0
    third.release()
    third.release()  # idempotent
    assert gate.running == 0


async def test_a_request_that_leaves_the_queue_frees_its_place() -> None:
    gate = Gate(slots=1, max_queue=1, timeout=5)
    gate.reserve()
    queued = gate.reserve()
    queued.release()
    assert gate.waiting == 0
    assert not gate.reserve().admitted  # the place is free again


async def test_queue_wait_is_bounded() -> None:
    gate = Gate(slots=1, max_queue=1, timeout=0.05)
    gate.reserve()
    queued = gate.reserve()
    with pytest.raises(Overloaded, match=r"waited 0\.05 s in the queue"):
        async for _ in queued.wait():
            pass
    assert gate.waiting == 0


async def settle() -> None:
    """Let woken waiters run (a few loop turns; nothing here sleeps on a clock)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_higher_lane_is_admitted_before_earlier_lower_ones_and_moves_them_back() -> None:
    gate = Gate(slots=1, max_queue=8, timeout=5)
    running = gate.reserve(Lane.HIGH)  # the one row: the high lane's own work fills it, every lane waits
    job = gate.reserve(Lane.JOBS, patient=True)
    low = gate.reserve(Lane.LOW)
    n1, n2 = gate.reserve(Lane.NORMAL), gate.reserve(Lane.NORMAL)
    assert [t.position for t in (n1, n2, low, job)] == [1, 2, 3, 4]
    seen: list[int] = []

    async def watch() -> None:
        async for position in n1.wait():
            seen.append(position)

    watcher = asyncio.create_task(watch())
    await settle()
    high = gate.reserve(Lane.HIGH)
    await settle()
    assert [t.position for t in (high, n1, n2, low, job)] == [1, 2, 3, 4, 5]
    assert gate.waiting_by_lane() == {"high": 1, "normal": 2, "low": 1, "jobs": 1}

    order = []
    holder = running
    for _ in range(5):
        holder.release()
        await settle()
        holder = next(t for t in (high, n1, n2, low, job) if t.admitted and t not in order)
        order.append(holder)
    assert order == [high, n1, n2, low, job]
    await asyncio.wait_for(watcher, 1)
    assert seen == [1, 2, 1]  # first in line, moved back by the high-lane newcomer, then first again


async def test_patient_job_tickets_take_no_queue_place_and_have_no_deadline() -> None:
    gate = Gate(slots=1, max_queue=1, timeout=0.01)
    gate.reserve()
    job = gate.reserve(Lane.JOBS, patient=True)
    interactive = gate.reserve(Lane.NORMAL)  # the one queue place is still free for a request
    with pytest.raises(Overloaded):
        gate.reserve(Lane.NORMAL)
    with pytest.raises(Overloaded):  # the interactive request times out...
        async for _ in interactive.wait():
            pass
    waiting = asyncio.create_task(anext(job.wait()))
    assert await asyncio.wait_for(waiting, 1) == 1  # ...the job is still there, first in line
    assert gate.waiting_by_lane()["jobs"] == 1


def test_retry_after_comes_from_the_queue_ahead_and_measured_service_times() -> None:
    gate = Gate(slots=2, max_queue=3, timeout=5)
    assert gate.retry_after() == 1.0  # nothing measured yet
    gate.reserve(Lane.HIGH), gate.reserve(Lane.HIGH)  # every row, the high lane's own
    for _ in range(3):
        gate.reserve(Lane.NORMAL)
    gate.record_service(2.0)
    gate.record_service(4.0)  # mean 3 s
    assert gate.retry_after(Lane.NORMAL) == (3 + 1) / 2 * 3.0  # three ahead, two slots
    assert gate.retry_after(Lane.HIGH) == (0 + 1) / 2 * 3.0  # nobody ahead of a high-lane newcomer
    with pytest.raises(Overloaded) as info:
        gate.reserve(Lane.NORMAL)
    assert info.value.headers() == {"Retry-After": "6"}
    assert "retry after 6 s, or POST the same body to /jobs" in info.value.message
    with pytest.raises(Overloaded) as high:
        gate.reserve(Lane.HIGH)
    assert high.value.headers() == {"Retry-After": "2"}  # 1.5 s, rounded up


def _refusal() -> Unavailable:
    return Unavailable("closed for the night", code="draining")


async def test_closing_refuses_queued_and_new_requests_but_keeps_admitted_ones() -> None:
    gate = Gate(slots=1, max_queue=2, timeout=5)
    running = gate.reserve()
    queued = gate.reserve()
    positions = queued.wait()
    assert await anext(positions) == 1
    gate.close(_refusal)
    with pytest.raises(Unavailable, match="closed for the night"):
        await anext(positions)
    assert (gate.running, gate.waiting) == (1, 0) and queued.released
    with pytest.raises(Unavailable, match="closed for the night"):
        gate.reserve()
    assert running.admitted and not running.released
    idle = asyncio.create_task(gate.wait_idle())
    await asyncio.sleep(0)
    assert not idle.done()
    running.release()
    await asyncio.wait_for(idle, 1)


async def test_admission_while_the_consumer_holds_a_position_is_not_lost() -> None:
    """Regression: ``wait`` cleared its wake-up flag after yielding, so an admission that happened while the
    consumer was busy with the queued position (sending it to the client) was lost, and the admitted request
    sat out the whole queue timeout."""
    gate = Gate(slots=1, max_queue=1, timeout=30)
    first = gate.reserve()
    second = gate.reserve()
    positions = second.wait()
    assert await anext(positions) == 1
    first.release()  # admitted while the consumer is "sending" position 1
    async with asyncio.timeout(1):
        with pytest.raises(StopAsyncIteration):
            await anext(positions)
    assert second.admitted


def test_retry_after_is_the_median_so_a_few_slow_generations_do_not_move_it() -> None:
    """Identical runs gave 1 s, 8 s and 124 s when the estimate was a mean: a few slow holds dragged it along."""
    gate = Gate(slots=1, max_queue=0, timeout=5)
    for seconds in [2.0] * 20 + [300.0] * 3:  # three slow generations among twenty ordinary ones
        gate.record_service(seconds)
    assert gate.service_seconds() == 2.0
    gate.reserve()
    with pytest.raises(Overloaded) as info:
        gate.reserve()
    assert info.value.headers() == {"Retry-After": "2"}  # one ahead of nobody, 2 s; the mean would say 41
    for seconds in [300.0] * 16:  # once most of the window is slow, so is the estimate
        gate.record_service(seconds)
    assert gate.service_seconds() == 300.0


def test_retry_after_is_capped() -> None:
    gate = Gate(slots=1, max_queue=10, timeout=5)
    gate.record_service(50.0)
    gate.reserve()
    for _ in range(10):
        gate.reserve()
    assert gate.retry_after() == MAX_RETRY_AFTER_SECONDS  # eleven ahead times 50 s would be 550 s


def test_queue_seconds_is_the_median_run_times_those_ahead_over_the_servers_within_bounds() -> None:
    """The estimate jobs' Retry-After comes from (embedded and Redis queues alike)."""
    assert queue_seconds(3, 2, [4.0, 4.0, 4.0, 400.0]) == 8.0  # (3 + 1) / 2 * median 4 s; the mean would say 208
    assert queue_seconds(0, 1, []) == 1.0  # nothing measured yet
    assert queue_seconds(0, 4, [0.2]) == 1.0  # never under a second
    assert queue_seconds(99, 1, [30.0]) == MAX_RETRY_AFTER_SECONDS


def test_retry_after_uses_the_newcomers_lane_and_every_lane_until_it_has_one() -> None:
    gate = Gate(slots=1, max_queue=10, timeout=5)
    for _ in range(5):
        gate.record_service(40.0, Lane.JOBS)  # overflow jobs hold slots long
    assert gate.retry_after(Lane.NORMAL) == 40.0  # nothing measured in the normal lane yet: every lane's
    for seconds in (1.5, 2.0, 2.5):
        gate.record_service(seconds, Lane.NORMAL)
    assert gate.retry_after(Lane.NORMAL) == 2.0
    assert gate.retry_after(Lane.JOBS) == 40.0


def test_the_gate_records_each_hold_under_the_tickets_lane() -> None:
    gate = Gate(slots=2, max_queue=0, timeout=5)
    high, job = gate.reserve(Lane.HIGH), gate.reserve(Lane.JOBS, patient=True)
    high.release()
    job.release()
    assert gate.service_seconds(Lane.HIGH) is not None and gate.service_seconds(Lane.HIGH) < 1
    assert len(gate._held[Lane.HIGH]) == len(gate._held[Lane.JOBS]) == 1
    assert not gate._held[Lane.NORMAL]


async def test_a_reserved_slot_is_for_the_high_lane_only() -> None:
    gate = Gate(slots=2, max_queue=4, timeout=5, reserved=1)
    first = gate.reserve(Lane.NORMAL)
    assert first.admitted and gate.running == 1
    second = gate.reserve(Lane.NORMAL)  # the last slot is the high lane's: a normal request waits
    assert not second.admitted and second.position == 1
    vip = gate.reserve(Lane.HIGH)
    assert vip.admitted and gate.running == 2
    vip.release()  # the freed slot is the reserved one: the normal request still waits
    assert not second.admitted and gate.running == 1
    first.release()  # a slot of its own frees: now it runs
    assert second.admitted and gate.running == 1
    second.release()
    assert gate.running == 0


async def test_the_high_lane_fills_the_engine_s_rows_with_its_own_work_whatever_the_others_hold() -> None:
    """Normal work holds every ordinary slot: the high lane is still admitted up to the engine's rows (slots + extra)
    of its own (the batched engine leaves normal rows out of steps for it), and waits only when its own work fills
    them; the normal lane stays below its cap of all generations running."""
    gate = Gate(slots=2, max_queue=4, timeout=5, extra=1)  # the engine's rows: 3
    normal = [gate.reserve(Lane.NORMAL, max_tokens=8) for _ in range(2)]
    assert all(t.admitted for t in normal) and gate.holders == set(normal)
    vips = [gate.reserve(Lane.HIGH) for _ in range(3)]  # every slot is normal work's: the high lane takes 3 anyway
    assert all(v.admitted for v in vips) and (gate.running, gate.running_high) == (5, 3)
    assert gate.holders_for(Lane.HIGH) and set(gate.holders_for(Lane.HIGH)) == set(vips)
    fourth = gate.reserve(Lane.HIGH)  # the high lane's own work fills the engine's rows: it waits
    waiting = gate.reserve(Lane.NORMAL)
    assert not fourth.admitted and not waiting.admitted
    assert gate.ahead(Lane.NORMAL) == [fourth, waiting] and gate.ahead(Lane.HIGH) == [fourth]
    normal[0].release()  # a normal generation ends: not a row of the high lane's, and 4 still run past the cap of 2
    assert not fourth.admitted and not waiting.admitted and gate.running == 4
    vips[0].release()  # one of its own ends: the high request takes the row
    assert fourth.admitted and not waiting.admitted and (gate.running, gate.running_high) == (4, 3)
    for ticket in (vips[1], vips[2], fourth):
        ticket.release()
    assert waiting.admitted and (gate.running, gate.running_high) == (2, 0)  # 1 running: below the cap
    assert gate.holders == {normal[1], waiting}
    for ticket in (normal[1], waiting):
        ticket.release()
    assert gate.running == 0 and not gate.holders


def test_slot_wait_is_zero_with_a_free_slot_and_else_the_queue_served_at_the_median_hold() -> None:
    gate = Gate(slots=2, max_queue=8, timeout=5, reserved=1)
    assert gate.slot_wait(Lane.NORMAL) == 0.0
    held = gate.reserve(Lane.NORMAL)
    assert gate.slot_wait(Lane.HIGH) == 0.0  # the reserved slot
    assert gate.slot_wait(Lane.NORMAL) is None  # no hold time measured yet: no prediction
    for seconds in (2.0, 4.0, 100.0):
        gate.record_service(seconds, Lane.NORMAL)
    assert gate.slot_wait(Lane.NORMAL) == 1 / 1 * 4.0  # one usable slot, the median hold
    waiting = gate.reserve(Lane.NORMAL)
    assert gate.slot_wait(Lane.NORMAL) == 2 / 1 * 4.0
    assert gate.slot_wait(Lane.HIGH) == 0.0
    waiting.release()
    held.release()


def test_a_gate_cannot_reserve_every_slot() -> None:
    with pytest.raises(ValueError, match="can reserve 0 to 1"):
        Gate(slots=2, max_queue=1, timeout=1, reserved=2)
