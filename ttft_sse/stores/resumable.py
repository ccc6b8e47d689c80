"""Resumable streams: generations that outlive the connection reading them.

A :class:`Stream` runs one generation — the same ``Generations.open`` → ``Run.events`` path as every surface, so
admission, the engine, logging and the drain are shared — in a task of its own, and keeps what it produced in a
bounded buffer numbered from 0: each ``Piece`` (its number is its index), then one final item, the ``Finished``
or the error that ended it. A reader attaches with the number it wants next, gets what it missed from the
buffer, then the live rest: no duplicates, no gaps. One reader at a time: a new one takes over from the old,
because a client that reconnects after a network cut often does so before the server has noticed its old
connection die.

Lifetime, one rule: a stream that has had no reader for ``grace`` seconds expires. Its generation, if still
running, is cancelled (its thread ends, its slot is freed) and its buffer is dropped. That covers a stream nobody
attached to after creating it, a client whose connection dropped and who did not come back, and a finished stream
whose client has gone. Expired and deleted ids are remembered (bounded), so a late reconnect hears "expired",
not "unknown". Buffers hold at most ``buffer_events`` items (a ring: a reader further behind than that is told
so), and at most ``max_streams`` streams exist at once (finished ones nobody reads are evicted first).

Event ids are ``<stream id>.<n>``: an id names its stream, so one from another stream is refused instead of
being misread as a position in this one.

Two things are states, not history: the place in the admission queue (``Queued``) and, once admitted, how far a long
prompt is computed (``Progress``, from ``Run.progress_events``, at most a few a second). A stream keeps the latest of
each, replaced in place: neither is buffered, numbered or counted in ``buffer_events``, so ids count tokens and the
final item alone and ``Last-Event-ID`` resumes exactly as without them. A reader is told a state once per change,
while it has caught up with the buffer; a reader that attaches while the prompt computes hears where it is now, and
the first item clears both, so a reader that resumes after the first token (or reads the stream again) never hears
a stale one.

A stream belongs to the key that created it (its ``owner``, a key id; None on a server without keys): asked for by
another, it is not there (the 404 of an unknown id, and of an expired one too: nothing tells another key that it
existed). Who the asker is, is the HTTP layer's to say (``ttft_sse/admission/grants.py``). An id is a credential, so
logs carry its digest (``grants.digest``), never the id.

Where the streams live is one small interface, :class:`StreamStore`: this module's :class:`Streams` keeps them in
this process (the default), ``ttft_sse.stores.resumable_redis.RedisStreams`` keeps them in Redis, where every replica
that shares the Redis URL reads and deletes them. ``runtime.py`` picks one, as it picks the job store. Both keep the
rules above and the id rules of :func:`resume_point`, so a client cannot tell them apart on one replica.
"""

from __future__ import annotations

import asyncio
import contextvars
import secrets
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog

from ttft_sse.admission.grants import digest
from ttft_sse.engine.base import Finished, Piece, Progress
from ttft_sse.errors import Cancelled, Gone, InvalidRequest, NotFound, Overloaded, ServiceError
from ttft_sse.generation import Queued

if TYPE_CHECKING:
    from ttft_sse.generation import Run

log = structlog.get_logger("ttft_sse.streams")

Item = Piece | Finished | ServiceError
# How many expired or deleted ids are remembered per live-stream slot (for "expired" rather than "unknown").
TOMBSTONES_PER_STREAM = 16
# At shutdown: how long to wait for cancelled stream tasks (a decode step each) before leaving them.
CLOSE_SECONDS = 5.0


@dataclass(frozen=True)
class Entry:
    """One buffered item and its number in the stream."""

    seq: int
    item: Item


@dataclass(frozen=True)
class Position:
    """Where a reader resumes: the number of the first item to send, and whether it already has the final one."""

    stream_id: str
    start: int
    finished: bool


class StreamStore(Protocol):
    """Where resumable streams live: in this process (:class:`Streams`) or in Redis (``RedisStreams``).

    ``reserve`` / ``unreserve`` bracket the admission of a stream's generation; ``start`` runs it and returns the
    new stream's id (owned by the run's caller's key); ``locate`` checks that the stream is ``owner``'s and a reader's
    ``Last-Event-ID`` (404, 410 or 400 before any response starts); ``follow`` yields from there to the final item,
    with the queue position and the prompt's progress as they change (states, not history: no number);
    ``delete`` cancels the generation wherever it runs (``owner``'s streams only); ``close`` ends this process's part
    at shutdown.
    """

    def reserve(self) -> None: ...

    def unreserve(self) -> None: ...

    async def start(self, run: Run) -> str: ...

    async def locate(self, stream_id: str, last_event_id: str | None, owner: str | None) -> Position: ...

    def follow(self, position: Position) -> AsyncGenerator[Entry | Queued | Progress, None]: ...

    async def delete(self, stream_id: str, owner: str | None) -> None: ...

    async def close(self) -> None: ...


