"""``/metrics``: what each kind of request moves, scraped from real servers (FakeEngine; the model is not the point).

Streaming, disconnects and queueing run under real hypercorn (``tests.support.servers.running``); cases where only the
final answer matters use the in-process client. Every assertion is on a change between two scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from tests.support.scrape import Scrape, parse, scrape
from tests.support.servers import StreamReader, parse_sse, running, serving
from ttft_sse.app import create_app
from ttft_sse.engine.base import Prompt
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.batched.stats import BatchStats
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.engine.kernels import kernel
from ttft_sse.gauges import BATCH_METRICS, CUDA_METRICS, KERNEL_METRICS, GpuProbe
from ttft_sse.metrics import LATENCY_BUCKETS, Metrics, outcome_of
from ttft_sse.runtime import Runtime
from ttft_sse.settings import Settings

REQUESTS = "ttft_sse_requests_total"
TTFT = "ttft_sse_time_to_first_token_seconds"
PIECES = ("Hello", ",", " world", "!")  # FakeEngine's default script: 4 tokens, 4 pieces


@contextmanager
def served(engine: FakeEngine, **settings: Any) -> Iterator[tuple[httpx.Client, str, Runtime]]:
    """A real server. No warm-up: it would run into the scripted hold or failure before the test's requests."""
    app = create_app(Settings(warmup=False, **settings), engine)
    with running(app) as base, httpx.Client(timeout=10) as client:
        yield client, base, app.state.runtime


@contextmanager
def in_process(engine: FakeEngine, **settings: Any) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(**settings), engine), raise_server_exceptions=False) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        yield client


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll until ``condition`` holds (the server notices a disconnect on its own schedule). Not a timing test."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition did not hold in time")
        time.sleep(0.01)


def outcomes_moved(after: Scrape, before: Scrape) -> dict[tuple[str, str], float]:
    """Every ``requests_total`` series that changed, as {(endpoint, outcome): delta}."""
    moved = {}
    for labels in set(after.matching(REQUESTS)) | set(before.matching(REQUESTS)):
        as_dict = dict(labels)
        delta = after.delta(before, REQUESTS, **as_dict)
        if delta:
            moved[(as_dict["endpoint"], as_dict["outcome"])] = delta
    return moved


# -- the exposition ------------------------------------------------------------------------------------------------


def test_exposition_has_every_family_with_units_and_buckets_from_10ms_to_30s() -> None:
    with in_process(FakeEngine()) as client:
        client.post("/complete", json={"prompt": "hi", "max_tokens": 2})
        response = client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    got = parse(response.text)
    expected = {
        "ttft_sse_requests": "counter",
        "ttft_sse_time_to_first_token_seconds": "histogram",
        "ttft_sse_queue_wait_seconds": "histogram",
        "ttft_sse_prefill_seconds": "histogram",
        "ttft_sse_inter_token_latency_seconds": "histogram",
        "ttft_sse_request_duration_seconds": "histogram",
        "ttft_sse_prompt_tokens": "counter",
        "ttft_sse_generation_tokens": "counter",
        "ttft_sse_request_generation_tokens": "histogram",
        "ttft_sse_requests_max_tokens_reached": "counter",
        "ttft_sse_num_requests_running": "gauge",
        "ttft_sse_num_requests_waiting": "gauge",
        "ttft_sse_startup_stage_seconds": "gauge",
        "process_resident_memory_bytes": "gauge",
    }
    assert {name: got.families.get(name) for name in expected} == expected
    assert got.value("process_resident_memory_bytes") > 0
    for name in ("ttft_sse_time_to_first_token_seconds", "ttft_sse_queue_wait_seconds", "ttft_sse_prefill_seconds"):
        edges = {float(dict(labels)["le"]) for labels in got.matching(f"{name}_bucket")}
        assert {0.01, 0.5, 1.0, 30.0} <= edges, name
        assert edges == {*LATENCY_BUCKETS, float("inf")}
    # No CUDA here: the GPU series are absent, not zero; nor does the fake engine batch.
    assert not any(name.startswith(CUDA_METRICS) for name in got.names())
    assert not got.names() & set(BATCH_METRICS)


