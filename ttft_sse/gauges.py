"""The series read on each scrape, not observed as requests go: the gate's running and waiting requests, the
start-up stages, the batched engine's prefix and KV cache (its ``stats()``), CUDA memory and GPU utilisation, the
first-token targets and whether the engine runs degraded. :class:`StateCollector` is registered on each app's
registry by :class:`~ttft_sse.metrics.Metrics`."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import structlog
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ttft_sse.admission.gate import Gate
from ttft_sse.admission.targets import Degrader, Targets
from ttft_sse.engine.base import Engine
from ttft_sse.stages import StageClock

if TYPE_CHECKING:
    from ttft_sse.engine.batched.stats import BatchStats

log = structlog.get_logger("ttft_sse.metrics")

# Exported only where a CUDA engine runs (absent elsewhere): the dashboard test checks names against these.
CUDA_METRICS = (
    "ttft_sse_cuda_memory_allocated_bytes",
    "ttft_sse_cuda_memory_reserved_bytes",
    "ttft_sse_gpu_utilization_ratio",
)
# Exported only by an engine with batching stats (the batched one), once loaded; sample names, as for CUDA_METRICS.
BATCH_METRICS = (
    "ttft_sse_prefix_cache_queries_tokens_total",
    "ttft_sse_prefix_cache_hits_tokens_total",
    "ttft_sse_batch_steps_total",
    "ttft_sse_kv_cache_usage_ratio",
    "ttft_sse_kv_cache_tokens",
    "ttft_sse_kv_cache_capacity_tokens",
)

KERNEL_METRICS = ("ttft_sse_kernel_chunks_total",)
"""The block kernel's helper threads (``TTFT_KERNEL_HELPERS``): exported only where an engine started them."""


class StateCollector:
    """Series read on each scrape from the gate, the stage clock, the engine, the GPU, the first-token targets and
    the degrader: nothing has to keep them up to date."""

    def __init__(
        self,
        gate: Gate,
        clock: StageClock,
        engine: Engine,
        gpu: GpuProbe,
        targets: Targets | None = None,
        degrader: Degrader | None = None,
    ) -> None:
        self._gate = gate
        self._clock = clock
        self._engine = engine
        self._gpu = gpu
        self._targets = targets
        self._degrader = degrader

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "ttft_sse_num_requests_running", "Requests holding a generation slot.", value=self._gate.running
        )
        yield GaugeMetricFamily(
            "ttft_sse_num_requests_waiting", "Requests queued for a generation slot.", value=self._gate.waiting
        )
        stages = GaugeMetricFamily(
            "ttft_sse_startup_stage_seconds",
            "How long each start-up stage took (imports, cache_lookup, conversion, tokenizer, model, warmup).",
            labels=["stage"],
        )
        for stage, seconds in self._clock.seconds().items():
            stages.add_metric([stage], seconds)
        yield stages
        yield from _batch_metrics(self._engine)
        yield from self._gpu.collect()
        yield from self._first_token_targets()

    def _first_token_targets(self) -> Iterator[Metric]:
        if self._targets is not None:
            targets = GaugeMetricFamily(
                "ttft_sse_first_token_target_seconds", "Each lane's first-token target (TTFT_SLA_MS).", labels=["lane"]
            )
            for lane, seconds in sorted(self._targets.targets.items()):
                targets.add_metric([lane.label], seconds)
            yield targets
        if self._degrader is not None:
            yield GaugeMetricFamily(
                "ttft_sse_degraded",
                "1 while the engine runs its faster mode because a lane missed its first-token target (TTFT_DEGRADE).",
                value=int(self._degrader.degraded),
            )
            yield CounterMetricFamily(
                "ttft_sse_degrade_switches", "Switches into and out of the faster mode.", value=self._degrader.switches
            )


@runtime_checkable
class Batching(Protocol):
    """An engine that batches requests and can say how (``BatchedEngine``). Optional: an engine without ``stats``
    exports no batching metrics."""

    def stats(self) -> BatchStats: ...


