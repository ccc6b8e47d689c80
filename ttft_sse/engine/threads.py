"""The one place where threads meet asyncio.

Two shapes of producer: :class:`Workers` runs one thread per request (``model.generate``); :class:`Mailboxes`
serves many requests from one long-lived thread (a continuous-batching loop), which :class:`Resident` starts and
stops where a library creates it, and :class:`Loop` where it is ours (fed by :class:`Commands`). Beside them,
:class:`Idle` runs work nobody waits on, at idle priority.

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
import os
import threading
from collections.abc import AsyncGenerator, Callable, Hashable, Iterable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

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
        self._running: dict[int, tuple[threading.Event, asyncio.Future[None], threading.Thread]] = {}

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
            self._running.pop(key, None)
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
        self._running[key] = (cancelled, ended, thread)
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
            # Shielded: this runs while the consumer is being cancelled (a client went away, a server closes its
            # jobs), and the wait is what guarantees that the thread is gone when the request is. Bounded, so a
            # wedged producer cannot hold the request forever; the producer checks `cancelled` once per decode
            # step. The entry in _running goes when the thread ends (mark_ended), not when this wait does.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._join_timeout):
                await _ended(ended, thread)

    async def cancel_all(self) -> None:
        """Cancel every running producer and wait (bounded) until their threads have ended."""
        running = list(self._running.values())
        for cancelled, _, _ in running:
            cancelled.set()
        with anyio.move_on_after(self._join_timeout):
            for _, ended, thread in running:
                await _ended(ended, thread)


async def _ended(ended: asyncio.Future[None], thread: threading.Thread) -> None:
    """Until ``thread`` has ended. ``ended`` is posted from its last lines; then let it return. The future is
    shielded: a ``task.cancel()`` of the task waiting here must not cancel it for the others waiting on it."""
    await asyncio.shield(ended)
    while thread.is_alive():
        await asyncio.sleep(0.001)


class Resident:
    """A long-lived thread that a library creates for us (transformers' continuous-batching loop), from start to stop.

    ``start`` is called from a short-lived daemon thread: a thread inherits its daemon flag from the thread that
    creates it, so the library's loop is a daemon too and a process whose ``close()`` never ran can still exit
    (Python joins non-daemon threads at exit, forever). ``stop`` blocks, so it runs in a worker thread, bounded.
    """

    def __init__(
        self,
        *,
        name: str,
        start: Callable[[], None],
        stop: Callable[[], None],
        alive: Callable[[], bool],
        stop_timeout: float = 30.0,
    ) -> None:
        self._name = name
        self._start = start
        self._stop = stop
        self._alive = alive
        self._stop_timeout = stop_timeout
        self._restarting = threading.Lock()

    @property
    def alive(self) -> bool:
        return self._alive()

    def start(self) -> None:
        """Start the thread (blocking for as long as the library's ``start`` takes; call it off the event loop or
        where that is short)."""
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._start()
            except BaseException as exc:
                failure.append(exc)

        starter = threading.Thread(target=run, name=f"{self._name}-start", daemon=True)
        starter.start()
        starter.join()
        if failure:
            raise failure[0]

    async def stop(self) -> None:
        """Ask the thread to stop and wait (in a worker thread, bounded) until it has."""
        with anyio.move_on_after(self._stop_timeout):
            await anyio.to_thread.run_sync(self._stop, abandon_on_cancel=True)

    async def restart(self, needed: Callable[[], bool]) -> None:
        """Stop and start the thread again if ``needed()`` (checked again under a lock, so that concurrent callers
        restart it once). Waits in a worker thread: stopping joins the old thread."""

        def run() -> None:
            with self._restarting:
                if needed():
                    self._stop()
                    self.start()

        await anyio.to_thread.run_sync(run)


class Idle:
    """A daemon thread at idle priority for work nobody waits on (the paged cache's memory faulted in ahead of use,
    engine/batched/memory.py): ``SCHED_IDLE`` (Linux), so it runs on a core only when nothing else wants it. A job
    checks its stop event between steps; :meth:`stop` sets it and joins nothing (a step ends on its own)."""

    def __init__(self, *, name: str) -> None:
        self._name = name
        self._stop: threading.Event | None = None

    def run(self, job: Callable[[threading.Event], None]) -> None:
        """Stop the job before (if any), and start ``job`` in a thread of its own."""
        self.stop()
        stop = self._stop = threading.Event()

        def run() -> None:
            with contextlib.suppress(OSError, AttributeError):  # elsewhere than Linux: at normal priority
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            job(stop)

        threading.Thread(target=run, name=self._name, daemon=True).start()

    def stop(self) -> None:
        """Ask the job running (if any) to end at its next step."""
        if self._stop is not None:
            self._stop.set()


class Inbox(Generic[K, T]):
    """What one request receives from a shared producer thread. Iterate it on the event loop that opened it."""

    def __init__(self, owner: Mailboxes[K, T], key: K) -> None:
        self._owner = owner
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[T | _End | _Failure] = asyncio.Queue()

    def __aiter__(self) -> Inbox[K, T]:
        return self

    async def __anext__(self) -> T:
        while True:
            try:
                async with asyncio.timeout(self._owner.poll_seconds):
                    item = await self.queue.get()
            except TimeoutError:
                # The safety net: a producer thread that died without failing this request (a crash between its
                # last delivery and its error handling) must not leave the consumer waiting for ever.
                if not self._owner.alive():
                    raise self._owner.dead() from None
                continue
            if isinstance(item, _End):
                raise StopAsyncIteration
            if isinstance(item, _Failure):
                raise item.exc
            return item

    def close(self) -> None:
        """Stop receiving: later deliveries for this key are dropped. Idempotent."""
        self._owner._forget(self)


class Mailboxes(Generic[K, T]):
    """Per-request inboxes that one long-lived producer thread delivers into.

    ``deliver`` is called from the producer thread once per step with the items of every request that made
    progress; it crosses to each event loop with a single ``call_soon_threadsafe`` per loop, not one per item. Items
    for a key that is not open (a request that was cancelled, whose last step was still in flight) are dropped: a
    cancelled request leaves nothing behind. ``end_all`` ends every inbox quietly (the engine is closing),
    ``fail_all`` with an exception. A consumer checks ``alive`` every ``poll_seconds`` while it waits, and raises
    ``dead()`` once the producer is gone: nothing waits for ever on a thread that has died.
    """

    def __init__(
        self,
        *,
        alive: Callable[[], bool],
        dead: Callable[[], BaseException],
        poll_seconds: float = 1.0,
    ) -> None:
        self.alive = alive
        self.dead = dead
        self.poll_seconds = poll_seconds
        self._lock = threading.Lock()
        self._open: dict[K, Inbox[K, T]] = {}

    @property
    def count(self) -> int:
        return len(self._open)

    def open(self, key: K) -> Inbox[K, T]:
        """Open the inbox for ``key``, on the running event loop. Open it before the producer can deliver for it."""
        inbox: Inbox[K, T] = Inbox(self, key)
        with self._lock:
            if key in self._open:
                raise RuntimeError(f"an inbox for {key!r} is already open; request keys must be unique")
            self._open[key] = inbox
        return inbox

    def deliver(self, items: Iterable[tuple[K, T]]) -> None:
        """From any thread: hand each item to its key's inbox."""
        self._post((key, item) for key, item in items)

    def fail_all(self, exc: BaseException) -> None:
        """From any thread: every open inbox raises ``exc`` after what it already holds."""
        with self._lock:
            keys = list(self._open)
        self._post((key, _Failure(exc)) for key in keys)

    def end_all(self) -> None:
        """From any thread: every open inbox ends (no more items, no error) after what it already holds."""
        with self._lock:
            keys = list(self._open)
        self._post((key, _End()) for key in keys)

    def _post(self, items: Iterable[tuple[K, T | _End | _Failure]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[T | _End | _Failure], T | _End | _Failure]]]
        by_loop = {}
        with self._lock:
            for key, item in items:
                inbox = self._open.get(key)
                if inbox is not None:
                    by_loop.setdefault(inbox.loop, []).append((inbox.queue, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_put_all, batch)

    def _forget(self, inbox: Inbox[K, T]) -> None:
        with self._lock:
            if self._open.get(inbox.key) is inbox:
                del self._open[inbox.key]


def _put_all(batch: list[tuple[asyncio.Queue[T], T]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class Commands(Generic[T]):
    """Commands posted from any thread to one :class:`Loop`'s thread, which takes them all at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[T] = []
        self.stopping = False

    def post(self, command: T) -> None:
        with self._cond:
            self._items.append(command)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify()

    def take(self, *, wait: bool, timeout: float | None = None) -> list[T]:
        """Every command posted so far, in order. With ``wait``, block until there is one, the loop is stopping or
        ``timeout`` seconds have passed (then the list may be empty)."""
        with self._cond:
            if wait and not self._items and not self.stopping:
                self._cond.wait_for(lambda: bool(self._items) or self.stopping, timeout)
            items, self._items = self._items, []
            return items


class Loop(Generic[T]):
    """A long-lived daemon thread of ours that serves many requests: ``body(commands)`` runs in it until it returns,
    and returns once ``commands.stopping`` is set (:meth:`stop`). It learns of new work from :meth:`post`, and hands
    results back through :class:`Mailboxes`. A ``body`` that raises ends the thread; ``failed`` then holds the
    exception (``on_failure`` is called with it first, in the thread) and :meth:`start` may start a new one."""

    def __init__(
        self,
        *,
        name: str,
        body: Callable[[Commands[T]], None],
        on_failure: Callable[[BaseException], None],
        stop_timeout: float = 30.0,
    ) -> None:
        self._name = name
        self._body = body
        self._on_failure = on_failure
        self._stop_timeout = stop_timeout
        self._commands: Commands[T] = Commands()
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start a thread (a new one after a failure; a no-op while one runs)."""
        if self.alive:
            return
        self._commands = commands = Commands[T]()
        self.failed = None

        def run() -> None:
            try:
                self._body(commands)
            except BaseException as exc:
                self.failed = exc
                self._on_failure(exc)

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()

    def post(self, command: T) -> None:
        self._commands.post(command)

    async def stop(self) -> None:
        """Ask the thread to stop and wait (bounded, off the event loop) until it has."""
        self._commands.stop()
        thread = self._thread
        if thread is None:
            return
        with anyio.move_on_after(self._stop_timeout):
            await anyio.to_thread.run_sync(thread.join, abandon_on_cancel=True)

    def stop_now(self) -> None:
        """From a thread that may block: ask the thread to stop and join it (bounded)."""
        self._commands.stop()
        if self._thread is not None:
            self._thread.join(self._stop_timeout)