def test_openmetrics_when_the_scraper_asks_for_it() -> None:
    with in_process(FakeEngine()) as client:
        response = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert response.text.endswith("# EOF\n")


def test_warmup_is_not_counted_and_startup_stages_are_exported() -> None:
    with in_process(FakeEngine()) as client:
        got = scrape(client)
        runtime: Runtime = client.app.state.runtime  # type: ignore[attr-defined]
        stages = runtime.lifecycle.clock.seconds()
    assert set(stages) == {"model", "warmup"}
    for stage, seconds in stages.items():
        assert got.value("ttft_sse_startup_stage_seconds", stage=stage) == seconds
    assert got.matching(REQUESTS) == {}
    assert got.matching(f"{TTFT}_count") == {}


# -- outcomes ------------------------------------------------------------------------------------------------------


def test_finished_requests_count_ok_tokens_equal_to_usage_and_one_ttft_each() -> None:
    with served(FakeEngine()) as (client, base, _):
        before = scrape(client, base)
        with client.stream("GET", f"{base}/stream?prompt=a+b+c") as response:
            streamed = list(parse_sse(response.iter_lines()))
        completed = client.post(f"{base}/complete", json={"prompt": "one two", "max_tokens": 2}).json()
        after = scrape(client, base)
    done = streamed[-1].data
    assert [e.event for e in streamed] == ["token"] * 4 + ["done"]
    assert outcomes_moved(after, before) == {("stream", "ok"): 1, ("complete", "ok"): 1}
    for endpoint, usage in (("stream", done["usage"]), ("complete", completed["usage"])):
        assert after.delta(before, "ttft_sse_generation_tokens_total", endpoint=endpoint) == usage["completion_tokens"]
        assert after.delta(before, "ttft_sse_prompt_tokens_total", endpoint=endpoint) == usage["prompt_tokens"]
        assert after.delta(before, f"{TTFT}_count", endpoint=endpoint) == 1
        assert after.delta(before, "ttft_sse_request_duration_seconds_count", endpoint=endpoint) == 1
        assert after.delta(before, "ttft_sse_queue_wait_seconds_count", endpoint=endpoint) == 1
        assert after.delta(before, "ttft_sse_prefill_seconds_count", endpoint=endpoint) == 1
        assert after.delta(before, "ttft_sse_request_generation_tokens_count", endpoint=endpoint) == 1
        assert (
            after.delta(before, "ttft_sse_request_generation_tokens_sum", endpoint=endpoint)
            == usage["completion_tokens"]
        )
    assert (done["usage"]["completion_tokens"], completed["usage"]["completion_tokens"]) == (4, 2)
    # Gaps between pieces: 4 pieces streamed → 3; 2 pieces completed → 1.
    assert after.delta(before, "ttft_sse_inter_token_latency_seconds_count", endpoint="stream") == 3
    assert after.delta(before, "ttft_sse_inter_token_latency_seconds_count", endpoint="complete") == 1
    # Only the request stopped by its max_tokens counts as capped.
    assert completed["finish_reason"] == "length" and done["finish_reason"] == "stop"
    assert after.delta(before, "ttft_sse_requests_max_tokens_reached_total", endpoint="complete") == 1
    assert after.delta(before, "ttft_sse_requests_max_tokens_reached_total", endpoint="stream") == 0