def _batch_metrics(engine: object) -> Iterator[Metric]:
    """The batched engine's prefix cache and KV cache, from its ``stats()`` (counters it keeps itself).

    Absent, not zero, for an engine that does not batch, and before the batched one has created its cache (a
    capacity of 0: not loaded yet), so that a hit ratio or a usage never reads as a real 0. The counters include
    the start-up warm-up, which the per-request metrics leave out.
    """
    if not isinstance(engine, Batching):
        return
    try:
        stats = engine.stats()
    except Exception as exc:  # reading the library's state failed: leave these out, keep the rest of the scrape
        log.warning("batch_stats_unreadable", error=str(exc), error_type=type(exc).__name__)
        return
    capacity = stats.kv_tokens_capacity
    if capacity <= 0:
        return
    yield CounterMetricFamily(
        "ttft_sse_prefix_cache_queries_tokens",
        "Prompt tokens the batched engine scheduled, served from the prefix cache or computed "
        "(the denominator of the prefix cache hit ratio).",
        value=stats.prompt_tokens,
    )
    yield CounterMetricFamily(
        "ttft_sse_prefix_cache_hits_tokens",
        "Prompt tokens the batched engine served from the prefix cache (KV blocks of earlier prompts) "
        "instead of computing them.",
        value=stats.prefix_hit_tokens,
    )
    yield CounterMetricFamily(
        "ttft_sse_batch_steps",
        "Forward passes of the batching loop that produced tokens; one step serves every request in the batch.",
        value=stats.steps,
    )
    yield CounterMetricFamily(
        "ttft_sse_prefill_process_first_tokens",
        "First tokens that the prefill process (a second process, on another core) gave before the batch did.",
        value=stats.side_first_tokens,
    )
    yield CounterMetricFamily(
        "ttft_sse_interlude_first_tokens",
        "First tokens computed between two layers of the batch's step in flight (TTFT_PREFILL_BETWEEN_LAYERS), "
        "for requests that arrived while the batch was busy.",
        value=stats.interlude_first_tokens,
    )
    yield CounterMetricFamily(
        "ttft_sse_batch_rows_sat_out",
        "Rows of lower-lane generations left out of a batch step, one per generation and step, so that the high "
        "lane's requests had the step's rows.",
        value=stats.rows_sat_out,
    )
    if stats.kernel is not None:
        chunks = CounterMetricFamily(
            "ttft_sse_kernel_chunks",
            "Chunks of the block kernel's shared calls (and of batched steps' attention, by rows and KV heads), by who "
            "computed them: the calling thread, its helper threads "
            "(on a core nothing else wanted: TTFT_KERNEL_HELPERS), or the caller after taking one back from a helper "
            "that held it too long.",
            labels=["by"],
        )
        chunks.add_metric(["caller"], stats.kernel.by_caller - stats.kernel.taken_back)
        chunks.add_metric(["helpers"], stats.kernel.by_helpers)
        chunks.add_metric(["taken_back"], stats.kernel.taken_back)
        yield chunks
    yield GaugeMetricFamily(
        "ttft_sse_kv_cache_usage_ratio",
        "Fraction of the batched engine's KV cache held by running requests, 0-1 "
        "(blocks kept only for prefix reuse count as free: they are evicted when the cache runs short).",
        value=stats.kv_tokens_in_use / capacity,
    )
    tokens = GaugeMetricFamily(
        "ttft_sse_kv_cache_tokens",
        "Batched engine KV cache held, in tokens: in_use by running requests, cached only for prefix reuse.",
        labels=["state"],
    )
    tokens.add_metric(["in_use"], stats.kv_tokens_in_use)
    tokens.add_metric(["cached"], stats.kv_tokens_cached)
    yield tokens
    yield GaugeMetricFamily(
        "ttft_sse_kv_cache_capacity_tokens",
        "Size of the batched engine's KV cache in tokens (TTFT_KV_CACHE_TOKENS, rounded up to whole blocks).",
        value=capacity,
    )


def _loaded_torch() -> Any:
    """torch if the engine imported it; never imports it (a scrape must not pull torch into a CPU-less process)."""
    return sys.modules.get("torch")


def _import_nvml() -> Any:
    try:
        return importlib.import_module("pynvml")  # optional: the nvidia-ml-py package
    except ImportError:
        return None


class GpuProbe:
    """CUDA memory (torch's caching allocator) and GPU utilisation (NVML), read on each scrape.

    Absent, not zero, where they cannot be read: torch not imported or CUDA never initialised (a CPU engine),
    NVML missing (``pynvml`` not installed, no driver). A zero would read as an idle GPU and fire the
    scale-down alert. Utilisation is NVML's per-device "GPU busy" percentage, as a 0-1 ratio; the device is
    found by its UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering cannot mislabel it.
    """

    def __init__(self, torch: Callable[[], Any] = _loaded_torch, nvml: Callable[[], Any] = _import_nvml) -> None:
        self._torch = torch
        self._load_nvml = nvml
        self._nvml: Any = None
        self._nvml_tried = False
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        torch = self._torch()
        if torch is None or not torch.cuda.is_initialized():
            return
        allocated = GaugeMetricFamily(
            "ttft_sse_cuda_memory_allocated_bytes", "Bytes held by live tensors (torch).", labels=["device"]
        )
        reserved = GaugeMetricFamily(
            "ttft_sse_cuda_memory_reserved_bytes",
            "Bytes held by torch's caching allocator, live tensors and cache (see cuda_empty_cache_every).",
            labels=["device"],
        )
        utilization = GaugeMetricFamily(
            "ttft_sse_gpu_utilization_ratio",
            "Fraction of the last sample period in which a kernel ran on the GPU (NVML), 0-1.",
            labels=["device"],
        )
        for index in range(torch.cuda.device_count()):
            device = f"cuda:{index}"
            allocated.add_metric([device], float(torch.cuda.memory_allocated(index)))
            reserved.add_metric([device], float(torch.cuda.memory_reserved(index)))
            ratio = self._utilization(torch, index)
            if ratio is not None:
                utilization.add_metric([device], ratio)
        yield allocated
        yield reserved
        if utilization.samples:
            yield utilization

    def _utilization(self, torch: Any, index: int) -> float | None:
        with self._lock:
            nvml = self._nvml_library()
            if nvml is None:
                return None
            try:
                handle = self._handles.get(index)
                if handle is None:
                    uuid = str(torch.cuda.get_device_properties(index).uuid)
                    uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
                    handle = self._handles[index] = nvml.nvmlDeviceGetHandleByUUID(uuid)
                return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100
            except Exception as exc:  # NVMLError and friends: leave the series out this time
                log.debug("gpu_utilization_unreadable", device=index, error=str(exc))
                return None

    def _nvml_library(self) -> Any:
        if not self._nvml_tried:
            self._nvml_tried = True
            nvml = self._load_nvml()
            if nvml is None:
                log.info("gpu_utilization_unavailable", reason="pynvml (nvidia-ml-py) is not installed")
                return None
            try:
                nvml.nvmlInit()
            except Exception as exc:
                log.info("gpu_utilization_unavailable", reason=f"NVML did not initialise: {exc}")
                return None
            self._nvml = nvml
        return self._nvml
