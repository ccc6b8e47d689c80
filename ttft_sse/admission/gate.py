"""Admission control: a bounded number of generations at once, and a bounded, prioritised queue for the rest.

A request either gets a slot, a place in the queue of its lane, or an immediate ``Overloaded`` (503 +
Retry-After) — decided before any response header is sent. When a slot frees, the head of the highest non-empty
lane is admitted: ``high`` before ``normal`` before ``low``, and overflow ``jobs`` only when no interactive
request waits. Within a lane it is first come, first served.

A queued request waits at most ``timeout`` seconds and sees its position each time it moves (a newcomer in a
higher lane moves it back). A request that leaves while queued frees its place at once. ``close`` (on shutdown)
refuses every queued request with the error it is given, and every newcomer after it; requests already admitted
keep their slots until they finish.

The high lane is admitted while fewer than ``slots + extra`` generations *of its own* run (the engine's rows: a step
of the continuous batch computes that many; ``TTFT_HIGH_EXTRA_SLOTS``), whatever the lower lanes hold: where its
requests and theirs want more rows than a step has, the batched engine leaves lower-lane generations out of steps in
turn (engine/library/turns.py), so a high request is queued, and refused where its target cannot be met, only when
high work alone fills the engine's rows. Lower lanes are admitted only while fewer than ``slots - reserved``
generations run, whichever lanes hold them.

Each ticket carries what the first-token prediction (ttft_sse/admission/targets.py) needs of the work it stands for: its
``max_tokens``, and once admitted, its tokens so far and when its first came.

*Patient* tickets (the job runners') wait without a deadline and do not count against ``max_queue``: their number
is bounded by the number of runners, and a job must never take a place an interactive request could have.

Retry-After is an estimate, not a constant: the requests ahead of a newcomer in its lane (or higher), served
``slots`` at a time, times the *median* slot hold time of the last :data:`SERVICE_WINDOW` generations of its lane
(of every lane, until its own has one), at least 1 s and at most :data:`MAX_RETRY_AFTER_SECONDS`. The median, not the
mean: a mean follows the few slow generations in the window (a long answer, a client that reads slowly), so the same
traffic gives anything from a few seconds to minutes, depending on how many of them the window happens to hold; the
median moves only once half the window is slow. Per lane, because lanes hold slots for different work (overflow jobs
run long answers).
"""

from __future__ import annotations

import asyncio
import enum
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable

from ttft_sse.errors import Overloaded, Unavailable

SERVICE_WINDOW = 32  # recent generations of a lane whose slot hold times make its Retry-After estimate
MAX_RETRY_AFTER_SECONDS = 60.0  # past this an estimate says little; a client should look again by then


def queue_seconds(ahead: int, servers: int, durations: Iterable[float]) -> float:
    """Seconds until a newcomer behind ``ahead`` others is served, ``servers`` at a time, each for the median of
    ``durations``: at least 1 s (1 s where nothing is measured yet) and at most :data:`MAX_RETRY_AFTER_SECONDS`.
    The median, so that a few slow runs in the window do not move it. Retry-After for jobs comes from it too."""
    measured = list(durations)
    if not measured:
        return 1.0
    return min(MAX_RETRY_AFTER_SECONDS, max(1.0, (ahead + 1) / max(1, servers) * statistics.median(measured)))


class Lane(enum.IntEnum):
    """Priority lanes, best first. API keys map to ``high``, ``normal`` or ``low``; ``jobs`` is for overflow jobs."""

    HIGH = 0
    NORMAL = 1
    LOW = 2
    JOBS = 3

    @property
    def label(self) -> str:
        return self.name.lower()


KEY_LANES: dict[str, Lane] = {lane.label: lane for lane in (Lane.HIGH, Lane.NORMAL, Lane.LOW)}