def test_server_timing_header_and_the_histograms_tell_the_same_story() -> None:
    with in_process(FakeEngine(delay=0.01)) as client:
        before = scrape(client)
        response = client.post("/complete", json={"prompt": "hi"})
        after = scrape(client)
    parts = {}
    for part in response.headers["server-timing"].split(", "):
        name, _, dur = part.partition(";dur=")
        parts[name] = float(dur) / 1000
    assert list(parts) == ["queue", "prefill", "decode", "ttft", "total"]
    assert parts == {name: response.json()["timings"][f"{name}_ms"] / 1000 for name in parts}
    same_part = {
        "queue": "ttft_sse_queue_wait_seconds",
        "prefill": "ttft_sse_prefill_seconds",
        "ttft": "ttft_sse_time_to_first_token_seconds",
        "total": "ttft_sse_request_duration_seconds",
    }
    for part, metric in same_part.items():
        observed = after.delta(before, f"{metric}_sum", endpoint="complete")
        assert observed == pytest.approx(parts[part], abs=0.00005), part  # the header rounds to 0.1 ms


def test_a_stream_the_client_leaves_before_any_token_counts_cancelled_and_no_ttft() -> None:
    engine = FakeEngine(hold_after=0)
    with served(engine) as (client, base, runtime):
        before = scrape(client, base)
        with client.stream("GET", f"{base}/stream?prompt=hi") as response:
            assert response.status_code == 200
            wait_for(lambda: engine.active == 1)
        wait_for(lambda: outcomes_moved(scrape(client, base), before) != {})
        wait_for(lambda: engine.active == 0)
        after = scrape(client, base)
    assert outcomes_moved(after, before) == {("stream", "cancelled"): 1}
    assert after.delta(before, f"{TTFT}_count", endpoint="stream") == 0
    assert after.delta(before, "ttft_sse_generation_tokens_total", endpoint="stream") == 0
    assert after.value("ttft_sse_num_requests_running") == 0
    assert runtime.gate.running == 0


def test_a_stream_the_client_leaves_after_two_tokens_counts_cancelled_and_its_ttft() -> None:
    engine = FakeEngine(hold_after=2)
    with served(engine) as (client, base, _):
        before = scrape(client, base)
        with client.stream("GET", f"{base}/stream?prompt=hi") as response:
            events = parse_sse(response.iter_lines())
            assert [next(events).event, next(events).event] == ["token", "token"]
        wait_for(lambda: outcomes_moved(scrape(client, base), before) != {})
        after = scrape(client, base)
    assert outcomes_moved(after, before) == {("stream", "cancelled"): 1}
    # The first token reached the client, so its TTFT is real and observed; the gap to the second one too.
    assert after.delta(before, f"{TTFT}_count", endpoint="stream") == 1
    assert after.delta(before, "ttft_sse_inter_token_latency_seconds_count", endpoint="stream") == 1
    # Unfinished: no usage was reported, none is counted, and there is no end-to-end duration.
    assert after.delta(before, "ttft_sse_generation_tokens_total", endpoint="stream") == 0
    assert after.delta(before, "ttft_sse_request_duration_seconds_count", endpoint="stream") == 0


def test_an_engine_failure_counts_error_once_on_both_endpoints() -> None:
    with served(FakeEngine(fail_after=1)) as (client, base, _):
        before = scrape(client, base)
        with client.stream("GET", f"{base}/stream?prompt=hi") as response:
            events = [e.event for e in parse_sse(response.iter_lines())]
        failed = client.post(f"{base}/complete", json={"prompt": "hi"})
        after = scrape(client, base)
    assert events == ["token", "error"]
    assert failed.status_code == 500
    # /complete's failure is counted by Run.events and re-raised to the error handler: still one count.
    assert outcomes_moved(after, before) == {("stream", "error"): 1, ("complete", "error"): 1}


class BuggyEngine(FakeEngine):
    def prepare(self, *, prompt: str | None, messages: Any, raw: bool, parse_special: bool = False) -> Prompt:
        raise KeyError("a bug, not a ServiceError")


def test_an_unexpected_exception_before_generation_counts_error_once() -> None:
    with in_process(BuggyEngine(), warmup=False) as client:
        before = scrape(client)
        assert client.post("/complete", json={"prompt": "hi"}).status_code == 500
        after = scrape(client)
    assert outcomes_moved(after, before) == {("complete", "error"): 1}


