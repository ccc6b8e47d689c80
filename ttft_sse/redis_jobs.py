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

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Iterator
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import structlog

from ttft_sse.auth import Caller
from ttft_sse.engine.base import Finished, Piece
from ttft_sse.errors import ClientError, Conflict, Overloaded, Unavailable
from ttft_sse.gate import Lane
from ttft_sse.jobs import Job, error_of, is_job_id, new_job_id, result_of, unknown
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings

if TYPE_CHECKING:
    from celery import Celery
    from redis.asyncio import Redis

    from ttft_sse.engine.base import Engine
    from ttft_sse.generation import Prepared
    from ttft_sse.lifespan import Runtime

log = structlog.get_logger("ttft_sse.redis_jobs")

QUEUE = "ttft-jobs"
TASK = "ttft_sse.run_job"
PREFIX = "ttft:job:"
DURATIONS = "ttft:job-durations"  # recent job run times (seconds), newest first, for Retry-After
DURATION_WINDOW = 32

# -- the state machine, one atomic step per script ---------------------------------------------------------------

# ARGV: now, worker, pid, lease, max_attempts, ttl, exhausted_error_json
_CLAIM = """
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
_UPDATE = """
local f = redis.call('HMGET', KEYS[1], 'status', 'attempts')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return f[1] or 'gone' end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[2]) end
if #ARGV > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4)) end
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 'ok'
"""

# ARGV: now, ttl
_CANCEL = """
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
_LOST = """
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


@contextlib.contextmanager
def _redis_errors() -> Iterator[None]:
    """Redis being down is the service's trouble, not the client's: 503 with a short Retry-After."""
    from redis.exceptions import RedisError

    try:
        yield
    except RedisError as exc:
        log.error("redis_unavailable", error_type=type(exc).__name__, error=str(exc))
        raise Unavailable("the job queue (Redis) cannot be reached; try again shortly", retry_after=5) from exc


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

    def __init__(self, runtime: Runtime) -> None:
        from redis.asyncio import Redis

        settings = runtime.settings
        assert settings.redis_url
        self._settings = settings
        self._redis: Redis = Redis.from_url(settings.redis_url, decode_responses=True)
        self._celery = celery_app(settings)
        self._cancel_script = self._redis.register_script(_CANCEL)

    async def start(self) -> None:
        try:
            with _redis_errors():
                await self._redis.ping()
        except Unavailable:
            pass  # logged; each job request answers 503 until Redis is back

    async def close(self) -> None:
        await self._redis.aclose()
        await anyio.to_thread.run_sync(self._celery.close)

    async def submit(self, request: GenerationRequest, prepared: Prepared, caller: Caller) -> Job:
        settings = self._settings
        job = Job(id=new_job_id(), status="queued", created=time.time(), owner=caller.key_id)
        with _redis_errors():
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
            with _redis_errors():
                beat = await cast(Awaitable[str | None], self._redis.hget(key_of(job_id), "heartbeat"))
            if beat is not None and time.time() - float(beat) > self._settings.job_lease_seconds:
                # Shown, not stored: the record turns over when another worker takes the job (see module doc).
                job.status = "queued"
                job.note = "its worker stopped sending heartbeats; the job will run again on another worker"
        return job

    async def cancel(self, job_id: str, caller: Caller) -> Job:
        job = await self._load(job_id, caller)
        with _redis_errors():
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
        with _redis_errors():
            fields = await cast(Awaitable[dict[str, str]], self._redis.hgetall(key_of(job_id)))
        if not fields or (fields.get("owner") or None) != caller.key_id:
            raise unknown(job_id)
        return job_from_hash(job_id, fields)

    async def _retry_after(self, queued: int) -> float:
        recent = await cast(Awaitable[list[str]], self._redis.lrange(DURATIONS, 0, DURATION_WINDOW - 1))
        mean = sum(float(x) for x in recent) / len(recent) if recent else 1.0
        return max(1.0, (queued + 1) * mean)


# -- the worker side --------------------------------------------------------------------------------------------


class JobRunner:
    """One worker pool process's engine and event loop. Runs one job at a time (Celery calls :meth:`run`)."""

    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self._engine = engine  # None: the transformers engine for settings.model
        self.worker = socket.gethostname()
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._redis: Redis | None = None

    def start(self) -> None:
        """Load and warm the model, and connect to Redis. Raises ``RuntimeError`` when the model cannot load."""
        from redis.asyncio import Redis

        from ttft_sse.engine.single import SingleEngine
        from ttft_sse.lifespan import Runtime

        self.runtime = Runtime(self.settings, self._engine or SingleEngine(self.settings))
        self.loop.run_until_complete(self.runtime.start())
        if not self.runtime.ready:
            raise RuntimeError(f"the model failed to load: {self.runtime.error}")

        async def connect() -> Redis:
            assert self.settings.redis_url
            return Redis.from_url(self.settings.redis_url, decode_responses=True)

        self._redis = self.loop.run_until_complete(connect())
        self._claim = self._redis.register_script(_CLAIM)
        self._update = self._redis.register_script(_UPDATE)

    def run(self, job_id: str) -> str:
        """Claim and run one job; the outcome: done, failed, or why it was not run (gone, final, busy, …)."""
        return self.loop.run_until_complete(self._run(job_id))

    def close(self) -> None:
        async def close() -> None:
            await self.runtime.stop()
            if self._redis is not None:
                await self._redis.aclose()

        self.loop.run_until_complete(close())
        self.loop.close()

    async def _run(self, job_id: str) -> str:
        assert self._redis is not None
        settings = self.settings
        key = key_of(job_id)
        exhausted = {
            "message": f"the job was started {settings.job_attempts} times and each time its worker was lost "
            "before it finished",
            "type": "server_error",
            "param": None,
            "code": "worker_lost",
        }
        outcome, detail = await self._claim(
            keys=[key],
            args=[
                repr(time.time()),
                self.worker,
                self.pid,
                settings.job_lease_seconds,
                settings.job_attempts,
                round(settings.job_ttl_seconds),
                json.dumps(exhausted),
            ],
        )
        if outcome != "run":
            log.info("job_skipped", job_id=job_id, outcome=outcome, detail=detail)
            return cast(str, outcome)
        attempt = int(detail)
        fields = await cast(Awaitable[dict[str, str]], self._redis.hgetall(key))
        log.info("job_started", job_id=job_id, attempt=attempt, key_id=fields.get("owner") or None)
        started = time.time()
        wait_ms = (started - float(fields["created"])) * 1000
        progress = {"tokens": 0}
        work = asyncio.ensure_future(self._generate(fields, progress, wait_ms))
        beat = min(max(settings.job_lease_seconds / 4, 0.2), 5.0)
        status = "failed"
        final: dict[str, Any] = {}
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=beat)
                if done:
                    break
                answer = await self._update(
                    keys=[key], args=[attempt, "", 0, "heartbeat", repr(time.time()), "tokens", progress["tokens"]]
                )
                if answer != "ok":  # cancelled, or another attempt took over: stop generating
                    work.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await work
                    log.info("job_stopped", job_id=job_id, attempt=attempt, now=answer)
                    return cast(str, answer)
            try:
                result = work.result()
                status, final = "done", {"result": json.dumps(result)}
            except Exception as exc:
                final = {"error": json.dumps(error_of(exc))}
                if not isinstance(exc, ClientError):
                    log.warning("job_failed", job_id=job_id, attempt=attempt, error_type=type(exc).__name__)
            pairs: list[Any] = ["finished", repr(time.time()), "tokens", progress["tokens"]]
            for name, value in final.items():
                pairs += [name, value]
            answer = await self._update(keys=[key], args=[attempt, status, round(settings.job_ttl_seconds), *pairs])
            if answer == "ok":
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.lpush(DURATIONS, round(time.time() - started, 3))
                    pipe.ltrim(DURATIONS, 0, DURATION_WINDOW - 1)
                    await pipe.execute()
            log.info("job_ended", job_id=job_id, attempt=attempt, status=status if answer == "ok" else answer)
            return status if answer == "ok" else cast(str, answer)
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work

    async def _generate(self, fields: dict[str, str], progress: dict[str, int], wait_ms: float) -> dict[str, Any]:
        generations = self.runtime.generations
        request = GenerationRequest.from_json(
            json.loads(fields["request"]), max_tokens_cap=self.settings.max_tokens_cap
        )
        prepared = await generations.prepare(request)
        caller = Caller(Lane.JOBS, fields.get("owner") or None)
        run = generations.admit(prepared, caller=caller, arrival=time.perf_counter(), endpoint="job")
        parts: list[str] = []
        async with aclosing(run.events()) as events:
            async for item in events:
                if isinstance(item, Piece):
                    parts.append(item.text)
                    progress["tokens"] += 1
                elif isinstance(item, Finished):
                    progress["tokens"] = item.usage.completion_tokens
                    return result_of(item, "".join(parts), wait_ms)
        raise RuntimeError("the generation ended without a result")


