"""A ``ttft-sse worker`` process: a Celery prefork worker whose pool processes each load and warm the model once
(``worker_process_init``), then run one job at a time through the same ``Generations`` path a request takes.

The job records, queue and state-machine scripts it shares with the servers are in ttft_sse/stores/jobs_redis.py, with
the account of how a job survives its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Awaitable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, cast

import structlog

from ttft_sse.admission.auth import Caller
from ttft_sse.admission.gate import Lane
from ttft_sse.engine.base import Finished, Piece
from ttft_sse.errors import ClientError
from ttft_sse.runtime import Runtime
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings
from ttft_sse.stores.jobs import error_of, result_of
from ttft_sse.stores.jobs_redis import (
    CLAIM,
    DURATION_WINDOW,
    DURATIONS,
    LOST,
    PREFIX,
    QUEUE,
    TASK,
    UPDATE,
    celery_app,
    key_of,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ttft_sse.engine.base import Engine

log = structlog.get_logger("ttft_sse.worker")


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

        self.runtime = Runtime(self.settings, self._engine or SingleEngine(self.settings), jobs=False)
        self.loop.run_until_complete(self.runtime.start())
        lifecycle = self.runtime.lifecycle
        if not lifecycle.ready:
            raise RuntimeError(f"the model failed to load: {lifecycle.error}")

        async def connect() -> Redis:
            assert self.settings.redis_url
            return Redis.from_url(self.settings.redis_url, decode_responses=True)

        self._redis = self.loop.run_until_complete(connect())
        self._claim = self._redis.register_script(CLAIM)
        self._update = self._redis.register_script(UPDATE)

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
        """Claim the job, generate while sending heartbeats, record the end. Returns the outcome."""
        assert self._redis is not None
        key = key_of(job_id)
        outcome, detail = await self._claim_job(key)
        if outcome != "run":
            log.info("job_skipped", job_id=job_id, outcome=outcome, detail=detail)
            return outcome
        attempt = int(detail)
        fields = await cast(Awaitable[dict[str, str]], self._redis.hgetall(key))
        log.info("job_started", job_id=job_id, attempt=attempt, key_id=fields.get("owner") or None)
        started = time.time()
        progress = {"tokens": 0}
        work = asyncio.ensure_future(self._generate(fields, progress, (started - float(fields["created"])) * 1000))
        try:
            lost = await self._beat_until_done(work, key, attempt, progress)
            if lost is not None:  # cancelled, or another attempt took over: generation was stopped
                log.info("job_stopped", job_id=job_id, attempt=attempt, now=lost)
                return lost
            status, answer = await self._record_end(work, key, attempt, progress, started)
            log.info("job_ended", job_id=job_id, attempt=attempt, status=status if answer == "ok" else answer)
            return status if answer == "ok" else answer
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work

    async def _claim_job(self, key: str) -> tuple[str, str]:
        """The claim script's answer: ``("run", attempt)``, or why this attempt does not run (gone, final, busy,
        failed after too many lost workers)."""
        settings = self.settings
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
        return cast(str, outcome), cast(str, detail)

    async def _beat_until_done(
        self, work: asyncio.Future[dict[str, Any]], key: str, attempt: int, progress: dict[str, int]
    ) -> str | None:
        """Write the heartbeat and token count every lease/4 s (0.2-5 s) until ``work`` ends. Returns None when it
        ended, or what the record says instead once this attempt may no longer write (after stopping ``work``)."""
        beat = min(max(self.settings.job_lease_seconds / 4, 0.2), 5.0)
        while True:
            done, _ = await asyncio.wait({work}, timeout=beat)
            if done:
                return None
            answer = await self._update(
                keys=[key], args=[attempt, "", 0, "heartbeat", repr(time.time()), "tokens", progress["tokens"]]
            )
            if answer != "ok":
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                return cast(str, answer)

    async def _record_end(
        self, work: asyncio.Future[dict[str, Any]], key: str, attempt: int, progress: dict[str, int], started: float
    ) -> tuple[str, str]:
        """Write the ended job (done with its result, or failed with the API's error) if this attempt still owns it;
        returns the status and the update's answer (``ok``, or the record's status when it does not)."""
        assert self._redis is not None
        status = "failed"
        try:
            final = {"result": json.dumps(work.result())}
            status = "done"
        except Exception as exc:
            final = {"error": json.dumps(error_of(exc))}
            if not isinstance(exc, ClientError):
                log.warning(
                    "job_failed", job_id=key.removeprefix(PREFIX), attempt=attempt, error_type=type(exc).__name__
                )
        pairs: list[Any] = ["finished", repr(time.time()), "tokens", progress["tokens"]]
        for name, value in final.items():
            pairs += [name, value]
        ttl = round(self.settings.job_ttl_seconds)
        answer = cast(str, await self._update(keys=[key], args=[attempt, status, ttl, *pairs]))
        if answer == "ok":
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.lpush(DURATIONS, round(time.time() - started, 3))
                pipe.ltrim(DURATIONS, 0, DURATION_WINDOW - 1)
                await pipe.execute()
        return status, answer

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
                    now = _parent_redis().eval(LOST, 1, key_of(job_id), socket.gethostname(), self.worker_pid, note)
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
        log.info("worker_process_ready", pid=os.getpid(), **runner.runtime.lifecycle.startup_report())

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
