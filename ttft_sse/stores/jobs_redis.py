"""Jobs on Celery + Redis: any number of ``ttft-sse worker`` processes, on any machines, drain one queue.

A server (:class:`RedisJobs`) writes each job as a Redis hash ``ttft:job:<id>`` and publishes a Celery task
that carries only the id; every server that shares the Redis URL can answer ``/result/<id>``. A worker is a
Celery prefork worker: each pool process loads and warms the model once (``worker_process_init``), then runs
one job at a time through the same ``Generations`` path a request takes.

How a job survives its worker (Celery semantics first, our record second):

* ``acks_late``: the broker message is acknowledged only when the job has ended, so it is never lost in flight.
* a pool process that dies mid-job (OOM killer, segfault, SIGKILL): the worker's main process sees it and, with
  ``reject_on_worker_lost``, requeues the message at once; :class:`JobRequest` first marks the record ``queued``
  again with a note saying why. The next process to take it runs it from the start (attempt 2).
* a whole worker (or its machine) that vanishes: its unacknowledged message is restored by any live worker once
  the broker's visibility timeout (twice ``TTFT_JOB_LEASE_SECONDS``) has passed. By then the record's heartbeat
  (written every lease/4 s while a job runs) is stale, so the new worker takes it over. Until then a reader
  sees a stale job as ``queued``, with a note, not as ``running``.
* every state change is a compare-and-set in Lua; writes from an attempt are fenced by its attempt number, so a
  superseded attempt can change nothing (and stops itself at its next heartbeat). A restored message whose job's
  heartbeat is still fresh is not dropped but retried a lease later, again until the job ends or is taken over: the
  attempt may be alive (and hold the original message), or its worker may have died less than a lease ago, which
  happens when it dies more than one lease after taking the message (the visibility timeout runs from delivery).
* a job whose worker is lost ``TTFT_JOB_ATTEMPTS`` times ends ``failed`` with that reason, instead of killing
  workers forever.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import structlog

from ttft_sse.admission.auth import Caller
from ttft_sse.admission.gate import queue_seconds
from ttft_sse.errors import Conflict, Overloaded, Unavailable, redis_unavailable
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings
from ttft_sse.stores.jobs import Job, is_job_id, new_job_id, unknown

if TYPE_CHECKING:
    from celery import Celery
    from redis.asyncio import Redis

    from ttft_sse.generation import Prepared

log = structlog.get_logger("ttft_sse.redis_jobs")

QUEUE = "ttft-jobs"
TASK = "ttft_sse.run_job"
PREFIX = "ttft:job:"
DURATIONS = "ttft:job-durations"  # recent job run times (seconds), newest first, for Retry-After
DURATION_WINDOW = 32

# -- the state machine, one atomic step per script ---------------------------------------------------------------

# ARGV: now, worker, pid, lease, max_attempts, ttl, exhausted_error_json
CLAIM = """
local f = redis.call('HMGET', KEYS[1], 'status', 'heartbeat', 'attempts')
local status = f[1]
if not status then return {'gone', ''} end
if status == 'done' or status == 'failed' or status == 'cancelled' then return {'final', status} end
local now = tonumber(ARGV[1])
if status == 'running' and now - tonumber(f[2] or '0') < tonumber(ARGV[4]) then return {'busy', ''} end
local attempts = tonumber(f[3] or '0')
if attempts >= tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'finished', ARGV[1], 'error', ARGV[7])
  redis.call('EXPIRE', KEYS[1], ARGV[6])
  return {'failed', tostring(attempts)}
end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'note', 'attempt ' .. attempts .. ' stopped sending heartbeats; it was run again')
end
attempts = attempts + 1
redis.call('HSET', KEYS[1], 'status', 'running', 'attempts', attempts, 'started', ARGV[1], 'heartbeat', ARGV[1],
           'worker', ARGV[2], 'worker_pid', ARGV[3], 'tokens', 0)
return {'run', tostring(attempts)}
"""

# ARGV: attempt, new status ('' keeps it), ttl (0 = none), field, value, ...
UPDATE = """
local f = redis.call('HMGET', KEYS[1], 'status', 'attempts')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return f[1] or 'gone' end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[2]) end
if #ARGV > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4)) end
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 'ok'
"""

# ARGV: now, ttl
CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'gone' end
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 'cancelled'
end
return status
"""

# ARGV: worker, pid, note
LOST = """
local f = redis.call('HMGET', KEYS[1], 'status', 'worker', 'worker_pid')
if f[1] == 'running' and f[2] == ARGV[1] and f[3] == ARGV[2] then
  redis.call('HSET', KEYS[1], 'status', 'queued', 'note', ARGV[3])
  return 'queued'
end
return f[1] or 'gone'
"""


def key_of(job_id: str) -> str:
    return PREFIX + job_id


def visibility_seconds(settings: Settings) -> int:
    """How long the broker waits before handing an unacknowledged message (a vanished worker's) to another one.

    Above the lease, so a restored message always finds its job's heartbeat stale unless the job is still alive.
    """
    return max(2, round(2 * settings.job_lease_seconds))


def job_from_hash(job_id: str, fields: dict[str, str]) -> Job:
    def number(name: str) -> float | None:
        return float(fields[name]) if fields.get(name) else None

    return Job(
        id=job_id,
        status=cast(Any, fields["status"]),
        created=float(fields["created"]),
        owner=fields.get("owner") or None,
        started=number("started"),
        finished=number("finished"),
        attempts=int(fields.get("attempts") or 0),
        tokens=int(fields.get("tokens") or 0),
        result=json.loads(fields["result"]) if fields.get("result") else None,
        error=json.loads(fields["error"]) if fields.get("error") else None,
        note=fields.get("note") or None,
    )