# -- Celery wiring for `ttft-sse worker` ------------------------------------------------------------------------

_settings: Settings | None = None  # set by run_worker before the pool forks; read in each pool process
_runner: JobRunner | None = None
_parent_client: Any = None


def _parent_redis() -> Any:
    """A plain (blocking) client for the worker's main process, which has no event loop."""
    global _parent_client
    if _parent_client is None:
        import redis

        assert _settings is not None and _settings.redis_url
        _parent_client = redis.Redis.from_url(_settings.redis_url, decode_responses=True)
    return _parent_client


def _make_request_class() -> Any:
    from billiard.einfo import ExceptionWithTraceback
    from billiard.exceptions import WorkerLostError
    from celery.worker.request import Request

    class JobRequest(Request):  # type: ignore[misc]
        """Runs in the worker's main process. Before Celery requeues a job whose pool process died, say so."""

        def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
            exc = exc_info.exception
            if isinstance(exc, ExceptionWithTraceback):
                exc = exc.exc
            if isinstance(exc, WorkerLostError | SystemExit) and self.args:
                job_id = str(self.args[0])
                note = f"attempt lost: its worker process died ({exc}); queued again"
                try:
                    now = _parent_redis().eval(_LOST, 1, key_of(job_id), socket.gethostname(), self.worker_pid, note)
                    log.warning("job_worker_lost", job_id=job_id, worker_pid=self.worker_pid, now=now)
                except Exception as redis_exc:  # the requeue below still happens; the heartbeat rule covers it
                    log.error("job_worker_lost_unrecorded", job_id=job_id, error_type=type(redis_exc).__name__)
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    return JobRequest


