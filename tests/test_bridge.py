from __future__ import annotations

import threading
import time
from contextlib import aclosing

import pytest

from ttft_sse.bridge import Emit, Workers


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
    import asyncio

    task = asyncio.create_task(anext(stream))
    while not started.is_set():
        await asyncio.sleep(0.01)
    assert workers.active == 1
    await workers.cancel_all()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(task, 2)
    await stream.aclose()
    assert workers.active == 0
