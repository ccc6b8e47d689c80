"""The runtime builds the parts an app runs on, hands each only what it uses, and runs start-up and shut-down.

Built once per app by :func:`ttft_sse.app.create_app` (and once per worker process by ttft_sse/worker.py)::

    Runtime ─┬─ Lifecycle    state, readiness, the start-up stage clock, drain refusals  (lifecycle.py)
             ├─ Gate         generation slots and the bounded queue, by lane    (admission/gate.py)
             ├─ Keyring      API keys → lanes                                   (admission/auth.py)
             ├─ Targets      first-token targets by lane; Degrader: the faster mode (admission/targets.py)
             ├─ Metrics      reads the gate, the clock and the engine on each scrape      (metrics.py)
             ├─ Generations  lifecycle + engine + gate + metrics                          (generation.py)
             ├─ Prefills     prompts computed while their user types (POST /prefill)  (prefixes/prefills.py)
             ├─ StreamStore  resumable streams: in-process, or in Redis (every replica)
             │                                      (stores/resumable.py, stores/resumable_redis.py)
             └─ JobStore     in-process, or Celery on Redis         (stores/jobs.py, stores/jobs_redis.py)

None of these parts imports this module: imports run from here downward only (the HTTP surface, ``api/``,
reads the runtime from ``app.state``).

Start-up: the server binds at once and answers ``/healthz`` while the model loads (``/readyz`` says 503 and which
stage it is in); generating endpoints answer 503 with Retry-After until the warm-up has run through the same path a
request takes. A load that fails sets ``lifecycle.failed``, which the CLI's shutdown trigger watches: the process
exits non-zero with the reason instead of sitting there unready.

Shutting down is :meth:`Runtime.drain`, which the CLI's shutdown trigger awaits before hypercorn closes anything:

1. readiness turns 503 at once, new generations get 503 + Retry-After, queued ones end with a ``shutdown_error``;
2. generations already running may finish, for up to the drain grace (``TTFT_DRAIN_SECONDS``); then, with
   ``TTFT_PREFIX_STORE_MB``, the engine writes its pinned and most used prefixes to the cache directory;
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
from functools import partial

import anyio
import structlog
from starlette.applications import Starlette

from ttft_sse.admission.auth import ANONYMOUS, Keyring
from ttft_sse.admission.gate import Gate
from ttft_sse.admission.targets import Degrader, Targets, parse_targets
from ttft_sse.engine.base import Engine, StoresPrefixes, keep_warm
from ttft_sse.errors import PromptTooLong, ShuttingDown
from ttft_sse.generation import Generations
from ttft_sse.lifecycle import Lifecycle
from ttft_sse.metrics import Metrics
from ttft_sse.prefixes import warm_prompts
from ttft_sse.prefixes.prefills import Prefills
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings
from ttft_sse.stores.jobs import EmbeddedJobs, JobStore
from ttft_sse.stores.resumable import Streams, StreamStore

log = structlog.get_logger("ttft_sse.runtime")

WARMUP_PROMPT = "Hello! Say hi."
WARMUP_TOKENS = 8
# After the drain grace: how long to wait for cancelled generations to end (a decode step each, on CPU tens of ms).
CUT_SECONDS = 5.0
# After the drain: how long hypercorn waits for the last responses (final events) to be written.
FLUSH_SECONDS = 5.0


NOT_KEPT = (
    "the warm prompts keep a quarter of the KV cache at most (engine/batched/pins.py), and this one is past it, or "
    "the engine keeps no prefix for good: it is cached like any prefix, evicted when the cache runs short"
)


def shutdown_budget(drain_seconds: float) -> float:
    """The longest a SIGTERM can take to end the process: the grace, the cut, the flush. Orchestrators must wait
    longer than this (Kubernetes: ``terminationGracePeriodSeconds``) or they kill streams mid-event."""
    return drain_seconds + CUT_SECONDS + FLUSH_SECONDS


class Runtime:
    """What the app holds while it runs. ``jobs=False`` builds no job store (a worker process runs jobs, it keeps
    none)."""

    def __init__(self, settings: Settings, engine: Engine, *, jobs: bool = True) -> None:
        self.settings = settings
        self.engine = engine
        self.lifecycle = Lifecycle(drain_seconds=settings.drain_seconds)
        self.gate = Gate(
            slots=settings.max_concurrency,
            max_queue=settings.max_queue,
            timeout=settings.queue_timeout_seconds,
            reserved=settings.reserved_slots,
            extra=settings.extra_slots,
        )
        self.keyring = Keyring.from_spec(settings.api_keys)
        lanes = parse_targets(settings.sla_ms)
        self.targets = Targets(lanes, self.gate) if lanes else None
        self.degrader = (
            Degrader(self.targets, engine, faster=settings.degrade)
            if self.targets is not None and settings.degrade != "off"
            else None
        )
        if settings.degrade != "off" and self.targets is None:
            log.warning("degrade_idle", reason="TTFT_DEGRADE switches on first-token targets: TTFT_SLA_MS is not set")
        self.metrics = Metrics(
            gate=self.gate, clock=self.lifecycle.clock, engine=engine, targets=self.targets, degrader=self.degrader
        )
        self.generations = Generations(
            self.lifecycle,
            engine,
            self.gate,
            self.metrics,
            default_max_tokens=settings.default_max_tokens,
            max_prompt_tokens=settings.max_prompt_tokens,
            targets=self.targets,
            degrader=self.degrader,
            prefix_isolation=settings.prefix_isolation,
        )
        self.prefills = Prefills(
            self.lifecycle,
            engine,
            self.gate,
            per_key=settings.prefill_per_key,
            prefix_isolation=settings.prefix_isolation,
            max_prompt_tokens=settings.max_prompt_tokens,
        )
        self.streams: StreamStore = _stream_store(settings)
        self.jobs: JobStore | None = _job_store(settings, self.generations) if jobs else None
        self._hurry = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None  # the degrader's look once a second, while ready

    async def start(self) -> None:
        lifecycle = self.lifecycle
        try:
            await anyio.to_thread.run_sync(self.engine.load, lifecycle.clock)
            if self.settings.warmup:
                with lifecycle.clock.stage("warmup"):
                    await self._warm_up()
            if self.settings.prefix_store_mb and isinstance(self.engine, StoresPrefixes):
                with lifecycle.clock.stage("prefix_store"):  # before the warm prompts: it holds their KV, if kept
                    await self._restore_prefixes(self.engine)
            if self.settings.warm_prompts:
                with lifecycle.clock.stage("warm_prompts"):
                    await self._warm_prompts(self.settings.warm_prompts)
        except ShuttingDown:
            log.info("startup_abandoned", reason="shutting down", **lifecycle.startup_report())
            return
        except Exception as exc:
            lifecycle.fail(str(exc) or type(exc).__name__)
            log.error(
                "startup_failed", error=lifecycle.error, error_type=type(exc).__name__, **lifecycle.startup_report()
            )
            return
        if lifecycle.state == "starting":
            if self.jobs is not None:
                await self.jobs.start()
            lifecycle.state = "ready"
            if self.degrader is not None:
                self._watch = asyncio.create_task(self._watch_first_tokens(self.degrader), name="ttft-degrader")
            info = self.engine.info
            log.info(
                "ready",
                model=info.name,
                engine=info.engine,
                device=info.device,
                dtype=info.dtype,
                threads=info.threads,
                **lifecycle.startup_report(),
            )

    async def _watch_first_tokens(self, degrader: Degrader) -> None:
        """Let the degrader look once a second too, so that it switches back once traffic stops."""
        while True:
            await asyncio.sleep(1.0)
            degrader.evaluate()

    async def _warm_up(self) -> None:
        """One short generation through the same path a request takes (template, tokenizer, gate, engine)."""
        request = GenerationRequest(prompt=WARMUP_PROMPT, messages=None, max_tokens=WARMUP_TOKENS)
        run = await self.generations.open(
            request, caller=ANONYMOUS, arrival=time.perf_counter(), endpoint="warmup", check_ready=False, record=False
        )
        async with aclosing(run.events()) as events:
            async for _ in events:
                pass

    async def _warm_prompts(self, path: str) -> None:
        """``TTFT_WARM_PROMPTS``: each prompt's stable prefix (as ``POST /prefill`` computes it) computed into the
        prefix cache and kept for good, before the server is ready; one log line each, saying what was kept."""
        engine = self.engine
        for number, request in enumerate(warm_prompts.read(path), start=1):
            try:
                prompt = await anyio.to_thread.run_sync(
                    partial(engine.prepare_prefix, prompt=request.prompt, messages=request.messages, raw=request.raw)
                )
            except PromptTooLong as exc:
                log.warning("warm_prompt", line=number, outcome="too_long", error=exc.message)
                continue
            kept = await keep_warm(engine, prompt)
            fields = {"line": number, "prompt_tokens": prompt.n_tokens, "cached_tokens": engine.cached(prompt)}
            if kept:
                log.info("warm_prompt", outcome="kept", **fields)
            else:  # past the warm prompts' share of the cache, or an engine that keeps nothing for good
                log.warning("warm_prompt", outcome="not_kept", reason=NOT_KEPT, **fields)

    async def drain(self, grace: float) -> None:
        """Stop taking work, let running generations finish for up to ``grace`` seconds, then cut the rest.

        Returns once no generation is running (or, if a thread will not end, ``CUT_SECONDS`` after the cut).
        Every request ends with something the client can read: a ``done``, or a ``shutdown_error``.
        """
        lifecycle, gate = self.lifecycle, self.gate
        lifecycle.stop_taking_work()  # readiness turns 503 at once; Generations.open refuses newcomers
        gate.close(lifecycle.refusal)  # queued requests are refused now, not after the grace
        await self.prefills.close()  # background work: none of it is worth the grace
        started = time.perf_counter()
        log.info("draining", running=gate.running, grace_s=grace)
        with anyio.move_on_after(grace):
            async with anyio.create_task_group() as group:

                async def until(event: Callable[[], Awaitable[object]]) -> None:
                    await event()
                    group.cancel_scope.cancel()

                group.start_soon(until, gate.wait_idle)
                group.start_soon(until, self._hurry.wait)
        await self._store_prefixes()  # before any cut: the cut stops the engine
        cut = gate.running
        if cut:
            lifecycle.cutting = True
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

    async def _restore_prefixes(self, engine: StoresPrefixes) -> None:
        """``TTFT_PREFIX_STORE_MB``: the prefixes of the last drain back into the engine's cache. A failure is
        logged, never raised: the server starts cold."""
        try:
            await engine.restore_prefixes()
        except Exception as exc:
            log.warning("prefix_store", outcome="failed", error=f"{type(exc).__name__}: {exc}")

    async def _store_prefixes(self) -> None:
        """``TTFT_PREFIX_STORE_MB``: the engine's pinned and most used prefixes to the cache directory. A failure
        is logged, never raised: the drain goes on."""
        engine = self.engine
        if not self.settings.prefix_store_mb or not isinstance(engine, StoresPrefixes):
            return
        try:
            await engine.store_prefixes()
        except Exception as exc:
            log.warning("prefix_store", outcome="failed", error=f"{type(exc).__name__}: {exc}")

    def hurry(self) -> None:
        """End the drain grace now (a second SIGTERM / Ctrl-C): running generations are cut at once."""
        self._hurry.set()

    async def stop(self) -> None:
        self.lifecycle.stop_taking_work()
        if self._watch is not None:
            self._watch.cancel()
        await self.streams.close()
        if self.jobs is not None:
            await self.jobs.close()
        await self.engine.close()


def _stream_store(settings: Settings) -> StreamStore:
    """With a Redis URL, streams live in Redis, so that any replica sharing it can resume or delete them."""
    if settings.redis_url:
        from ttft_sse.stores.resumable_redis import RedisStreams  # imports redis: only when asked for

        return RedisStreams(settings)
    return Streams(
        grace=settings.resume_grace_seconds,
        max_streams=settings.max_streams,
        buffer_events=settings.stream_buffer_events,
    )


def _job_store(settings: Settings, generations: Generations) -> JobStore:
    if settings.redis_url:
        from ttft_sse.stores.jobs_redis import RedisJobs  # imports Celery and redis: only when asked for

        return RedisJobs(settings)
    return EmbeddedJobs(settings, generations)


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