def test_invalid_requests_count_invalid_whether_the_route_or_generations_refused_them() -> None:
    with in_process(FakeEngine(context_length=20)) as client:
        before = scrape(client)
        statuses = [
            client.post("/complete", json={"prompt": "hi", "bogus": 1}).status_code,  # route: unknown field
            client.post("/complete", content=b"<x/>", headers={"content-type": "application/xml"}).status_code,
            client.get("/stream?prompt=hi&max_tokens=ten").status_code,  # route: bad query
            client.post("/stream", json={"prompt": " ".join(["w"] * 25)}).status_code,  # open: prompt too long
            client.post("/complete", json={"prompt": " ".join(["w"] * 15), "max_tokens": 10}).status_code,  # open
        ]
        after = scrape(client)
    assert statuses == [400, 415, 400, 400, 400]
    assert outcomes_moved(after, before) == {("complete", "invalid"): 3, ("stream", "invalid"): 2}


def test_requests_before_the_model_is_ready_count_unavailable() -> None:
    engine = FakeEngine(hold_load=True)  # loading until the test says
    with TestClient(create_app(Settings(), engine), raise_server_exceptions=False) as client:
        before = scrape(client)
        assert client.post("/complete", json={"prompt": "hi"}).status_code == 503
        after = scrape(client)
        engine.loaded.set()
    assert outcomes_moved(after, before) == {("complete", "unavailable"): 1}


def test_full_gate_counts_overloaded_and_running_waiting_gauges_follow_the_gate() -> None:
    engine = FakeEngine(hold_after=1)
    with served(engine, max_concurrency=1, max_queue=1) as (client, base, _):
        before = scrape(client, base)
        with (
            client.stream("GET", f"{base}/stream?prompt=first") as first,
            client.stream("GET", f"{base}/stream?prompt=second") as second,
        ):
            first_events, second_events = parse_sse(first.iter_lines()), parse_sse(second.iter_lines())
            assert next(first_events).event == "token"  # holds its slot from here on
            assert next(second_events).event == "queued"
            during = scrape(client, base)
            refused = client.post(f"{base}/complete", json={"prompt": "third"})
            engine.release.set()
            rest = [e.event for e in first_events] + [e.event for e in second_events]
        after = scrape(client, base)
    assert (during.value("ttft_sse_num_requests_running"), during.value("ttft_sse_num_requests_waiting")) == (1, 1)
    assert refused.status_code == 503
    assert rest == ["token", "token", "token", "done", "token", "token", "token", "token", "done"]
    assert outcomes_moved(after, before) == {("complete", "overloaded"): 1, ("stream", "ok"): 2}
    assert after.delta(before, "ttft_sse_queue_wait_seconds_count", endpoint="stream") == 2
    assert after.delta(before, "ttft_sse_queue_wait_seconds_sum", endpoint="stream") > 0  # the second one waited
    assert (after.value("ttft_sse_num_requests_running"), after.value("ttft_sse_num_requests_waiting")) == (0, 0)


def test_a_queue_wait_that_runs_out_counts_overloaded_once() -> None:
    engine = FakeEngine(hold_after=1)
    with served(engine, max_concurrency=1, max_queue=1, queue_timeout_seconds=0.2) as (client, base, _):
        before = scrape(client, base)
        with client.stream("GET", f"{base}/stream?prompt=first") as first:
            events = parse_sse(first.iter_lines())
            assert next(events).event == "token"
            timed_out = client.post(f"{base}/complete", json={"prompt": "second"})
            engine.release.set()
            assert [e.event for e in events][-1] == "done"
        after = scrape(client, base)
    assert timed_out.status_code == 503
    assert "in the queue" in timed_out.json()["error"]["message"]
    # Counted by Run.events when the wait ran out, then re-raised through the error handler: one count.
    assert outcomes_moved(after, before) == {("complete", "overloaded"): 1, ("stream", "ok"): 1}