def event_id(stream_id: str, seq: int) -> str:
    return f"{stream_id}.{seq}"


def unknown(stream_id: str) -> NotFound:
    """What an id that names no stream of the asker's gets: unknown, or another key's."""
    return NotFound(f"no stream {stream_id!r}; create one with POST /streams", code="stream_not_found")


def resume_point(stream_id: str, last_event_id: str | None, *, last: int, first: int, kept: int) -> int:
    """The number of the first item to send to a reader whose last event was ``last_event_id`` (None: 0).

    ``last`` is the number of the newest item (-1 before the first), ``first`` the oldest still kept, ``kept``
    how many a buffer keeps. Raises ``InvalidRequest`` for an id that is malformed, from another stream, or not
    sent yet, and ``Gone`` when the items after it have already left the bounded buffer.
    """
    start = 0
    if last_event_id:
        owner, dot, number = last_event_id.rpartition(".")
        if not dot or not (number.isascii() and number.isdigit()) or len(number) > 12:
            raise InvalidRequest(
                f"Last-Event-ID {last_event_id!r} is not an event id of this server (<stream id>.<n>)",
                param="Last-Event-ID",
                code="invalid_event_id",
            )
        if owner != stream_id:
            raise InvalidRequest(
                f"Last-Event-ID {last_event_id!r} belongs to another stream, not {stream_id}",
                param="Last-Event-ID",
                code="foreign_event_id",
            )
        seq = int(number)
        if seq > last:
            raise InvalidRequest(
                f"Last-Event-ID {last_event_id!r} was never sent: stream {stream_id} has sent events up to "
                f"{event_id(stream_id, last) if last >= 0 else 'none yet'}",
                param="Last-Event-ID",
                code="foreign_event_id",
            )
        start = seq + 1
    if start < first:
        raise dropped(stream_id, start, first=first, kept=kept)
    return start


def too_many_streams(held: str, grace: float) -> Overloaded:
    """The refusal of a new stream by a store at ``TTFT_MAX_STREAMS``: ``held`` says what it holds (each store counts
    its own kind of stream); retry after ``grace``."""
    return Overloaded(
        f"{held} (TTFT_MAX_STREAMS); retry, or end streams you no longer read with DELETE",
        retry_after=grace,
        code="too_many_streams",
    )


def dropped(stream_id: str, start: int, *, first: int, kept: int) -> Gone:
    return Gone(
        f"stream {stream_id} no longer holds event {start}: its buffer keeps the last "
        f"{kept} events (from {first} now); start a new stream",
        code="events_dropped",
    )