def celery_app(settings: Settings) -> Celery:
    """The Celery app both sides share: the broker is ``TTFT_REDIS_URL``; job state lives in our own keys."""
    from celery import Celery

    if not settings.redis_url:
        raise ValueError("celery_app needs settings.redis_url (TTFT_REDIS_URL)")
    app = Celery("ttft_sse", broker=settings.redis_url, set_as_current=False)
    lease = settings.job_lease_seconds
    app.conf.update(
        task_default_queue=QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,  # results live in ttft:job:<id>, with their own expiry
        task_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,  # a worker process holds one job, not a batch that others could run
        # A pool process loads and warms the model before it reports up. Celery's default (4 s) kills and
        # re-forks one that takes longer, forever: a replacement for a killed pool process never came up.
        worker_proc_alive_timeout=900,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": visibility_seconds(settings),
            "unacked_restore_interval": max(1, round(lease / 2)),
            "unacked_restore_throttle": 1,
        },
    )
    return app


# -- the server side --------------------------------------------------------------------------------------------


class RedisJobs:
    """The job store of a server with ``TTFT_REDIS_URL``: records in Redis, runs on Celery workers."""

    def __init__(self, settings: Settings) -> None:
        from redis.asyncio import Redis

        assert settings.redis_url
        self._settings = settings
        self._redis: Redis = Redis.from_url(settings.redis_url, decode_responses=True)
        self._celery = celery_app(settings)
        self._cancel_script = self._redis.register_script(CANCEL)

    async def start(self) -> None:
        try:
            with redis_unavailable("the job queue"):
                await self._redis.ping()
        except Unavailable:
            pass  # logged; each job request answers 503 until Redis is back

    async def close(self) -> None:
        await self._redis.aclose()
        await anyio.to_thread.run_sync(self._celery.close)

    async def submit(self, request: GenerationRequest, prepared: Prepared, caller: Caller) -> Job:
        settings = self._settings
        job = Job(id=new_job_id(), status="queued", created=time.time(), owner=caller.key_id)
        with redis_unavailable("the job queue"):
            queued = await self._redis.llen(QUEUE)
            if queued >= settings.max_jobs:
                raise Overloaded(
                    f"{queued} jobs are already queued (the limit is {settings.max_jobs})",
                    retry_after=await self._retry_after(queued),
                )
            fields: dict[Any, Any] = {  # redis-py types the mapping key invariantly
                "status": "queued",
                "created": repr(job.created),
                "owner": job.owner or "",
                "request": json.dumps(request.as_body()),
                "attempts": 0,
            }
            await self._redis.hset(key_of(job.id), mapping=fields)
        try:
            await anyio.to_thread.run_sync(partial(self._celery.send_task, TASK, args=[job.id], queue=QUEUE))
        except Exception as exc:
            with contextlib.suppress(Exception):
                await self._redis.delete(key_of(job.id))
            log.error("job_publish_failed", job_id=job.id, error_type=type(exc).__name__)
            raise Unavailable("the job queue (Redis) cannot be reached; try again shortly", retry_after=5) from exc
        log.info("job_submitted", job_id=job.id, key_id=caller.key_id, queued=queued + 1)
        return job

    async def get(self, job_id: str, caller: Caller) -> Job:
        job = await self._load(job_id, caller)
        if job.status == "running":
            with redis_unavailable("the job queue"):
                beat = await cast(Awaitable[str | None], self._redis.hget(key_of(job_id), "heartbeat"))
            if beat is not None and time.time() - float(beat) > self._settings.job_lease_seconds:
                # Shown, not stored: the record turns over when another worker takes the job (see module doc).
                job.status = "queued"
                job.note = "its worker stopped sending heartbeats; the job will run again on another worker"
        return job

    async def cancel(self, job_id: str, caller: Caller) -> Job:
        job = await self._load(job_id, caller)
        with redis_unavailable("the job queue"):
            outcome = await self._cancel_script(
                keys=[key_of(job_id)], args=[repr(time.time()), round(self._settings.job_ttl_seconds)]
            )
        if outcome in ("done", "failed"):
            raise Conflict(f"job {job_id} has already ended ({outcome}); there is nothing to cancel")
        if outcome == "gone":
            raise unknown(job_id)
        if outcome == "cancelled":
            log.info("job_cancelled", job_id=job_id, was=job.status)
        return await self._load(job_id, caller)

    async def _load(self, job_id: str, caller: Caller) -> Job:
        if not is_job_id(job_id):
            raise unknown(job_id)
        with redis_unavailable("the job queue"):
            fields = await cast(Awaitable[dict[str, str]], self._redis.hgetall(key_of(job_id)))
        if not fields or (fields.get("owner") or None) != caller.key_id:
            raise unknown(job_id)
        return job_from_hash(job_id, fields)

    async def _retry_after(self, queued: int) -> float:
        recent = await cast(Awaitable[list[str]], self._redis.lrange(DURATIONS, 0, DURATION_WINDOW - 1))
        return queue_seconds(queued, 1, (float(x) for x in recent))


# -- the worker side --------------------------------------------------------------------------------------------