def test_a_drain_counts_refused_queued_and_cut_requests_as_shutdown() -> None:
    engine = FakeEngine(hold_after=1)
    app = create_app(Settings(warmup=False, max_concurrency=1, max_queue=4, drain_seconds=3600), engine)
    with serving(app) as served:
        cut = StreamReader(f"{served.base}/stream?prompt=running")
        assert (first := cut.next()) is not None and first.event == "token"
        queued = StreamReader(f"{served.base}/stream?prompt=queued")
        assert (waiting := queued.next()) is not None and waiting.event == "queued"
        served.stop()  # SIGTERM: the queued request is refused at once
        assert [e.event for e in queued.rest()] == ["error"]
        wait_for(lambda: httpx.get(f"{served.base}/readyz").status_code == 503)
        assert httpx.post(f"{served.base}/complete", json={"prompt": "late"}).status_code == 503
        served.stop()  # a second signal ends the grace: the running one is cut
        assert [e.event for e in cut.rest()] == ["error"]
        assert served.wait_stopped(60)
    got = parse(app.state.runtime.metrics.render()[0].decode())
    assert outcomes_moved(got, parse("")) == {("stream", "shutdown"): 2, ("complete", "shutdown"): 1}
    assert got.value(f"{TTFT}_count", endpoint="stream") == 1  # the cut one had its first token


def test_outcome_of_each_kind_of_ending() -> None:
    import asyncio

    from ttft_sse.errors import EngineError, InvalidRequest, NotReady, Overloaded, PromptTooLong, ShuttingDown

    assert outcome_of(Overloaded("x")) == "overloaded"
    assert outcome_of(NotReady("x")) == "unavailable"
    assert outcome_of(ShuttingDown("x")) == "shutdown"
    assert outcome_of(PromptTooLong("x")) == "invalid"
    assert outcome_of(InvalidRequest("x")) == "invalid"
    assert outcome_of(asyncio.CancelledError()) == "cancelled"
    assert outcome_of(GeneratorExit()) == "cancelled"
    assert outcome_of(EngineError("x")) == "error"
    assert outcome_of(KeyError("x")) == "error"


def test_an_exception_is_counted_once_however_often_it_is_reported() -> None:
    metrics = Metrics()
    exc = ValueError("boom")
    metrics.observe_refused("complete", exc)
    metrics.observe_refused("complete", exc)
    recorder = metrics.request("complete", arrival=0.0)
    recorder.observe_ended("error", exc)
    got = parse(metrics.render()[0].decode())
    assert got.value(REQUESTS, endpoint="complete", outcome="error") == 1


def test_two_apps_in_one_process_keep_separate_registries() -> None:
    a, b = create_app(Settings(), FakeEngine()), create_app(Settings(), FakeEngine())
    a.state.runtime.metrics.observe_refused("complete", ValueError())
    assert parse(a.state.runtime.metrics.render()[0].decode()).value(REQUESTS, endpoint="complete", outcome="error")
    assert parse(b.state.runtime.metrics.render()[0].decode()).matching(REQUESTS) == {}


# -- the batched engine's prefix cache and KV cache (a fake engine with stats(); the real one: test_metrics_live) ---


class StatsEngine(FakeEngine):
    """A FakeEngine that reports batching stats, as ``BatchedEngine`` does: set ``now`` to change them."""

    def __init__(self, now: BatchStats | Exception) -> None:
        super().__init__()
        self.now = now

    def stats(self) -> BatchStats:
        if isinstance(self.now, Exception):
            raise self.now
        return self.now


STATS = BatchStats(
    running=True,
    requests=3,
    streams=3,
    steps=120,
    prompt_tokens=400,
    prefix_hits=5,
    prefix_hit_tokens=180,
    kv_tokens_in_use=2048,
    kv_tokens_cached=512,
    kv_tokens_capacity=8192,
    rows_sat_out=9,
)


def rendered(engine: Any) -> Scrape:
    """One scrape of an app around ``engine``, without starting it (the collector reads the engine as it is)."""
    return parse(create_app(Settings(), engine).state.runtime.metrics.render()[0].decode())