class Stream:
    """One generation and its buffer. Made by :meth:`Streams.start`; read with :meth:`resume_point` + :meth:`follow`."""

    def __init__(self, registry: Streams, stream_id: str, *, buffer_events: int, owner: str | None = None) -> None:
        self.id = stream_id
        self.owner = owner  # the key id of the key that created it; None without keys
        self._registry = registry
        self.kept = buffer_events
        self._entries: deque[Entry] = deque(maxlen=buffer_events)
        self._next = 0
        self.position = 0  # place in the admission queue while queued; 0 once admitted (or not yet known)
        self.progress: Progress | None = None  # how far the prompt is computed, once admitted; None from the 1st item
        self.final: Entry | None = None
        self.closed = False  # removed from the registry (expired or deleted) ...
        self.gone = ""  # ... and why
        self._changed = asyncio.Event()
        self._reader: object | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def ended(self) -> bool:
        return self.final is not None

    @property
    def attached(self) -> bool:
        return self._reader is not None

    @property
    def buffered(self) -> int:
        return len(self._entries)

    @property
    def first(self) -> int:
        """The number of the oldest item still buffered (the next one to come, when none is)."""
        return self._entries[0].seq if self._entries else self._next

    @property
    def last(self) -> int:
        """The number of the newest item; -1 before the first."""
        return self._next - 1

    def event_id(self, seq: int) -> str:
        return event_id(self.id, seq)

    def resume_point(self, last_event_id: str | None) -> int:
        """The number of the first item to send to a reader whose last event was ``last_event_id`` (None: 0);
        see :func:`resume_point`."""
        return resume_point(self.id, last_event_id, last=self.last, first=self.first, kept=self.kept)

    def _dropped(self, start: int) -> Gone:
        return dropped(self.id, start, first=self.first, kept=self.kept)

    async def follow(self, start: int) -> AsyncGenerator[Entry | Queued | Progress, None]:
        """Attach as the stream's reader: buffered items from ``start``, then live ones, until the final item.

        While the generation waits for a slot, ``Queued`` tells the position, and then ``Progress`` how far its
        prompt is computed (not buffered: they are states, not history). Ends early, quietly, when another reader
        takes over; raises ``Gone`` if this reader falls more than the buffer behind. Detaching (closing this
        iterator) starts the expiry clock.
        """
        if self.closed:  # expired or deleted between the request's checks and this first step
            raise Gone(f"stream {self.id} is gone: {self.gone}", code="stream_expired")
        me = object()
        replaced = self._reader is not None
        self._reader = me
        self._registry._attached(self, start=start, replaced=replaced)
        if replaced:
            self._notify()  # the old reader wakes, sees it is no longer the reader, and ends
        cursor, told, told_progress = start, 0, None
        try:
            while True:
                changed = self._changed
                if self._reader is not me or (self.closed and cursor >= self._next):
                    return
                if cursor < self._next:
                    first = self.first
                    if cursor < first:
                        raise self._dropped(cursor)
                    yield self._entries[cursor - first]
                    cursor += 1
                    continue
                if self.final is not None:
                    return
                if self.position and self.position != told:
                    told = self.position
                    yield Queued(told)
                    continue
                if self.progress is not None and self.progress != told_progress:
                    told_progress = self.progress
                    yield told_progress
                    continue
                await changed.wait()
        finally:
            if self._reader is me:
                self._reader = None
                self._registry._detached(self, sent=cursor - start)

    def _publish(self, item: Item) -> None:
        if self.final is not None or self.closed:
            return
        entry = Entry(self._next, item)
        self._next += 1
        self._entries.append(entry)
        self.position, self.progress = 0, None
        if not isinstance(item, Piece):
            self.final = entry
        self._notify()

    def _queued(self, position: int) -> None:
        self.position = position
        self._notify()

    def _progressed(self, progress: Progress) -> None:
        if self.final is not None or self.closed or self._next:  # the first item has come: no prompt to tell of
            return
        self.position, self.progress = 0, progress
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class Streams:
    """The registry of live streams: creates them, finds them, expires and deletes them, and ends them all."""

    def __init__(self, *, grace: float, max_streams: int, buffer_events: int) -> None:
        self.grace = grace
        self.max_streams = max_streams
        self.buffer_events = buffer_events
        self._live: dict[str, Stream] = {}
        self._gone: OrderedDict[str, tuple[str, str | None]] = OrderedDict()  # id → why it is gone, its owner
        self._tasks: set[asyncio.Task[None]] = set()
        self._reserved = 0  # places held for streams whose generation is being admitted

    def __len__(self) -> int:
        return len(self._live)

    @property
    def buffered(self) -> int:
        """Items held in all buffers together."""
        return sum(stream.buffered for stream in self._live.values())

    def reserve(self) -> None:
        """Hold a place for one stream, or raise ``Overloaded``. Call before admitting its generation; then
        :meth:`start` (which takes the place) or :meth:`unreserve` (if admission failed)."""
        if len(self._live) + self._reserved >= self.max_streams and not self._evict():
            raise too_many_streams(f"{len(self._live)} streams are open, the most this server keeps", self.grace)
        self._reserved += 1

    def unreserve(self) -> None:
        self._reserved -= 1

    async def start(self, run: Run) -> str:
        """Register a stream for ``run`` in a place taken with :meth:`reserve`, start generating at once, and
        return its id."""
        return self.open(run).id

    def open(self, run: Run) -> Stream:
        """:meth:`start`, returning the stream itself."""
        self._reserved -= 1
        stream = Stream(self, secrets.token_urlsafe(12), buffer_events=self.buffer_events, owner=run.caller.key_id)
        self._live[stream.id] = stream
        task = asyncio.create_task(self._pump(stream, run), name=f"ttft-stream-{digest(stream.id)}")
        stream.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._arm(stream)  # nobody reads it yet: a client that never attaches does not keep it alive
        log.info("stream_created", stream=digest(stream.id), prompt_tokens=run.prompt.n_tokens)
        return stream

    def get(self, stream_id: str, owner: str | None = None) -> Stream:
        """The live stream ``stream_id`` of ``owner`` (a key id; None without keys); ``Gone`` once it has gone,
        ``NotFound`` for an unknown id or another key's stream."""
        stream = self._live.get(stream_id)
        if stream is not None and stream.owner == owner:
            return stream
        gone = self._gone.get(stream_id)
        if stream is None and gone is not None and gone[1] == owner:
            raise Gone(f"stream {stream_id} is gone: {gone[0]}", code="stream_expired")
        raise unknown(stream_id)

    async def locate(self, stream_id: str, last_event_id: str | None, owner: str | None) -> Position:
        stream = self.get(stream_id, owner)
        start = stream.resume_point(last_event_id)
        return Position(stream.id, start, finished=stream.ended and start > stream.last)

    async def follow(self, position: Position) -> AsyncGenerator[Entry | Queued | Progress, None]:
        # Again: the stream may have gone since locate(); follow() then says so (Gone).
        stream = self._live.get(position.stream_id)
        if stream is None:
            gone = self._gone.get(position.stream_id, ("it has gone", None))[0]
            raise Gone(f"stream {position.stream_id} is gone: {gone}", code="stream_expired")
        async with aclosing(stream.follow(position.start)) as entries:
            async for entry in entries:
                yield entry

    async def delete(self, stream_id: str, owner: str | None) -> None:
        self.drop(stream_id, owner)

    def drop(self, stream_id: str, owner: str | None = None) -> None:
        """Stop the stream's generation (if running) and drop it. A reader still attached gets a final error."""
        stream = self.get(stream_id, owner)
        running = not stream.ended
        stream._publish(Cancelled(f"stream {stream.id} was deleted; its generation was cancelled", code="cancelled"))
        self._remove(stream, "it was deleted")
        log.info("stream_deleted", stream=digest(stream.id), was_running=running)

    async def close(self) -> None:
        """Cancel every stream's generation and wait (bounded) for their tasks: the server is stopping."""
        for stream in list(self._live.values()):
            self._remove(stream, "the server stopped")
        tasks = list(self._tasks)
        if tasks:
            with anyio.move_on_after(CLOSE_SECONDS):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, stream: Stream, run: Run) -> None:
        structlog.contextvars.bind_contextvars(stream=digest(stream.id))  # this task's context only
        try:
            async with aclosing(run.progress_events()) as events:
                async for item in events:
                    if isinstance(item, Queued):
                        stream._queued(item.position)
                    elif isinstance(item, Progress):
                        stream._progressed(item)
                    else:
                        stream._publish(item)
        except ServiceError as exc:
            stream._publish(exc)
        except Exception as exc:  # never a traceback on the wire; the log has it
            log.exception("stream_failed", error_type=type(exc).__name__)
            stream._publish(ServiceError("internal server error"))
        finally:
            run.close()  # the ticket, if events() never started (cancelled at once)

    def _arm(self, stream: Stream) -> None:
        if stream._expiry is not None:
            stream._expiry.cancel()
        loop = asyncio.get_running_loop()
        # A context of its own: the expiry is nobody's request (it would log under the last reader's id).
        stream._expiry = loop.call_later(self.grace, self._expire, stream, context=contextvars.Context())

    def _attached(self, stream: Stream, *, start: int, replaced: bool) -> None:
        if stream._expiry is not None:
            stream._expiry.cancel()
            stream._expiry = None
        log.info(
            "stream_attached",
            stream=digest(stream.id),
            start=start,
            replay=max(0, stream.last + 1 - start),
            replaced=replaced,
            ended=stream.ended,
        )

    def _detached(self, stream: Stream, *, sent: int) -> None:
        log.info("stream_detached", stream=digest(stream.id), sent=sent, ended=stream.ended)
        if not stream.closed:
            self._arm(stream)

    def _expire(self, stream: Stream) -> None:
        if stream.closed or stream.attached:
            return
        if stream.ended:
            why = f"it ended, and nobody read it for {self.grace:g} s (TTFT_RESUME_GRACE_SECONDS)"
        else:
            why = (
                f"no client was attached for {self.grace:g} s (TTFT_RESUME_GRACE_SECONDS); its generation was cancelled"
            )
        log.info("stream_expired", stream=digest(stream.id), ended=stream.ended, events=stream.last + 1)
        self._remove(stream, why)

    def _evict(self) -> bool:
        """Make room by dropping the oldest stream that has ended and has no reader; False if there is none."""
        for stream in self._live.values():  # insertion order: oldest first
            if stream.ended and not stream.attached:
                log.info("stream_evicted", stream=digest(stream.id))
                self._remove(stream, f"it ended and was evicted to make room (TTFT_MAX_STREAMS={self.max_streams})")
                return True
        return False

    def _remove(self, stream: Stream, why: str) -> None:
        stream.closed, stream.gone = True, why
        if stream._expiry is not None:
            stream._expiry.cancel()
            stream._expiry = None
        self._live.pop(stream.id, None)
        self._gone[stream.id] = (why, stream.owner)
        while len(self._gone) > self.max_streams * TOMBSTONES_PER_STREAM:
            self._gone.popitem(last=False)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()  # Run.events ends through its finally: ticket released, outcome logged
        if not stream.attached:
            stream._entries.clear()  # nobody can read it any more; a reader still attached keeps what it needs
        stream._notify()
