"""Start-up and shut-down: load and warm the engine off the event loop, time each stage, report readiness.

The server binds at once and answers ``/healthz`` while the model loads (``/readyz`` says 503 and which stage
it is in); generating endpoints answer 503 with Retry-After until the warm-up has run through the same path a
request takes. A load that fails sets ``failed``, which the CLI's shutdown trigger watches: the process exits
non-zero with the reason instead of sitting there unready.

Shutting down is :meth:`Runtime.drain`, which the CLI's shutdown trigger awaits before hypercorn closes anything:

1. readiness turns 503 at once, new generations get 503 + Retry-After, queued ones end with a ``shutdown_error``;
2. generations already running may finish, for up to the drain grace (``TTFT_DRAIN_SECONDS``);
3. any still running then are cancelled and end with a ``shutdown_error`` (code ``drain_timeout``), and the
   drain waits (at most ``CUT_SECONDS``) until their threads have ended;
4. the trigger returns; hypercorn gives the last responses ``FLUSH_SECONDS`` to go out, then the lifespan ends.

sse-starlette drains streams by itself only under uvicorn (it hooks uvicorn's signal handler). Under hypercorn
nothing tells it, and its switch (``AppStatus.should_exit``) is process-global; so the drain is ours, and the
streams end through the same generation path as every other ending: no sse-starlette shutdown machinery is used.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, Literal

import anyio
import structlog
from starlette.applications import Starlette

from ttft_sse.auth import ANONYMOUS, Keyring
from ttft_sse.engine.base import Engine
from ttft_sse.errors import ShuttingDown
from ttft_sse.gate import Gate
from ttft_sse.generation import Generations
from ttft_sse.jobs import JobStore
from ttft_sse.metrics import Metrics
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock
from ttft_sse.streams import Streams

log = structlog.get_logger("ttft_sse.lifespan")

State = Literal["starting", "ready", "failed", "stopping"]
WARMUP_PROMPT = "Hello! Say hi."
WARMUP_TOKENS = 8
# After the drain grace: how long to wait for cancelled generations to end (a decode step each, on CPU tens of ms).
CUT_SECONDS = 5.0
# After the drain: how long hypercorn waits for the last responses (final events) to be written.
FLUSH_SECONDS = 5.0


def shutdown_budget(drain_seconds: float) -> float:
    """The longest a SIGTERM can take to end the process: the grace, the cut, the flush. Orchestrators must wait
    longer than this (Kubernetes: ``terminationGracePeriodSeconds``) or they kill streams mid-event."""
    return drain_seconds + CUT_SECONDS + FLUSH_SECONDS


class Runtime:
    """What the app holds while it runs: settings, keys, the engine, the gate, jobs, the start-up story, metrics."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.gate = Gate(
            slots=settings.max_concurrency,
            max_queue=settings.max_queue,
            timeout=settings.queue_timeout_seconds,
        )
        self.keyring = Keyring.from_spec(settings.api_keys)
        self.generations = Generations(self)
        self.streams = Streams(
            grace=settings.resume_grace_seconds,
            max_streams=settings.max_streams,
            buffer_events=settings.stream_buffer_events,
        )
        self.jobs: JobStore | None = None  # set by create_app; a worker process runs jobs, it keeps none
        self.clock = StageClock()
        self.state: State = "starting"
        self.error: str | None = None
        self.failed = asyncio.Event()
        self.cutting = False  # the drain grace is over: running generations are being cancelled
        self._hurry = asyncio.Event()
        self.metrics = Metrics(self)  # this app's own registry; start-up stages are read from `clock` on scrape

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def not_ready_reason(self) -> str:
        if self.state == "starting":
            stage = self.clock.current or "starting"
            return f"the model is still loading (stage: {stage})"
        if self.state == "failed":
            return f"the model failed to load: {self.error}"
        return "the server is shutting down"

    def refusal(self) -> ShuttingDown:
        """The error for a request that arrives, or is still queued, once the drain has begun."""
        return ShuttingDown(
            "the server is shutting down and starts no new generations; nothing was generated, retry",
            retry_after=1,
            code="draining",
        )

    def cut(self) -> ShuttingDown:
        """The error that ends a generation still running when the drain grace is over."""
        return ShuttingDown(
            f"the server is shutting down: this generation was stopped when the {self.settings.drain_seconds:g} s "
            "drain grace ran out; the text so far is incomplete, retry for a full answer",
            retry_after=1,
            code="drain_timeout",
        )

    def startup_report(self) -> dict[str, Any]:
        return self.clock.as_dict()

    async def start(self) -> None:
        try:
            await anyio.to_thread.run_sync(self.engine.load, self.clock)
            if self.settings.warmup:
                with self.clock.stage("warmup"):
                    await self._warm_up()
        except ShuttingDown:
            log.info("startup_abandoned", reason="shutting down", **self.clock.as_dict())
            return
        except Exception as exc:
            self.state = "failed"
            self.error = str(exc) or type(exc).__name__
            log.error("startup_failed", error=self.error, error_type=type(exc).__name__, **self.clock.as_dict())
            self.failed.set()
            return
        if self.state == "starting":
            if self.jobs is not None:
                await self.jobs.start()
            self.state = "ready"
            info = self.engine.info
            log.info(
                "ready",
                model=info.name,
                device=info.device,
                dtype=info.dtype,
                threads=info.threads,
                **self.clock.as_dict(),
            )

    async def _warm_up(self) -> None:
        """One short generation through the same path a request takes (template, tokenizer, gate, engine)."""
        request = GenerationRequest(prompt=WARMUP_PROMPT, messages=None, max_tokens=WARMUP_TOKENS)
        run = await self.generations.open(
            request, caller=ANONYMOUS, arrival=time.perf_counter(), endpoint="warmup", check_ready=False, record=False
        )
        async with aclosing(run.events()) as events:
            async for _ in events:
                pass

    async def drain(self, grace: float) -> None:
        """Stop taking work, let running generations finish for up to ``grace`` seconds, then cut the rest.

        Returns once no generation is running (or, if a thread will not end, ``CUT_SECONDS`` after the cut).
        Every request ends with something the client can read: a ``done``, or a ``shutdown_error``.
        """
        if self.state != "failed":
            self.state = "stopping"  # readiness turns 503 at once; Generations.open refuses newcomers
        gate = self.gate
        gate.close(self.refusal)  # queued requests are refused now, not after the grace
        started = time.perf_counter()
        log.info("draining", running=gate.running, grace_s=grace)
        with anyio.move_on_after(grace):
            async with anyio.create_task_group() as group:

                async def until(event: Callable[[], Awaitable[object]]) -> None:
                    await event()
                    group.cancel_scope.cancel()

                group.start_soon(until, gate.wait_idle)
                group.start_soon(until, self._hurry.wait)
        cut = gate.running
        if cut:
            self.cutting = True
            log.warning("drain_grace_over", cutting=cut, grace_s=grace)
            with anyio.move_on_after(CUT_SECONDS):
                await self.engine.close()  # cancel every generation; each one's Run then raises cut()
                await gate.wait_idle()
        log.info(
            "drained",
            cut=cut,
            left_running=gate.running,
            drain_ms=round((time.perf_counter() - started) * 1000, 1),
        )

    def hurry(self) -> None:
        """End the drain grace now (a second SIGTERM / Ctrl-C): running generations are cut at once."""
        self._hurry.set()

    async def stop(self) -> None:
        self.state = "stopping" if self.state != "failed" else self.state
        await self.streams.close()
        if self.jobs is not None:
            await self.jobs.close()
        await self.engine.close()


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    runtime: Runtime = app.state.runtime
    loading = asyncio.create_task(runtime.start(), name="ttft-startup")
    try:
        yield
    finally:
        if not loading.done():
            # A thread that is inside from_pretrained cannot be interrupted; let it finish, then leave.
            loading.cancel()
        await runtime.stop()
