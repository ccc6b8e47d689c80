"""Every metric the service exports, with units in their names, and the ``observe_*`` helpers the rest calls.

Names read next to vLLM's (``vllm:time_to_first_token_seconds`` is ``ttft_sse_time_to_first_token_seconds``
here). Each app gets its own ``CollectorRegistry``, made by its runtime: nothing is registered on
prometheus-client's global registry, so several apps in one process (the tests) never collide.

Who records what (no other module touches a metric object)::

    Generations.open   a request refused before a Run exists (not ready, prompt too long, no room)
    Run.events         one RequestMetrics per request: queue wait, TTFT, inter-token gaps, prefill, duration,
                       tokens, outcome
    errors' handlers   a request refused by its route before it reached Generations (a bad body, say)
    each scrape        running and waiting requests (the gate), start-up stages (the stage clock), process
                       memory, CUDA memory and GPU utilisation, the batched engine's prefix cache and KV cache
                       (its ``stats()``)

Every generating request is counted once in ``ttft_sse_requests_total{endpoint, outcome}``. Outcomes:

    ok           generation finished (finish_reason stop or length)
    cancelled    the client left before the end (its generation, admitted or queued, was stopped)
    client_gone  the client left before its request was even read (mid-upload): nothing was generated
    invalid      4xx: the request was wrong
    overloaded   503: no generation slot and no queue place, or the queue wait ran out
    unavailable  503: the model is still loading
    shutdown     the server is draining: refused (503, or queued when the drain began), or cut at its deadline
    error        5xx: generation failed
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Literal

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder

from ttft_sse.admission.gate import Gate
from ttft_sse.admission.targets import Degrader, Targets
from ttft_sse.engine.base import Engine, Finished
from ttft_sse.errors import ClientError, ClientGone, Overloaded, ShuttingDown, Unavailable
from ttft_sse.gauges import GpuProbe, StateCollector
from ttft_sse.stages import StageClock

if TYPE_CHECKING:
    pass

log = structlog.get_logger("ttft_sse.metrics")

Outcome = Literal["ok", "cancelled", "client_gone", "invalid", "overloaded", "unavailable", "shutdown", "error"]
OUTCOMES: tuple[Outcome, ...] = (
    "ok", "cancelled", "client_gone", "invalid", "overloaded", "unavailable", "shutdown", "error",
)  # fmt: skip

# Latency buckets resolving 10 ms … 30 s, with edges on the alert thresholds (0.5 s TTFT, 1 s queue wait) so
# that histogram_quantile interpolates inside the right bucket.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
)  # fmt: skip
# A decode step of a small model on a GPU takes a few milliseconds: finer at the bottom.
INTER_TOKEN_BUCKETS = (0.001, 0.0025, *LATENCY_BUCKETS)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

_COUNTED = "_ttft_sse_counted"


def outcome_of(exc: BaseException) -> Outcome:
    """The outcome a request that ended with ``exc`` is counted under."""
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, ShuttingDown):
        return "shutdown"
    if isinstance(exc, Unavailable):
        return "unavailable"
    if isinstance(exc, ClientError):
        return "invalid"
    if isinstance(exc, ClientGone):
        return "client_gone"
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return "cancelled"
    return "error"


def _claim(exc: BaseException) -> bool:
    """True the first time it is asked about ``exc``: an exception that ends a request is counted once.

    ``Run.events`` counts a failure and re-raises it; ``/complete`` hands it on to the exception handlers, which
    count whatever no one counted before (a bad body). The mark on the exception is what keeps that one count.
    """
    if getattr(exc, _COUNTED, False):
        return False
    with contextlib.suppress(AttributeError):  # an exception type with __slots__: counted, but cannot be marked
        setattr(exc, _COUNTED, True)
    return True


class Metrics:
    """One app's metrics, on its own registry. ``render`` gives the exposition for ``GET /metrics``."""

    def __init__(
        self,
        *,
        gate: Gate | None = None,
        clock: StageClock | None = None,
        engine: Engine | None = None,
        gpu: GpuProbe | None = None,
        targets: Targets | None = None,
        degrader: Degrader | None = None,
    ) -> None:
        """Request series only; with ``gate``, ``clock`` and ``engine`` also the series read from them on each
        scrape (running and waiting requests, start-up stages, the engine's batching, process and GPU memory)."""
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_cpu_seconds_total, …
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        by_endpoint = ["endpoint"]
        self.requests = Counter(
            "ttft_sse_requests",
            "Generating requests by endpoint and outcome "
            "(ok, cancelled, client_gone, invalid, overloaded, unavailable, shutdown, error).",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.ttft = Histogram(
            "ttft_sse_time_to_first_token_seconds",
            "From the request's arrival to its first token handed to the transport (for a generation that "
            "produces no text: to its end). Observed once per request that got that far.",
            by_endpoint,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "ttft_sse_queue_wait_seconds",
            "Time a request waited at the admission gate for a generation slot (0 when one was free).",
            by_endpoint,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill = Histogram(
            "ttft_sse_prefill_seconds",
            "Engine time from the start of generation to the first token (prompt processing and one decode step).",
            by_endpoint,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "ttft_sse_inter_token_latency_seconds",
            "Gap between consecutive pieces of text handed to the transport.",
            by_endpoint,
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "ttft_sse_request_duration_seconds",
            "From the request's arrival to the end of its generation, for requests that finished (outcome ok).",
            by_endpoint,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "ttft_sse_prompt_tokens",
            "Prompt tokens of finished generations (the usage reported to clients).",
            by_endpoint,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "ttft_sse_generation_tokens",
            "Generated tokens of finished generations (the usage reported to clients).",
            by_endpoint,
            registry=registry,
        )
        self.tokens_per_request = Histogram(
            "ttft_sse_request_generation_tokens",
            "Generated tokens per finished request. Sudden growth can be a prompt-injection attack.",
            by_endpoint,
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.first_token_targets = Counter(
            "ttft_sse_first_token_targets",
            "Requests of a lane with a first-token target (TTFT_SLA_MS), by whether their first token met it.",
            ["lane", "result"],
            registry=registry,
        )
        self.late_refusals = Counter(
            "ttft_sse_late_refusals",
            "Requests of a lane with a first-token target admitted (a 200 sent), then refused after waiting as long "
            "as the target allows: the admission's prediction let them in. Clients cannot retry these elsewhere.",
            ["lane"],
            registry=registry,
        )
        self.max_tokens_reached = Counter(
            "ttft_sse_requests_max_tokens_reached",
            "Finished requests that stopped at their max_tokens cap (finish_reason length).",
            by_endpoint,
            registry=registry,
        )
        if gate is not None and clock is not None and engine is not None:
            registry.register(StateCollector(gate, clock, engine, gpu or GpuProbe(), targets, degrader))

    def request(self, endpoint: str, *, arrival: float, record: bool = True) -> RequestMetrics:
        """The recorder for one generation (``record=False``: one that is not counted, the warm-up)."""
        return RequestMetrics(self if record else None, endpoint, arrival)

    def observe_refused(self, endpoint: str, exc: BaseException) -> None:
        """Count a request that ended with ``exc`` before it generated anything; each exception counts once."""
        if _claim(exc):
            self.requests.labels(endpoint, outcome_of(exc)).inc()

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition (Prometheus text, or OpenMetrics when ``accept`` asks for it) and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class RequestMetrics:
    """The metrics of one generation, fed by ``Run.events`` as it goes; ``ended`` is called exactly once.

    The times are the ones ``Run.events`` puts in the request's ``timings`` (and ``/complete`` in its
    ``Server-Timing`` header), so a request's header and its observations tell the same story.
    """

    def __init__(self, metrics: Metrics | None, endpoint: str, arrival: float) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._arrival = arrival
        self._last: float | None = None
        self._ended = False
        if metrics is not None:  # bind the children once: the per-token path does no label lookup
            self._ttft = metrics.ttft.labels(endpoint)
            self._inter_token = metrics.inter_token.labels(endpoint)

    def observe_target(self, lane: str, met: bool) -> None:
        """A first token of a lane with a target: within it or not (how often the admission's prediction erred)."""
        if self._metrics is not None:
            self._metrics.first_token_targets.labels(lane, "met" if met else "missed").inc()

    def observe_late_refusal(self, lane: str) -> None:
        """A request of ``lane`` admitted, then refused at its first-token deadline (the safety net)."""
        if self._metrics is not None:
            self._metrics.late_refusals.labels(lane).inc()

    def observe_admitted(self, queue_seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.queue_wait.labels(self._endpoint).observe(queue_seconds)

    def observe_piece(self, at: float) -> None:
        """A piece of text handed to the transport at ``at`` (``perf_counter``)."""
        if self._metrics is None:
            return
        if self._last is None:
            self._ttft.observe(at - self._arrival)
        else:
            self._inter_token.observe(at - self._last)
        self._last = at

    def observe_finished(self, finished: Finished, at: float) -> None:
        metrics = self._metrics
        if metrics is None:
            return
        endpoint = self._endpoint
        if self._last is None:  # no text at all: the end is the first thing the client gets
            self._ttft.observe(at - self._arrival)
        prefill_ms = finished.timings.get("prefill_ms")
        if prefill_ms is not None:
            metrics.prefill.labels(endpoint).observe(prefill_ms / 1000)
        metrics.duration.labels(endpoint).observe(at - self._arrival)
        usage = finished.usage
        metrics.prompt_tokens.labels(endpoint).inc(usage.prompt_tokens)
        metrics.generation_tokens.labels(endpoint).inc(usage.completion_tokens)
        metrics.tokens_per_request.labels(endpoint).observe(usage.completion_tokens)
        if finished.finish_reason == "length":
            metrics.max_tokens_reached.labels(endpoint).inc()

    def observe_ended(self, outcome: Outcome, exc: BaseException | None = None) -> None:
        """Count the request under ``outcome``; only the first call counts (``Run.close`` calls it as well)."""
        if self._metrics is None or self._ended:
            return
        self._ended = True
        if exc is None or _claim(exc):
            self._metrics.requests.labels(self._endpoint, outcome).inc()
