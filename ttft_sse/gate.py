"""Admission control: a bounded number of generations at once, and a bounded, first-come queue for the rest.

A request either gets a slot, a place in the queue, or an immediate ``Overloaded`` (503 + Retry-After) — decided
before any response header is sent. A queued request waits at most ``timeout`` seconds; a request that leaves
while queued frees its place at once. ``close`` (on shutdown) refuses every queued request with the error it is
given, and every newcomer after it; requests already admitted keep their slots until they finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from ttft_sse.errors import Overloaded, Unavailable


class Ticket:
    """One request's claim on the gate. Release it exactly once, admitted or not (``release`` is idempotent)."""

    def __init__(self, gate: Gate, *, admitted: bool) -> None:
        self._gate = gate
        self.admitted = admitted
        self.released = False
        self.created = time.perf_counter()
        self.admitted_at = self.created if admitted else None
        self._moved = asyncio.Event()

    @property
    def position(self) -> int:
        """1-based place in the queue; 0 once admitted."""
        return 0 if self.admitted else self._gate.position(self)

    @property
    def waited(self) -> float:
        return (self.admitted_at or time.perf_counter()) - self.created

    async def wait(self) -> AsyncIterator[int]:
        """Yield the queue position each time it changes, until admitted.

        Raises ``Overloaded`` on timeout, and the gate's refusal when the gate is closed while this ticket waits.
        """
        deadline = self.created + self._gate.timeout
        while not self.admitted:
            if (refusal := self._gate.refusal) is not None:
                self.release()
                raise refusal()
            # Clear before yielding, not after: the consumer may take a while with the position (send it to a
            # client), and an admission or a move that happens meanwhile must not be lost (it used to be, and the
            # admitted ticket then sat out the whole queue timeout).
            self._moved.clear()
            yield self.position
            if self.admitted or self._gate.refusal is not None:
                continue
            remaining = deadline - time.perf_counter()
            try:
                await asyncio.wait_for(self._moved.wait(), timeout=max(remaining, 0.0))
            except TimeoutError:
                if not self.admitted:
                    self.release()
                    raise Overloaded(
                        f"waited {self._gate.timeout:g} s in the queue without a free generation slot",
                        retry_after=self._gate.retry_after(),
                    ) from None

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._gate._leave(self)

    def _admit(self) -> None:
        self.admitted = True
        self.admitted_at = time.perf_counter()
        self._moved.set()

    def _notify(self) -> None:
        self._moved.set()


class Gate:
    def __init__(self, *, slots: int, max_queue: int, timeout: float) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.timeout = timeout
        self.running = 0
        self._queue: deque[Ticket] = deque()
        self._service_seconds = 2.0  # moving average of how long a slot is held; seeded, then measured
        self.refusal: Callable[[], Unavailable] | None = None
        self._changed = asyncio.Event()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self.refusal is not None

    def reserve(self) -> Ticket:
        if self.refusal is not None:
            raise self.refusal()
        if self.running < self.slots and not self._queue:
            self.running += 1
            return Ticket(self, admitted=True)
        if len(self._queue) >= self.max_queue:
            raise Overloaded(
                f"server is at capacity: {self.running} generations running and {len(self._queue)} waiting",
                retry_after=self.retry_after(),
            )
        ticket = Ticket(self, admitted=False)
        self._queue.append(ticket)
        return ticket

    def close(self, refusal: Callable[[], Unavailable]) -> None:
        """Admit nobody from now on: every queued ticket and every later ``reserve`` gets ``refusal()`` raised.

        Queued tickets are taken out of the queue at once (their ``wait`` raises when it wakes), so that
        ``wait_idle`` counts only the generations still running.
        """
        if self.refusal is not None:
            return
        self.refusal = refusal
        queued, self._queue = list(self._queue), deque()
        for ticket in queued:
            ticket._notify()
        self._changed.set()

    async def wait_idle(self) -> None:
        """Return once no generation holds a slot and nobody is queued."""
        while self.running or self._queue:
            self._changed.clear()
            await self._changed.wait()

    def position(self, ticket: Ticket) -> int:
        try:
            return self._queue.index(ticket) + 1
        except ValueError:
            return 0

    def retry_after(self) -> float:
        """Seconds until a newcomer would likely get a slot: the queue ahead of it, served ``slots`` at a time."""
        rounds = (len(self._queue) + 1) / self.slots
        return max(1.0, rounds * self._service_seconds)

    def _leave(self, ticket: Ticket) -> None:
        if ticket.admitted:
            held = time.perf_counter() - (ticket.admitted_at or ticket.created)
            self._service_seconds = 0.8 * self._service_seconds + 0.2 * held
            self.running -= 1
        else:
            with contextlib.suppress(ValueError):
                self._queue.remove(ticket)
        while self._queue and self.running < self.slots:
            self.running += 1
            self._queue.popleft()._admit()
        for waiting in self._queue:
            waiting._notify()
        self._changed.set()
