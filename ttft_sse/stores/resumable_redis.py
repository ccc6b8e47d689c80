"""Resumable streams in Redis: every replica that shares ``TTFT_REDIS_URL`` resumes, follows and deletes them.

The replica that takes ``POST /streams`` owns the stream: it runs the generation (the same ``Run.events`` path as
every surface) and writes each item to a Redis Stream as it is made. Any replica serves ``GET /streams/{id}``
from Redis: ``XREAD`` from the reader's resume point, blocking for what comes next, so a reconnect that a load
balancer sends elsewhere gets exactly what it missed and then the live rest. The rules are those of
:mod:`ttft_sse.stores.resumable` (ids, grace, bounded buffers, one reader at a time); what differs is who enforces
them::

    ttft:stream:{<id>}          hash    owner (replica), key (the creator's key id, "" without keys), state (live |
                                        ended | gone), last (newest item's number), position
                                        (in the owner's admission queue), progress ("<computed> <prompt tokens>"
                                        until the first item), why (once gone); a tombstone for
                                        TOMBSTONE_SECONDS after the stream has gone, so a late reconnect hears 410
    ttft:stream:{<id>}:events   stream  item n at entry id 0-(n+1); exactly MAXLEN buffer_events entries kept
    ttft:stream:{<id>}:alive    string  exists while the stream has had a reader within the grace (TTL = grace)
    ttft:stream:{<id>}:reader   string  the attached reader's token (TTL = LEASE_SECONDS, renewed every POLL_SECONDS)
    ttft:replica:<owner>        string  the owner's heartbeat (TTL = LEASE_SECONDS, renewed every POLL_SECONDS)

(The braces keep one stream's keys in one Redis Cluster slot, as the Lua scripts that touch several need.)

* Appending is a script that checks the stream is still ``live`` and that the item is the next one, so once a
  final item is there (done, error, cancelled, owner lost) nothing follows it, whoever wrote it.
* ``DELETE`` on any replica appends the final ``cancelled`` event and marks the stream gone; the owner's next
  append is refused and its generation ends there, and its heartbeat loop looks at each stream it runs every
  ``POLL_SECONDS``, so a generation still queued (no appends) ends too.
* The grace is the ``alive`` key's TTL: readers renew it while attached, and it runs out ``grace`` after the
  last one left. The owner's heartbeat loop then cancels a generation still running; any replica that is asked
  for the stream after that answers 410.
* A reader whose stream is live while the owner's heartbeat key has gone (the owner was killed, or lost Redis)
  appends the final ``error`` (code ``owner_lost``) itself: every reader, on every replica, ends with that same
  event within ``LEASE_SECONDS`` + ``POLL_SECONDS``. A stopping replica removes its heartbeat at once.
* The queue position and the prompt's progress are states, not history: hash fields, never entries of the Redis
  Stream (no id, no place in its MAXLEN), cleared by the first item. While the prompt computes, readers block
  ``PROGRESS_SECONDS`` on ``XREAD``, not ``POLL_SECONDS``: a hash field's change does not wake an ``XREAD``.
* ``max_streams`` bounds the generations this replica runs for streams; finished streams live in Redis, with
  expiries, not in the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import socket
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, cast

import anyio
import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ttft_sse.admission.grants import digest
from ttft_sse.engine.base import Finished, Piece, Progress, Usage
from ttft_sse.errors import Cancelled, Gone, ServiceError, Unavailable, redis_unavailable
from ttft_sse.generation import PROGRESS_SECONDS, Queued
from ttft_sse.settings import Settings
from ttft_sse.stores.redis_scripts import APPEND, DETACH, END, EXPIRE, STATE
from ttft_sse.stores.resumable import Entry, Item, Position, dropped, resume_point, too_many_streams, unknown

if TYPE_CHECKING:
    from ttft_sse.generation import Run

log = structlog.get_logger("ttft_sse.redis_streams")

# How often readers and the owner look at Redis (and renew their keys); a reader's XREAD blocks at most this long.
POLL_SECONDS = 1.0
# A heartbeat or reader key not renewed for this long is taken as gone: an owner killed mid-stream is noticed by
# its readers within LEASE_SECONDS + POLL_SECONDS.
LEASE_SECONDS = 4.0
# How long a gone stream's id is remembered (410 rather than 404).
TOMBSTONE_SECONDS = 3600
# After a stream has gone, how long its events stay for a reader still attached to read the final one.
GONE_EVENTS_SECONDS = 10
# At shutdown: how long to let stream tasks write what they have (their generations have drained).
CLOSE_SECONDS = 2.0
READ_BATCH = 256
STREAM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Keys:
    """The Redis keys of one stream."""

    def __init__(self, stream_id: str) -> None:
        base = f"ttft:stream:{{{stream_id}}}"
        self.meta = base
        self.events = base + ":events"
        self.alive = base + ":alive"
        self.reader = base + ":reader"


def replica_key(owner: str) -> str:
    return f"ttft:replica:{owner}"


def encode(item: Item) -> tuple[str, str]:
    """(kind, JSON) of an item, as stored in the Redis Stream."""
    if isinstance(item, Piece):
        return "piece", json.dumps({"index": item.index, "text": item.text}, ensure_ascii=False)
    if isinstance(item, Finished):
        usage = {
            "prompt_tokens": item.usage.prompt_tokens,
            "completion_tokens": item.usage.completion_tokens,
            "cached_tokens": item.usage.cached_tokens,
        }
        body = {"finish_reason": item.finish_reason, "usage": usage, "timings": item.timings, "degraded": item.degraded}
        return "finished", json.dumps(body)
    return "error", json.dumps(item.to_dict(), ensure_ascii=False)


def decode(kind: str, data: str) -> Item:
    body = json.loads(data)
    if kind == "piece":
        return Piece(body["index"], body["text"])
    if kind == "finished":
        usage = Usage(
            body["usage"]["prompt_tokens"],
            body["usage"]["completion_tokens"],
            body["usage"].get("cached_tokens", 0),
        )
        return Finished(body["finish_reason"], usage, body["timings"], degraded=body.get("degraded", False))
    return ServiceError.from_dict(body)


class RedisStreams:
    """The stream store of a server with ``TTFT_REDIS_URL``: streams in Redis, readable on every replica."""

    def __init__(self, settings: Settings) -> None:
        assert settings.redis_url
        self.grace = settings.resume_grace_seconds
        self.max_streams = settings.max_streams
        self.buffer_events = settings.stream_buffer_events
        # This replica, as readers elsewhere see it (its heartbeat key): host and pid for the log, a random part
        # so that a restarted process with the same pid is not taken for the old one.
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._redis: Redis = Redis.from_url(settings.redis_url, decode_responses=True)
        self._append = self._redis.register_script(APPEND)
        self._state = self._redis.register_script(STATE)
        self._end = self._redis.register_script(END)
        self._expire = self._redis.register_script(EXPIRE)
        self._detach = self._redis.register_script(DETACH)
        self._running: dict[str, asyncio.Task[None]] = {}  # streams whose generation this replica runs
        self._reserved = 0
        self._beat: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()

    @property
    def _ttl(self) -> int:
        """Seconds an untouched stream's events (and the alive key's margin) last: the grace and a lease more."""
        return max(1, round(self.grace + LEASE_SECONDS))

    @property
    def _meta_ttl(self) -> int:
        return self._ttl + TOMBSTONE_SECONDS

    def reserve(self) -> None:
        if len(self._running) + self._reserved >= self.max_streams:
            held = f"{len(self._running)} streams are generating on this server, the most it runs"
            raise too_many_streams(held, self.grace)
        self._reserved += 1

    def unreserve(self) -> None:
        self._reserved -= 1

    async def start(self, run: Run) -> str:
        """Register the stream in Redis (readable on every replica from now), then start generating."""
        self._reserved -= 1
        stream_id = secrets.token_urlsafe(12)
        keys = Keys(stream_id)
        try:
            with redis_unavailable("the stream store"):
                await self._heartbeat()
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.hset(
                        keys.meta,
                        mapping={
                            "owner": self.owner,
                            "key": run.caller.key_id or "",
                            "state": "live",
                            "last": -1,
                            "position": 0,
                        },
                    )
                    pipe.expire(keys.meta, self._meta_ttl)
                    pipe.set(keys.alive, "1", px=round(self.grace * 1000))
                    await pipe.execute()
        except BaseException:
            run.close()
            raise
        task = asyncio.create_task(self._pump(stream_id, run), name=f"ttft-stream-{digest(stream_id)}")
        self._running[stream_id] = task
        task.add_done_callback(lambda _: self._running.pop(stream_id, None))
        if self._beat is None:
            self._beat = asyncio.create_task(self._beat_loop(), name="ttft-stream-heartbeat")
        log.info("stream_created", stream=digest(stream_id), prompt_tokens=run.prompt.n_tokens, owner=self.owner)
        return stream_id

    async def locate(self, stream_id: str, last_event_id: str | None, owner: str | None) -> Position:
        if not STREAM_ID.fullmatch(stream_id):
            raise unknown(stream_id)
        keys = Keys(stream_id)
        with redis_unavailable("the stream store"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hmget(keys.meta, ["state", "last", "why", "key"])
                pipe.exists(keys.alive, keys.reader)
                pipe.xrange(keys.events, "-", "+", count=1)
                (state, last_text, why, key), alive, oldest = await pipe.execute()
            if state is None or (key or None) != owner:
                raise unknown(stream_id)
            if state != "gone" and not alive:
                state, why = await self._expire_now(stream_id)
        if state == "missing":
            raise unknown(stream_id)
        if state == "gone":
            raise Gone(f"stream {stream_id} is gone: {why}", code="stream_expired")
        last = int(last_text)
        first = _seq(oldest[0][0]) if oldest else last + 1
        start = resume_point(stream_id, last_event_id, last=last, first=first, kept=self.buffer_events)
        return Position(stream_id, start, finished=state == "ended" and start > last)

    async def follow(self, position: Position) -> AsyncGenerator[Entry | Queued | Progress, None]:
        """Attach as the stream's reader (taking over from any other, on any replica) and read from Redis until
        the final item. Renews the reader and alive keys every ``POLL_SECONDS``; ends quietly when another reader
        takes over or this server stops; writes the final ``owner_lost`` error when the owner's heartbeat is gone.
        """
        stream_id, cursor = position.stream_id, position.start
        keys = Keys(stream_id)
        token = secrets.token_hex(8)
        lease_ms, grace_ms = round(LEASE_SECONDS * 1000), round(self.grace * 1000)
        with redis_unavailable("the stream store"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(keys.reader, token, px=lease_ms, get=True)
                pipe.pexpire(keys.alive, grace_ms)
                pipe.hget(keys.meta, "owner")
                replaced, _, owner = await pipe.execute()
        log.info("stream_attached", stream=digest(stream_id), start=cursor, replaced=replaced is not None)
        told, told_progress, sent = 0, "", 0
        got = True  # the last read brought entries (none made yet counts as "go on reading")
        try:
            while not self._closing.is_set():
                with redis_unavailable("the stream store"):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        pipe.get(keys.reader)
                        pipe.pexpire(keys.alive, grace_ms)
                        pipe.expire(keys.events, self._ttl)
                        pipe.hmget(keys.meta, ["state", "last", "position", "progress"])
                        pipe.exists(replica_key(owner or ""))
                        reader, _, _, (state, last, queued, progress), owner_alive = await pipe.execute()
                    if reader is None:  # this reader's key lapsed (a slow client held the loop): take it back
                        await self._redis.set(keys.reader, token, px=lease_ms, nx=True)
                    elif reader != token:
                        log.info("stream_replaced", stream=digest(stream_id), sent=sent)
                        return
                    else:
                        await self._redis.pexpire(keys.reader, lease_ms)
                    if state is None or (state == "gone" and (not got or cursor > int(last))):
                        return  # gone, and its final item (if it had one) was read or has expired
                    if state == "live" and not owner_alive:
                        await self._owner_lost(stream_id, owner or "")
                # The queue position and the prompt's progress are states, told once per change, until the first item.
                place = int(queued or 0)
                if place and place != told:
                    told = place
                    yield Queued(told)
                computing = state == "live" and last == "-1" and not place
                if computing and progress and progress != told_progress:
                    told_progress = progress
                    computed, prompt_tokens = progress.split()
                    yield Progress(int(prompt_tokens), int(computed))
                wait = PROGRESS_SECONDS if computing else POLL_SECONDS
                with redis_unavailable("the stream store"):
                    reply: list[tuple[str, list[tuple[str, dict[str, str]]]]] = await self._redis.xread(
                        {keys.events: f"0-{cursor}"}, count=READ_BATCH, block=round(wait * 1000)
                    )  # type: ignore[assignment]  # redis-py types the RESP2 reply loosely
                got = False
                for _, entries in reply:
                    for entry_id, fields in entries:
                        seq = _seq(entry_id)
                        if seq > cursor:  # trimmed while this reader was behind: as in the in-process ring
                            raise dropped(stream_id, cursor, first=seq, kept=self.buffer_events)
                        item = decode(fields["kind"], fields["data"])
                        yield Entry(seq, item)
                        cursor, got, sent = cursor + 1, True, sent + 1
                        if not isinstance(item, Piece):
                            return
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(POLL_SECONDS), contextlib.suppress(RedisError):
                # The grace runs from now; the lapse of the reader key would start it within a lease anyway.
                await self._detach(keys=[keys.reader], args=[token])
                await self._redis.pexpire(keys.alive, grace_ms)
            log.info("stream_detached", stream=digest(stream_id), sent=sent)

    async def delete(self, stream_id: str, owner: str | None) -> None:
        """Append the final ``cancelled`` event and mark the stream gone; its owner stops at its next append or
        heartbeat. Only ``owner``'s streams (the creator's key id is never changed, so checking it first is enough)."""
        if not STREAM_ID.fullmatch(stream_id):
            raise unknown(stream_id)
        final = Cancelled(f"stream {stream_id} was deleted; its generation was cancelled", code="cancelled")
        with redis_unavailable("the stream store"):
            key = await self._redis.hget(Keys(stream_id).meta, "key")
            if key is None or (key or None) != owner:
                raise unknown(stream_id)
            was, why = await self._end_stream(stream_id, final, state="gone", why="it was deleted")
        if was == "missing":
            raise unknown(stream_id)
        if was == "gone":
            raise Gone(f"stream {stream_id} is gone: {why}", code="stream_expired")
        task = self._running.get(stream_id)
        if task is not None:
            task.cancel()  # this replica owns it: stop now rather than at the next append
        log.info("stream_deleted", stream=digest(stream_id), was_running=was == "live")

    async def close(self) -> None:
        """Stop being an owner: let stream tasks write what their drained generations made, cancel the rest, and
        remove the heartbeat so that readers elsewhere end those streams at once (``owner_lost``)."""
        self._closing.set()
        tasks = list(self._running.values())
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_SECONDS)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
        with contextlib.suppress(RedisError):
            await self._redis.delete(replica_key(self.owner))
        await self._redis.aclose()

    # -- the owner's side ------------------------------------------------------------------------------------------

    async def _pump(self, stream_id: str, run: Run) -> None:
        structlog.contextvars.bind_contextvars(stream=digest(stream_id))  # this task's context only
        keys = Keys(stream_id)
        seq = 0

        async def put(item: Item) -> bool:
            kind, data = encode(item)
            final = "0" if isinstance(item, Piece) else "1"
            args: list[str | int] = [seq, kind, data, final, self.buffer_events, self._ttl, self._meta_ttl]
            outcome = await self._append(keys=[keys.meta, keys.events], args=args)
            return bool(outcome == "ok")

        try:
            async with aclosing(run.progress_events()) as events:
                async for item in events:
                    if isinstance(item, Queued):
                        await self._state(keys=[keys.meta], args=["position", item.position])
                        continue
                    if isinstance(item, Progress):
                        progress = f"{item.computed} {item.prompt_tokens}"
                        await self._state(keys=[keys.meta], args=["position", 0, "progress", progress])
                        continue
                    if not await put(item):
                        log.info("stream_generation_stopped", reason="the stream was deleted or has expired")
                        return  # leaving the loop closes events(): the generation is cancelled
                    seq += 1
        except ServiceError as exc:
            with contextlib.suppress(RedisError):
                await put(exc)
        except RedisError as exc:
            # Nobody can read what it makes: stop. Readers see the heartbeat go, or the stream expire.
            log.error("stream_store_failed", error_type=type(exc).__name__, error=str(exc))
        except Exception as exc:  # never a traceback on the wire; the log has it
            log.exception("stream_failed", error_type=type(exc).__name__)
            with contextlib.suppress(RedisError):
                await put(ServiceError("internal server error"))
        finally:
            run.close()  # the ticket, if events() never started (cancelled at once)

    async def _heartbeat(self) -> None:
        await self._redis.set(replica_key(self.owner), "1", px=round(LEASE_SECONDS * 1000))

    async def _beat_loop(self) -> None:
        """Every ``POLL_SECONDS``: renew the heartbeat, and stop generations whose stream has gone (deleted
        elsewhere) or has had no reader for the grace."""
        failing = False
        while True:
            try:
                await self._heartbeat()
                running = list(self._running)
                if running:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for stream_id in running:
                            keys = Keys(stream_id)
                            pipe.hget(keys.meta, "state")
                            pipe.exists(keys.alive, keys.reader)
                        replies = await pipe.execute()
                    for i, stream_id in enumerate(running):
                        state, alive = replies[2 * i], replies[2 * i + 1]
                        if state in (None, "gone") or (not alive and (await self._expire_now(stream_id))[0] == "gone"):
                            task = self._running.get(stream_id)
                            if task is not None:
                                task.cancel()
                if failing:
                    log.info("stream_heartbeat_restored")
                failing = False
            except RedisError as exc:
                if not failing:
                    log.error("stream_heartbeat_failed", error_type=type(exc).__name__, error=str(exc))
                failing = True
            await asyncio.sleep(POLL_SECONDS)

    # -- shared steps ----------------------------------------------------------------------------------------------

    async def _expire_now(self, stream_id: str) -> tuple[str, str]:
        """Expire a stream whose alive key has lapsed (unless a reader has just come); returns (state, why)."""
        keys = Keys(stream_id)
        ended = f"it ended, and nobody read it for {self.grace:g} s (TTFT_RESUME_GRACE_SECONDS)"
        live = f"no client was attached for {self.grace:g} s (TTFT_RESUME_GRACE_SECONDS); its generation was cancelled"
        outcome, why, before = await self._expire(
            keys=[keys.meta, keys.events, keys.alive, keys.reader],
            args=[ended, live, TOMBSTONE_SECONDS, GONE_EVENTS_SECONDS],
        )
        if outcome == "expired":
            log.info("stream_expired", stream=digest(stream_id), ended=before == "ended")
        if outcome in ("expired", "gone"):
            return "gone", why
        return before, ""

    async def _end_stream(self, stream_id: str, final: ServiceError, *, state: str, why: str) -> tuple[str, str]:
        keys = Keys(stream_id)
        kind, data = encode(final)
        args: list[str | int] = [kind, data, state, why, self.buffer_events, TOMBSTONE_SECONDS, GONE_EVENTS_SECONDS]
        was, previous_why = await self._end(keys=[keys.meta, keys.events, keys.alive], args=args)
        return cast(str, was), cast(str, previous_why)

    async def _owner_lost(self, stream_id: str, owner: str) -> None:
        final = Unavailable(
            f"the server running stream {stream_id} stopped answering (its heartbeat lapsed); "
            f"the answer is incomplete: start a new stream",
            code="owner_lost",
        )
        with redis_unavailable("the stream store"):
            was, _ = await self._end_stream(stream_id, final, state="ended", why="")
        if was == "live":
            log.warning("stream_owner_lost", stream=digest(stream_id), owner=owner)


def _seq(entry_id: str) -> int:
    """The item number of Redis Stream entry ``0-(n+1)``."""
    return int(entry_id.partition("-")[2]) - 1
