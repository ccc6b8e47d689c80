from __future__ import annotations

import asyncio
import os
import threading
import time
from contextlib import aclosing

import pytest

from ttft_sse.engine.threads import Commands, Emit, Idle, Loop, Mailboxes, Resident, Workers


async def test_items_cross_in_order_and_the_thread_ends() -> None:
    workers: Workers[int] = Workers(name="t")

    def produce(emit: Emit[int], cancelled: threading.Event) -> None:
        for i in range(5):
            emit(i)

    assert [i async for i in workers.stream(produce)] == [0, 1, 2, 3, 4]
    assert workers.active == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("t-")]


async def test_an_exception_in_the_thread_reaches_the_consumer_instead_of_hanging_it() -> None:
    workers: Workers[int] = Workers(name="t")

    def produce(emit: Emit[int], cancelled: threading.Event) -> None:
        emit(1)
        raise ValueError("boom in the worker")

    got = []
    with pytest.raises(ValueError, match="boom in the worker"):
        async for item in workers.stream(produce):
            got.append(item)
    assert got == [1]
    assert workers.active == 0


async def test_closing_the_stream_cancels_the_producer_and_waits_for_its_thread() -> None:
    workers: Workers[int] = Workers(name="t")
    steps_after_cancel: list[int] = []

    def produce(emit: Emit[int], cancelled: threading.Event) -> None:
        i = 0
        while not cancelled.is_set():
            emit(i)
            i += 1
            time.sleep(0.01)
        steps_after_cancel.append(i)

    async with aclosing(workers.stream(produce)) as items:
        async for item in items:
            if item == 3:
                break
    # aclose returned only after the thread finished: its last act is already recorded.
    assert len(steps_after_cancel) == 1
    assert workers.active == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("t-")]


async def test_cancel_all_stops_every_running_producer() -> None:
    workers: Workers[int] = Workers(name="t")
    started = threading.Event()

    def produce(emit: Emit[int], cancelled: threading.Event) -> None:
        started.set()
        cancelled.wait(10)

    stream = workers.stream(produce)
    task = asyncio.create_task(anext(stream))
    while not started.is_set():
        await asyncio.sleep(0.01)
    assert workers.active == 1
    await workers.cancel_all()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(task, 2)
    await stream.aclose()
    assert workers.active == 0


async def test_a_consumer_cancelled_while_its_thread_ends_leaves_cancel_all_waiting_for_that_thread() -> None:
    """Shutdown cancels a job's task (``task.cancel()``) wherever it is: here in the stream's close, waiting for
    a thread that is finishing a step. That must neither cut the wait short for ``cancel_all`` nor make
    ``cancel_all`` raise (it raised CancelledError, failing the server's shutdown, when the cancel hit there)."""
    workers: Workers[int] = Workers(name="t")
    in_step, finish_step = threading.Event(), threading.Event()

    def produce(emit: Emit[int], cancelled: threading.Event) -> None:
        emit(1)
        in_step.set()
        finish_step.wait(10)  # a step in flight: the thread sees `cancelled` only after it

    async def consume() -> None:
        async with aclosing(workers.stream(produce)) as items:
            async for _ in items:
                break  # closing: the stream now waits for the thread

    consumer = asyncio.create_task(consume())
    while not in_step.is_set():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert workers.active == 1  # its thread is still running
    closing = asyncio.create_task(workers.cancel_all())
    await asyncio.sleep(0.05)
    assert not closing.done()  # waits for the thread...
    finish_step.set()
    await asyncio.wait_for(closing, 5)  # ...and returns once it ends
    assert workers.active == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("t-")]


async def test_mailboxes_deliver_per_key_in_order_and_drop_what_nobody_reads() -> None:
    boxes: Mailboxes[str, int] = Mailboxes(alive=lambda: True, dead=lambda: RuntimeError("gone"))
    a, b = boxes.open("a"), boxes.open("b")
    gone = boxes.open("gone")
    gone.close()

    def producer() -> None:  # one step at a time, from another thread, as a batching loop delivers
        for step in range(3):
            boxes.deliver([("a", step), ("gone", step), ("b", 10 + step)])
        boxes.end_all()

    thread = threading.Thread(target=producer)
    thread.start()
    assert [i async for i in a] == [0, 1, 2]
    assert [i async for i in b] == [10, 11, 12]
    thread.join()
    for box in (a, b):
        box.close()
    assert boxes.count == 0


