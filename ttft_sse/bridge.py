"""The one place where threads meet asyncio.

A blocking producer (``model.generate`` with a streamer) runs in its own thread and hands each item to the
event loop with ``loop.call_soon_threadsafe``. The async side awaits an ``asyncio.Queue``: no thread of anyio's
shared pool is held per stream, and the loop never blocks.

Three crossings, each one a known trap when done by hand:

* items and the end of the stream cross from the thread to the loop (``emit`` / the end marker);
* an exception raised in the thread crosses too, and is re-raised to the async consumer: a consumer never
  waits for an item that will not come (the stock ``TextIteratorStreamer`` without a timeout does);
* cancellation crosses the other way: closing the async iterator sets a ``threading.Event`` the producer
  checks between steps, then waits (shielded, bounded) until the thread has really ended, so that no thread
  outlives its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")

Emit = Callable[[T], None]
Producer = Callable[[Emit[T], threading.Event], None]


class _End:
    pass


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Workers(Generic[T]):
    """Runs producers in threads and tracks them, so that all of them can be cancelled and awaited at once."""

    def __init__(self, *, name: str, join_timeout: float = 60.0) -> None:
        self._name = name
        self._join_timeout = join_timeout
        self._serial = 0
        self._running: dict[int, tuple[threading.Event, asyncio.Future[None]]] = {}

    @property
    def active(self) -> int:
        return len(self._running)

    async def stream(self, producer: Producer[T]) -> AsyncGenerator[T, None]:
        """Run ``producer(emit, cancelled)`` in a new thread and yield what it emits.

        Use with ``contextlib.aclosing`` (or run it to the end): closing the iterator is what cancels the
        producer and waits for its thread.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[T | _End | _Failure] = asyncio.Queue()
        cancelled = threading.Event()
        ended: asyncio.Future[None] = loop.create_future()
        self._serial += 1
        key = self._serial

        def post(item: T | _End | _Failure) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def mark_ended() -> None:
            if not ended.done():
                ended.set_result(None)

        def run() -> None:
            outcome: _End | _Failure = _End()
            try:
                producer(post, cancelled)
            except BaseException as exc:
                outcome = _Failure(exc)
            finally:
                post(outcome)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(mark_ended)

        thread = threading.Thread(target=run, name=f"{self._name}-{key}", daemon=True)
        self._running[key] = (cancelled, ended)
        thread.start()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _End):
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            cancelled.set()
            # Shielded: this runs while the consumer is being cancelled (a client went away), and the wait is
            # what guarantees that the thread is gone when the request is. Bounded, so a wedged producer cannot
            # hold the request forever; the producer checks `cancelled` once per decode step.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._join_timeout):
                await ended
                while thread.is_alive():  # `ended` is posted from the thread's last lines; let it return
                    await asyncio.sleep(0.001)
            self._running.pop(key, None)

    async def cancel_all(self) -> None:
        """Cancel every running producer and wait (bounded) until their threads have ended."""
        running = list(self._running.values())
        for cancelled, _ in running:
            cancelled.set()
        if running:
            with anyio.move_on_after(self._join_timeout):
                await asyncio.gather(*(ended for _, ended in running))