def test_batching_stats_are_exported_as_the_engine_reports_them() -> None:
    engine = StatsEngine(STATS)
    app = create_app(Settings(), engine)
    got = parse(app.state.runtime.metrics.render()[0].decode())
    assert set(BATCH_METRICS) <= got.names()  # the list the dashboard test trusts is the one exported
    assert {
        name: got.families[name]
        for name in got.families
        if name.startswith(("ttft_sse_prefix", "ttft_sse_kv", "ttft_sse_batch"))
    } == {
        "ttft_sse_prefix_cache_queries_tokens": "counter",
        "ttft_sse_prefix_cache_hits_tokens": "counter",
        "ttft_sse_batch_steps": "counter",
        "ttft_sse_batch_rows_sat_out": "counter",
        "ttft_sse_kv_cache_usage_ratio": "gauge",
        "ttft_sse_kv_cache_tokens": "gauge",
        "ttft_sse_kv_cache_capacity_tokens": "gauge",
    }
    assert got.value("ttft_sse_prefix_cache_queries_tokens_total") == 400
    assert got.value("ttft_sse_prefix_cache_hits_tokens_total") == 180
    assert got.value("ttft_sse_batch_steps_total") == 120
    assert got.value("ttft_sse_batch_rows_sat_out_total") == 9  # lower-lane rows left out of steps for the high lane
    assert got.value("ttft_sse_kv_cache_usage_ratio") == 0.25  # 2048 of 8192 in use; cached blocks count as free
    assert got.matching("ttft_sse_kv_cache_tokens") == {
        frozenset({("state", "in_use")}): 2048,
        frozenset({("state", "cached")}): 512,
    }
    assert got.value("ttft_sse_kv_cache_capacity_tokens") == 8192

    # Read on each scrape: nothing has to keep them up to date.
    engine.now = replace(STATS, steps=121, prompt_tokens=437, prefix_hit_tokens=216, kv_tokens_in_use=0)
    later = parse(app.state.runtime.metrics.render()[0].decode())
    assert later.delta(got, "ttft_sse_prefix_cache_queries_tokens_total") == 37
    assert later.delta(got, "ttft_sse_prefix_cache_hits_tokens_total") == 36
    assert later.delta(got, "ttft_sse_batch_steps_total") == 1
    assert later.value("ttft_sse_kv_cache_usage_ratio") == 0.0  # loaded and idle: a real zero
    assert later.has("ttft_sse_kv_cache_usage_ratio")


def test_the_kernel_helpers_chunks_are_exported_by_who_computed_them_where_there_are_helpers() -> None:
    counts = kernel.HelperCounts(helpers=1, calls=50, by_caller=300, by_helpers=200, taken_back=7)
    got = rendered(StatsEngine(replace(STATS, kernel=counts)))
    assert set(KERNEL_METRICS) <= got.names()  # the list the dashboard test trusts is the one exported
    assert got.families["ttft_sse_kernel_chunks"] == "counter"
    assert got.matching("ttft_sse_kernel_chunks_total") == {
        frozenset({("by", "caller")}): 293,  # its own: the 7 it took back are counted apart
        frozenset({("by", "helpers")}): 200,
        frozenset({("by", "taken_back")}): 7,
    }
    assert "ttft_sse_kernel_chunks_total" not in rendered(StatsEngine(STATS)).names()  # no helpers: absent, not 0


def test_openmetrics_exposition_of_the_batching_counters() -> None:
    app = create_app(Settings(), StatsEngine(STATS))
    text = app.state.runtime.metrics.render("application/openmetrics-text; version=1.0.0")[0].decode()
    assert "# TYPE ttft_sse_prefix_cache_hits_tokens counter\n" in text
    assert "\nttft_sse_prefix_cache_hits_tokens_total 180.0\n" in text


