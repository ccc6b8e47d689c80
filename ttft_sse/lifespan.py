"""Start-up and shut-down: load and warm the engine off the event loop, time each stage, report readiness.

The server binds at once and answers ``/healthz`` while the model loads (``/readyz`` says 503 and which stage
it is in); generating endpoints answer 503 with Retry-After until the warm-up has run through the same path a
request takes. A load that fails sets ``failed``, which the CLI's shutdown trigger watches: the process exits
non-zero with the reason instead of sitting there unready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any, Literal

import anyio
import structlog
from starlette.applications import Starlette

from ttft_sse.engine.base import Engine
from ttft_sse.gate import Gate
from ttft_sse.generation import Generations
from ttft_sse.metrics import Metrics
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

log = structlog.get_logger("ttft_sse.lifespan")

State = Literal["starting", "ready", "failed", "stopping"]
WARMUP_PROMPT = "Hello! Say hi."
WARMUP_TOKENS = 8


class Runtime:
    """What the app holds while it runs: settings, the engine, the gate, the start-up story and the metrics."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.gate = Gate(
            slots=settings.max_concurrency,
            max_queue=settings.max_queue,
            timeout=settings.queue_timeout_seconds,
        )
        self.generations = Generations(self)
        self.clock = StageClock()
        self.state: State = "starting"
        self.error: str | None = None
        self.failed = asyncio.Event()
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

    def startup_report(self) -> dict[str, Any]:
        return self.clock.as_dict()

    async def start(self) -> None:
        try:
            await anyio.to_thread.run_sync(self.engine.load, self.clock)
            if self.settings.warmup:
                with self.clock.stage("warmup"):
                    await self._warm_up()
        except Exception as exc:
            self.state = "failed"
            self.error = str(exc) or type(exc).__name__
            log.error("startup_failed", error=self.error, error_type=type(exc).__name__, **self.clock.as_dict())
            self.failed.set()
            return
        if self.state == "starting":
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
            request, arrival=time.perf_counter(), endpoint="warmup", check_ready=False, record=False
        )
        async with aclosing(run.events()) as events:
            async for _ in events:
                pass

    async def stop(self) -> None:
        self.state = "stopping" if self.state != "failed" else self.state
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