async def test_a_mailbox_consumer_does_not_wait_for_ever_on_a_dead_producer() -> None:
    alive = threading.Event()
    alive.set()
    boxes: Mailboxes[str, int] = Mailboxes(
        alive=alive.is_set, dead=lambda: RuntimeError("the loop stopped"), poll_seconds=0.01
    )
    inbox = boxes.open("a")
    boxes.deliver([("a", 1)])
    got = []
    with pytest.raises(RuntimeError, match="the loop stopped"):
        async for item in inbox:
            got.append(item)
            alive.clear()  # the producer dies without failing this request
    assert got == [1]


async def test_fail_all_reaches_every_open_mailbox_after_what_it_holds() -> None:
    boxes: Mailboxes[str, int] = Mailboxes(alive=lambda: True, dead=lambda: RuntimeError("gone"))
    a, b = boxes.open("a"), boxes.open("b")
    boxes.deliver([("a", 1)])
    threading.Thread(target=boxes.fail_all, args=(ValueError("step failed"),)).start()
    for box, want in ((a, [1]), (b, [])):
        got = []
        with pytest.raises(ValueError, match="step failed"):
            async for item in box:
                got.append(item)
        assert got == want
    with pytest.raises(RuntimeError, match="already open"):
        boxes.open("a")


async def test_resident_threads_are_daemons_and_stop_off_the_event_loop() -> None:
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start() -> None:  # like a library's start(): it spawns its loop with the default daemon flag
        thread = threading.Thread(target=stop.wait)
        thread.start()
        threads.append(thread)

    def halt() -> None:
        stop.set()
        threads[0].join()

    resident = Resident(name="r", start=start, stop=halt, alive=lambda: bool(threads) and threads[0].is_alive())
    resident.start()
    assert resident.alive and threads[0].daemon
    await resident.stop()
    assert not resident.alive


async def test_a_loop_takes_posted_commands_in_order_and_ends_when_stopped() -> None:
    seen: list[int] = []
    done = threading.Event()

    def body(commands: Commands[int]) -> None:
        while not commands.stopping:
            seen.extend(commands.take(wait=True))
            if len(seen) == 3:
                done.set()

    loop: Loop[int] = Loop(name="test-loop", body=body, on_failure=lambda exc: None)
    loop.start()
    for command in (1, 2, 3):
        loop.post(command)
    assert done.wait(10)
    await loop.stop()
    assert seen == [1, 2, 3]
    assert not loop.alive


async def test_a_loop_whose_body_raises_reports_it_ends_and_starts_again() -> None:
    failures: list[BaseException] = []
    runs: list[int] = []

    def body(commands: Commands[int]) -> None:
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("boom in the loop")
        commands.take(wait=True)

    loop: Loop[int] = Loop(name="test-loop", body=body, on_failure=failures.append)
    loop.start()
    for _ in range(1000):
        if not loop.alive:
            break
        await asyncio.sleep(0.005)
    assert not loop.alive
    assert [str(exc) for exc in failures] == ["boom in the loop"]
    assert isinstance(loop.failed, ValueError)
    loop.start()
    assert loop.alive and loop.failed is None
    await loop.stop()
    assert not loop.alive and runs == [1, 1]


def test_an_idle_job_runs_at_idle_priority_and_the_next_one_stops_it() -> None:
    idle = Idle(name="t-idle")
    seen: list[tuple[str, int]] = []
    first_started, second_done = threading.Event(), threading.Event()

    def first(stop: threading.Event) -> None:
        seen.append(("first", os.sched_getscheduler(0)))
        first_started.set()
        stop.wait(10)
        seen.append(("first stopped", int(stop.is_set())))

    def second(stop: threading.Event) -> None:
        seen.append(("second", os.sched_getscheduler(0)))
        second_done.set()

    idle.run(first)
    assert first_started.wait(10)
    idle.run(second)  # stops the first
    assert second_done.wait(10)
    for _ in range(100):
        if len(seen) == 3:
            break
        time.sleep(0.05)
    assert sorted(seen) == [("first", os.SCHED_IDLE), ("first stopped", 1), ("second", os.SCHED_IDLE)]
    idle.stop()