def run_worker(settings: Settings, *, concurrency: int) -> int:
    """``ttft-sse worker``: a Celery prefork worker on the job queue, one model per pool process."""
    from celery import signals

    from ttft_sse import log as logs

    global _settings
    _settings = settings
    app = celery_app(settings)

    def run_job(task: Any, job_id: str) -> str:
        if _runner is None:
            raise RuntimeError("this worker process has no model; see the start-up error above")
        outcome = _runner.run(job_id)
        if outcome == "busy":
            # A job whose heartbeat is fresh. Its attempt may be alive, or it may have just died with this
            # (restored) message the only one left: look again once the lease has run out, until the job ends or
            # is taken over. Dropping it lost the job of a worker killed 1-2 leases after taking the message.
            raise task.retry(countdown=settings.job_lease_seconds, max_retries=None)
        return outcome

    app.task(name=TASK, bind=True, Request=_make_request_class(), ignore_result=True)(run_job)

    def configure_logging(**_: Any) -> None:
        logs.configure(level=settings.log_level, fmt=settings.log_format)

    def load_model(**_: Any) -> None:
        global _runner
        runner = JobRunner(settings)
        try:
            runner.start()
        except Exception as exc:
            log.error("worker_process_start_failed", error=str(exc), error_type=type(exc).__name__)
            os._exit(1)  # the main process notices and starts another; its log says why this one went
        _runner = runner
        log.info("worker_process_ready", pid=os.getpid(), **runner.runtime.startup_report())

    signals.setup_logging.connect(configure_logging, weak=False)
    signals.worker_process_init.connect(load_model, weak=False)
    argv = [
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        f"--queues={QUEUE}",
        f"--hostname=ttft-{os.getpid()}@%h",
        f"--loglevel={settings.log_level.upper()}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    app.worker_main(argv)
    return 0