class Ticket:
    """One request's claim on the gate. Release it exactly once, admitted or not (``release`` is idempotent)."""

    def __init__(
        self,
        gate: Gate,
        lane: Lane,
        *,
        admitted: bool,
        patient: bool = False,
        deadline: Callable[[], Unavailable] | None = None,
        wait: float | None = None,
        max_tokens: int = 0,
    ) -> None:
        self._gate = gate
        self.lane = lane
        self.patient = patient
        self.admitted = admitted
        self.released = False
        self.created = time.perf_counter()
        self.admitted_at = self.created if admitted else None
        self.max_tokens = max_tokens  # the most tokens its generation makes (0: not said)
        self.tokens = 0  # generated so far (``produced``)
        self.first_at: float | None = None  # when its first token came (``perf_counter``)
        self._moved = asyncio.Event()
        # A wait shorter than the gate's, and the error that ends it (a lane's first-token target:
        # ttft_sse/admission/targets.py)
        self._wait = wait
        self._late = deadline

    @property
    def position(self) -> int:
        """1-based place among everyone who will be admitted first (higher lanes included); 0 once admitted."""
        return 0 if self.admitted else self._gate.position(self)

    @property
    def waited(self) -> float:
        return (self.admitted_at or time.perf_counter()) - self.created

    async def wait(self) -> AsyncIterator[int]:
        """Yield the queue position at once and each time it changes, until admitted.

        Raises ``Overloaded`` when the gate's timeout passes first (never for a patient ticket), and the gate's
        refusal when the gate is closed while this ticket waits.
        """
        longest = self._gate.timeout if self._wait is None else min(self._wait, self._gate.timeout)
        deadline = None if self.patient else self.created + longest
        last = 0
        while not self.admitted:
            if (refusal := self._gate.refusal) is not None:
                self.release()
                raise refusal()
            position = self.position
            if position != last:
                last = position
                yield position
                # Look again before sleeping: the consumer may take a while with the position (send it to a
                # client), and an admission, a move or a refusal meanwhile must not be slept through.
                continue
            self._moved.clear()  # nothing awaits between the look above and here: no wake-up can be lost
            remaining = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
            try:
                await asyncio.wait_for(self._moved.wait(), timeout=remaining)
            except TimeoutError:
                if not self.admitted:
                    self.release()
                    if self._late is not None and longest < self._gate.timeout:
                        raise self._late() from None
                    raise Overloaded(
                        f"waited {self._gate.timeout:g} s in the queue without a free generation slot",
                        retry_after=self._gate.retry_after(self.lane),
                    ) from None

    def produced(self, tokens: int, at: float) -> None:
        """``tokens`` more generated at ``at`` (``perf_counter``): how far the generation is, for the prediction."""
        if self.first_at is None:
            self.first_at = at
        self.tokens += tokens

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
    """``slots`` generations at once for the lower lanes, less ``reserved`` (all lanes' generations count), and
    ``slots + extra`` of the high lane's own (its generations alone count); at most ``max_queue`` requests waiting,
    each at most ``timeout`` seconds."""

    def __init__(self, *, slots: int, max_queue: int, timeout: float, reserved: int = 0, extra: int = 0) -> None:
        if not 0 <= reserved < slots:
            raise ValueError(f"a gate of {slots} slots can reserve 0 to {slots - 1} of them for the high lane")
        if extra < 0:
            raise ValueError(f"a gate's extra slots for the high lane are 0 or more, got {extra}")
        self.slots = slots
        self.reserved = reserved
        self.extra = extra
        self.max_queue = max_queue
        self.timeout = timeout
        self.running = 0
        self.running_high = 0  # of ``running``, the high lane's
        self._lanes: dict[Lane, deque[Ticket]] = {lane: deque() for lane in Lane}
        self._bounded = 0  # waiting tickets that count against max_queue (all but patient ones)
        # Recent slot hold times (seconds) by the lane of the ticket that held the slot.
        self._held: dict[Lane, deque[float]] = {lane: deque(maxlen=SERVICE_WINDOW) for lane in Lane}
        self.refusal: Callable[[], Unavailable] | None = None
        self._changed = asyncio.Event()
        self.holders: set[Ticket] = set()  # the admitted tickets not yet released: the generations running

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._lanes.values())

    def waiting_by_lane(self) -> dict[str, int]:
        return {lane.label: len(queue) for lane, queue in self._lanes.items()}

    @property
    def closed(self) -> bool:
        return self.refusal is not None

    def reserve(
        self,
        lane: Lane = Lane.NORMAL,
        *,
        patient: bool = False,
        wait: float | None = None,
        late: Callable[[], Unavailable] | None = None,
        max_tokens: int = 0,
    ) -> Ticket:
        """A ticket in ``lane``: admitted, queued, or ``Overloaded`` at once. A queued one waits at most the gate's
        timeout, or ``wait`` seconds where that is shorter; then ``late()`` is raised (else ``Overloaded``)."""
        if self.refusal is not None:
            raise self.refusal()
        # Invariant: a slot free for a lane means nobody of it or a better lane waits (``_leave`` admits the moment
        # one frees).
        if self._free_for(lane):
            self.running += 1
            self.running_high += lane is Lane.HIGH
            ticket = Ticket(self, lane, admitted=True, patient=patient, max_tokens=max_tokens)
            self.holders.add(ticket)
            return ticket
        if not patient and self._bounded >= self.max_queue:
            seconds = self.retry_after(lane)
            raise Overloaded(
                f"server is at capacity: {self.running} generations running and {self.waiting} waiting; "
                f"retry after {_whole(seconds)} s, or POST the same body to /jobs to run it later",
                retry_after=seconds,
            )
        ticket = Ticket(self, lane, admitted=False, patient=patient, deadline=late, wait=wait, max_tokens=max_tokens)
        self._lanes[lane].append(ticket)
        self._bounded += not patient
        self._notify_behind(lane)  # everyone in a lower lane just moved back one place
        return ticket

    def close(self, refusal: Callable[[], Unavailable]) -> None:
        """Admit nobody from now on: every queued ticket and every later ``reserve`` gets ``refusal()`` raised.

        Queued tickets are taken out of the queue at once (their ``wait`` raises when it wakes), so that
        ``wait_idle`` counts only the generations still running.
        """
        if self.refusal is not None:
            return
        self.refusal = refusal
        queued = [ticket for queue in self._lanes.values() for ticket in queue]
        for queue in self._lanes.values():
            queue.clear()
        self._bounded = 0
        for ticket in queued:
            ticket._notify()
        self._changed.set()

    async def wait_idle(self) -> None:
        """Return once no generation holds a slot and nobody is queued."""
        while self.running or self.waiting:
            self._changed.clear()
            await self._changed.wait()

    def position(self, ticket: Ticket) -> int:
        queue = self._lanes[ticket.lane]
        try:
            index = queue.index(ticket)
        except ValueError:
            return 0
        return sum(len(self._lanes[lane]) for lane in Lane if lane < ticket.lane) + index + 1

    def record_service(self, seconds: float, lane: Lane = Lane.NORMAL) -> None:
        """Note how long a ticket of ``lane`` held a slot (``_leave`` calls it for every admitted ticket)."""
        self._held[lane].append(seconds)

    def service_seconds(self, lane: Lane = Lane.NORMAL) -> float | None:
        """Median slot hold time of ``lane``'s last :data:`SERVICE_WINDOW` generations, or of every lane's while
        ``lane`` has none; None before any generation has ended."""
        held = self._held[lane] or [seconds for window in self._held.values() for seconds in window]
        return statistics.median(held) if held else None

    def retry_after(self, lane: Lane = Lane.NORMAL) -> float:
        """Seconds until a newcomer in ``lane`` would likely get a slot.

        Everyone already waiting in its lane or a better one goes first; the slots it may take serve them that
        many at a time, each for the median hold time (:meth:`service_seconds`). One second until a generation has
        been measured; never more than :data:`MAX_RETRY_AFTER_SECONDS`.
        """
        wait = self._queue_wait(lane)
        return 1.0 if wait is None else min(MAX_RETRY_AFTER_SECONDS, max(1.0, wait))

    def _leave(self, ticket: Ticket) -> None:
        if ticket.admitted:
            self.record_service(time.perf_counter() - (ticket.admitted_at or ticket.created), ticket.lane)
            self.running -= 1
            self.running_high -= ticket.lane is Lane.HIGH
            self.holders.discard(ticket)
        else:
            queue = self._lanes[ticket.lane]
            if ticket in queue:
                queue.remove(ticket)
                self._bounded -= not ticket.patient
        while True:
            # The best lane's head, if a slot is free for it. A lane below it is not looked at: where the best is
            # waiting for a slot, none is free for a lower one either (the lower lanes share one bound, and the high
            # lane waits only while its own generations fill every slot and the extra ones).
            head = next((queue for queue in self._lanes.values() if queue), None)
            if head is None or not self._free_for(head[0].lane):
                break
            admitted = head.popleft()
            self._bounded -= not admitted.patient
            self.running += 1
            self.running_high += admitted.lane is Lane.HIGH
            self.holders.add(admitted)
            admitted._admit()
        self._notify_behind(Lane.HIGH)
        self._changed.set()

    def _free_for(self, lane: Lane) -> bool:
        """A slot is free for ``lane``: fewer generations that count for it run than it may have (:meth:`usable`)."""
        return self.counted(lane) < self.usable(lane)

    def usable(self, lane: Lane) -> int:
        """Generations running below which ``lane`` is admitted: for the high lane, the engine's rows (every slot
        and the extra ones), counting its own generations; for the others, all but the reserved slots, counting
        every lane's."""
        return self.slots + self.extra if lane is Lane.HIGH else self.slots - self.reserved

    def counted(self, lane: Lane) -> int:
        """The generations running that count against ``lane``'s bound (:meth:`usable`)."""
        return self.running_high if lane is Lane.HIGH else self.running

    def holders_for(self, lane: Lane) -> list[Ticket]:
        """The admitted tickets that count against ``lane``'s bound: a slot frees for it as one of them ends."""
        return [ticket for ticket in self.holders if lane is not Lane.HIGH or ticket.lane is Lane.HIGH]

    def ahead(self, lane: Lane) -> list[Ticket]:
        """The tickets waiting that a newcomer of ``lane`` would be admitted after, in the order they will be."""
        return [ticket for other in Lane if other <= lane for ticket in self._lanes[other]]

    def slot_wait(self, lane: Lane) -> float | None:
        """Seconds until a newcomer in ``lane`` would have a slot: 0 when one is free for it now; else the requests
        ahead of it served ``slots`` at a time, each for the median hold time; None before any has been measured."""
        if not self._ahead(lane) and self._free_for(lane):
            return 0.0
        return self._queue_wait(lane)

    def _ahead(self, lane: Lane) -> int:
        """Requests waiting in ``lane`` or a better one: those admitted before a newcomer of ``lane``."""
        return sum(len(self._lanes[other]) for other in Lane if other <= lane)

    def _queue_wait(self, lane: Lane) -> float | None:
        """Those ahead and the newcomer, served by the slots ``lane`` may take, each for the median hold time."""
        median = self.service_seconds(lane)
        return None if median is None else (self._ahead(lane) + 1) / self.usable(lane) * median

    def _notify_behind(self, lane: Lane) -> None:
        """Wake every waiter whose position may have changed; each one re-reads it and reports only a change."""
        for other, queue in self._lanes.items():
            if other >= lane:
                for waiting in queue:
                    waiting._notify()


def _whole(seconds: float) -> int:
    return max(1, int(-(-seconds // 1)))
