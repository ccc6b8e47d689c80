"""Overflow jobs: submit now, poll ``/result/{id}`` later. One record type, one store interface, two stores.

    queued ──▶ running ──▶ done | failed          (any non-final state) ──DELETE──▶ cancelled

* :class:`EmbeddedJobs` (the default) runs jobs in the server's own process, on the same engine and behind the
  same gate, in the ``jobs`` lane: a job gets a generation slot only when no interactive request waits. A
  bounded number of runner tasks (``TTFT_JOB_RUNNERS``) take jobs first come, first served. Nothing outlives
  the process: jobs still queued or running at shutdown end as ``failed``.
* ``ttft_sse.stores.jobs_redis.RedisJobs`` (when ``TTFT_REDIS_URL`` is set) sends them through Celery on Redis to
  ``ttft-sse worker`` processes; any server sharing the Redis URL answers for any job.

Both keep a finished job ``TTFT_JOB_TTL_SECONDS`` (then 404), refuse a submission past ``TTFT_MAX_JOBS`` queued
jobs with 503 + Retry-After, and show a job only to the API key that submitted it (others get 404, as for an
unknown id).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import structlog

from ttft_sse.admission.auth import Caller
from ttft_sse.admission.gate import Lane, queue_seconds
from ttft_sse.engine.base import Finished, Piece
from ttft_sse.errors import Conflict, NotFound, Overloaded, ServiceError
from ttft_sse.generation import Generations, Prepared
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings

log = structlog.get_logger("ttft_sse.jobs")

Status = Literal["queued", "running", "done", "failed", "cancelled"]
FINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})
JOB_WINDOW = 32  # recent job run times behind the Retry-After of a refused submission


@dataclass
class Job:
    id: str
    status: Status
    created: float  # Unix time, seconds
    owner: str | None = None  # key id of the submitter; None on an open server
    started: float | None = None
    finished: float | None = None
    attempts: int = 0
    tokens: int = 0  # completion tokens so far (updated while it runs)
    result: dict[str, Any] | None = None  # text, finish_reason, usage, timings — when done
    error: dict[str, Any] | None = None  # the API's error object — when failed
    note: str | None = None  # e.g. why an attempt was lost and the job queued again

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "status": self.status,
            "created": self.created,
            "started": self.started,
            "finished": self.finished,
            "attempts": self.attempts,
            "tokens": self.tokens,
        }
        if self.status == "done" and self.result is not None:
            out.update(self.result)
        if self.error is not None:
            out["error"] = self.error
        if self.note is not None:
            out["note"] = self.note
        return out


def new_job_id() -> str:
    return uuid.uuid4().hex


def is_job_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def unknown(job_id: str) -> NotFound:
    return NotFound(f"no job {job_id!r}: it never existed, has expired, or belongs to another API key")


def result_of(finished: Finished, text: str, wait_ms: float) -> dict[str, Any]:
    return {
        "text": text,
        "finish_reason": finished.finish_reason,
        "usage": finished.usage.as_dict(),
        "timings": {"wait_ms": round(wait_ms, 1), **finished.timings},
        "degraded": finished.degraded,
    }


def error_of(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, ServiceError):
        error: dict[str, Any] = exc.to_dict()["error"]
        return error
    return {"message": "internal server error", "type": "server_error", "param": None, "code": None}


class JobStore(Protocol):
    """Where jobs are kept and run. Every method answers for any job id; unknown or foreign ids are ``NotFound``."""

    async def start(self) -> None:
        """Start running jobs (called once the model is ready)."""
        ...

    async def close(self) -> None: ...

    async def submit(self, request: GenerationRequest, prepared: Prepared, caller: Caller) -> Job:
        """Queue a validated request; ``Overloaded`` past the pending bound."""
        ...

    async def get(self, job_id: str, caller: Caller) -> Job: ...

    async def cancel(self, job_id: str, caller: Caller) -> Job:
        """Cancel a queued or running job (a cancelled one is returned as is); ``Conflict`` once it has ended."""
        ...


@dataclass
class _Entry:
    job: Job
    prepared: Prepared
    task: asyncio.Task[None] | None = None
    queued_at: float = field(default_factory=time.perf_counter)


class EmbeddedJobs:
    """Jobs in this process: a dict of records, a FIFO of ids, and ``job_runners`` runner tasks."""

    def __init__(self, settings: Settings, generations: Generations, *, clock: Callable[[], float] = time.time) -> None:
        self._generations = generations
        self._settings = settings
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._pending: asyncio.Queue[str] = asyncio.Queue()
        self._queued = 0
        self._runners: list[asyncio.Task[None]] = []
        self._durations: deque[float] = deque(maxlen=JOB_WINDOW)

    async def start(self) -> None:
        if not self._runners:
            self._runners = [
                asyncio.create_task(self._runner(), name=f"ttft-job-runner-{n}")
                for n in range(self._settings.job_runners)
            ]

    async def close(self) -> None:
        for runner in self._runners:
            runner.cancel()
        running = [e.task for e in self._entries.values() if e.task is not None and not e.task.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*self._runners, *running, return_exceptions=True)
        self._runners = []
        for entry in self._entries.values():
            if entry.job.status not in FINAL:
                when = "while it ran" if entry.job.status == "running" else "before it ran"
                message = f"the server shut down {when}; set TTFT_REDIS_URL for jobs that outlive a server"
                error = {"message": message, "type": "server_error", "param": None, "code": "shutdown"}
                self._end(entry, "failed", error=error)

    async def submit(self, request: GenerationRequest, prepared: Prepared, caller: Caller) -> Job:
        self._expire()
        if self._queued >= self._settings.max_jobs:
            raise Overloaded(
                f"{self._queued} jobs are already queued (the limit is {self._settings.max_jobs})",
                retry_after=self.retry_after(),
            )
        job = Job(id=new_job_id(), status="queued", created=self._clock(), owner=caller.key_id)
        self._entries[job.id] = _Entry(job, prepared)
        self._queued += 1
        self._pending.put_nowait(job.id)
        log.info("job_submitted", job_id=job.id, key_id=caller.key_id, queued=self._queued)
        return job

    async def get(self, job_id: str, caller: Caller) -> Job:
        return self._entry(job_id, caller).job

    async def cancel(self, job_id: str, caller: Caller) -> Job:
        entry = self._entry(job_id, caller)
        job = entry.job
        if job.status in ("done", "failed"):
            raise Conflict(f"job {job_id} has already ended ({job.status}); there is nothing to cancel")
        if job.status != "cancelled":
            was = job.status
            self._end(entry, "cancelled")
            if entry.task is not None:
                entry.task.cancel()  # its generation stops at the next token
            log.info("job_cancelled", job_id=job_id, was=was)
        return job

    def retry_after(self) -> float:
        """Queued jobs ahead, run ``job_runners`` at a time, each for the median of recent job run times."""
        return queue_seconds(self._queued, self._settings.job_runners, self._durations)

    def _entry(self, job_id: str, caller: Caller) -> _Entry:
        self._expire()
        entry = self._entries.get(job_id)
        if entry is None or entry.job.owner != caller.key_id:
            raise unknown(job_id)
        return entry

    def _expire(self) -> None:
        horizon = self._clock() - self._settings.job_ttl_seconds
        gone = [k for k, e in self._entries.items() if e.job.finished is not None and e.job.finished <= horizon]
        for key in gone:
            del self._entries[key]

    def _end(self, entry: _Entry, status: Status, **values: Any) -> None:
        if entry.job.status == "queued":
            self._queued -= 1
        entry.job.status = status
        entry.job.finished = self._clock()
        for name, value in values.items():
            setattr(entry.job, name, value)

    async def _runner(self) -> None:
        while True:
            job_id = await self._pending.get()
            entry = self._entries.get(job_id)
            if entry is None or entry.job.status != "queued":
                continue  # cancelled (or expired) while it waited
            entry.task = asyncio.create_task(self._run(entry), name=f"ttft-job-{job_id}")
            try:
                await asyncio.wait({entry.task})
            finally:
                entry.task = None

    async def _run(self, entry: _Entry) -> None:
        job = entry.job
        self._queued -= 1
        job.status, job.started, job.attempts = "running", self._clock(), job.attempts + 1
        started = time.perf_counter()
        wait_ms = (started - entry.queued_at) * 1000
        parts: list[str] = []
        generations = self._generations
        try:
            run = generations.admit(
                entry.prepared, caller=Caller(Lane.JOBS, job.owner), arrival=started, endpoint="job"
            )
            finished: Finished | None = None
            async with aclosing(run.events()) as events:
                async for item in events:
                    if isinstance(item, Piece):
                        parts.append(item.text)
                        job.tokens += 1
                    elif isinstance(item, Finished):
                        finished = item
            if finished is not None and job.status == "running":  # done once its slot is given back
                job.tokens = finished.usage.completion_tokens
                self._end(entry, "done", result=result_of(finished, "".join(parts), wait_ms))
        except asyncio.CancelledError:
            if job.status == "running":  # the server is closing, not a DELETE
                raise
        except Exception as exc:
            if job.status == "running":
                log.warning("job_failed", job_id=job.id, error_type=type(exc).__name__)
                self._end(entry, "failed", error=error_of(exc))
        finally:
            self._durations.append(time.perf_counter() - started)
            log.info("job_ended", job_id=job.id, status=job.status, tokens=job.tokens)