def test_batching_series_are_absent_before_the_batched_engine_is_loaded() -> None:
    """A real BatchedEngine, never loaded: it has no cache yet (capacity 0), so there is nothing to report."""
    unloaded = BatchedEngine(Settings())
    assert unloaded.stats().kv_tokens_capacity == 0
    got = rendered(unloaded)
    assert not got.names() & set(BATCH_METRICS)
    assert got.has("ttft_sse_num_requests_running")  # the rest of the scrape is there
    assert not rendered(StatsEngine(replace(STATS, kv_tokens_capacity=0))).names() & set(BATCH_METRICS)


def test_batching_series_are_left_out_when_stats_fail_and_the_scrape_still_answers() -> None:
    got = rendered(StatsEngine(RuntimeError("the library changed its internals")))
    assert not got.names() & set(BATCH_METRICS)
    assert got.has("ttft_sse_num_requests_running") and got.value("process_resident_memory_bytes") > 0


# -- the GPU probe (fakes: there is no CUDA here) -------------------------------------------------------------------


class FakeCuda:
    def __init__(self, *, initialized: bool, devices: int = 2) -> None:
        self.initialized = initialized
        self.devices = devices

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.devices

    def memory_allocated(self, index: int) -> int:
        return 1000 + index

    def memory_reserved(self, index: int) -> int:
        return 5000 + index

    def get_device_properties(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(uuid=f"uuid-{index}")


class FakeNvml:
    def __init__(self, *, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.inits = 0
        self.looked_up: list[str] = []

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.looked_up.append(uuid)
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=42 if handle == "GPU-uuid-0" else 7, memory=0)


def gpu_scrape(probe: GpuProbe) -> Scrape:
    metrics = Metrics()
    metrics.registry.register(probe)
    return parse(metrics.render()[0].decode())


def test_gpu_series_are_absent_without_torch_or_before_cuda_is_initialised() -> None:
    nvml = FakeNvml()
    assert gpu_scrape(GpuProbe(torch=lambda: None, nvml=lambda: nvml)).matching(CUDA_METRICS[0]) == {}
    cpu_torch = SimpleNamespace(cuda=FakeCuda(initialized=False))
    got = gpu_scrape(GpuProbe(torch=lambda: cpu_torch, nvml=lambda: nvml))
    assert not any(name.startswith(CUDA_METRICS) for name in got.names())
    assert nvml.inits == 0  # NVML is not even opened for a CPU engine


def test_cuda_memory_without_nvml_has_no_utilisation_series() -> None:
    torch = SimpleNamespace(cuda=FakeCuda(initialized=True))
    got = gpu_scrape(GpuProbe(torch=lambda: torch, nvml=lambda: None))
    assert got.value("ttft_sse_cuda_memory_allocated_bytes", device="cuda:1") == 1001
    assert got.value("ttft_sse_cuda_memory_reserved_bytes", device="cuda:0") == 5000
    assert got.matching("ttft_sse_gpu_utilization_ratio") == {}


def test_gpu_utilisation_is_a_ratio_per_device_found_by_uuid() -> None:
    torch = SimpleNamespace(cuda=FakeCuda(initialized=True))
    nvml = FakeNvml()
    probe = GpuProbe(torch=lambda: torch, nvml=lambda: nvml)
    got = gpu_scrape(probe)
    gpu_scrape(probe)
    assert got.value("ttft_sse_gpu_utilization_ratio", device="cuda:0") == 0.42
    assert got.value("ttft_sse_gpu_utilization_ratio", device="cuda:1") == 0.07
    assert (nvml.inits, nvml.looked_up) == (1, ["GPU-uuid-0", "GPU-uuid-1"])  # initialised and looked up once


def test_gpu_utilisation_is_absent_when_nvml_cannot_start_and_is_not_retried() -> None:
    torch = SimpleNamespace(cuda=FakeCuda(initialized=True))
    nvml = FakeNvml(fail_init=True)
    probe = GpuProbe(torch=lambda: torch, nvml=lambda: nvml)
    for _ in range(3):
        got = gpu_scrape(probe)
        assert got.matching("ttft_sse_gpu_utilization_ratio") == {}
        assert got.value("ttft_sse_cuda_memory_allocated_bytes", device="cuda:0") == 1000
    assert nvml.inits == 1
