"""``/metrics`` of a real server with the real bundled model, after real requests.

The ``hf_server`` is shared by the whole session, so every assertion is on the change between two scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.support.scrape import Scrape, scrape
from tests.support.servers import eventually, parse_sse
from ttft_sse.app import create_app
from ttft_sse.engine.batched.engine import BLOCK_TOKENS, BatchedEngine
from ttft_sse.gauges import BATCH_METRICS
from ttft_sse.settings import Settings

REQUESTS = "ttft_sse_requests_total"
TTFT_COUNT = "ttft_sse_time_to_first_token_seconds_count"


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as c:
        yield c


def outcomes_moved(after: Scrape, before: Scrape) -> dict[tuple[str, str], float]:
    moved = {}
    for labels in set(after.matching(REQUESTS)) | set(before.matching(REQUESTS)):
        as_dict = dict(labels)
        if delta := after.delta(before, REQUESTS, **as_dict):
            moved[(as_dict["endpoint"], as_dict["outcome"])] = delta
    return moved


def test_tokens_counted_equal_the_usage_reported_and_ttft_is_observed_once_per_request(
    hf_server: str, client: httpx.Client
) -> None:
    before = scrape(client, hf_server)
    with client.stream("GET", f"{hf_server}/stream", params={"prompt": "Name three colours.", "max_tokens": 12}) as r:
        events = list(parse_sse(r.iter_lines()))
    answers = [
        client.post(f"{hf_server}/complete", json={"prompt": prompt, "max_tokens": 6}).json()
        for prompt in ("What is the capital of France?", "Say hello.")
    ]
    after = scrape(client, hf_server)

    done = events[-1].data
    tokens = [e for e in events if e.event == "token"]
    assert events[-1].event == "done" and len(tokens) >= 2
    assert outcomes_moved(after, before) == {("stream", "ok"): 1, ("complete", "ok"): 2}
    usages = {"stream": [done["usage"]], "complete": [a["usage"] for a in answers]}
    for endpoint, usage in usages.items():
        completion = sum(u["completion_tokens"] for u in usage)
        prompt = sum(u["prompt_tokens"] for u in usage)
        assert after.delta(before, "ttft_sse_generation_tokens_total", endpoint=endpoint) == completion
        assert after.delta(before, "ttft_sse_prompt_tokens_total", endpoint=endpoint) == prompt
        assert after.delta(before, "ttft_sse_request_generation_tokens_sum", endpoint=endpoint) == completion
        assert after.delta(before, TTFT_COUNT, endpoint=endpoint) == len(usage)
        assert after.delta(before, "ttft_sse_request_duration_seconds_count", endpoint=endpoint) == len(usage)
        assert after.delta(before, "ttft_sse_prefill_seconds_count", endpoint=endpoint) == len(usage)
        assert after.delta(before, "ttft_sse_queue_wait_seconds_count", endpoint=endpoint) == len(usage)
    capped = [done["finish_reason"]].count("length"), [a["finish_reason"] for a in answers].count("length")
    assert after.delta(before, "ttft_sse_requests_max_tokens_reached_total", endpoint="stream") == capped[0]
    assert after.delta(before, "ttft_sse_requests_max_tokens_reached_total", endpoint="complete") == capped[1]
    assert capped[1] >= 1  # greedy answers; at least one is cut at 6 tokens, so the counter is exercised
    # One gap between each pair of streamed pieces.
    assert after.delta(before, "ttft_sse_inter_token_latency_seconds_count", endpoint="stream") == len(tokens) - 1


def test_a_stream_the_client_leaves_counts_cancelled_and_frees_its_slot(
    hf_server: str, hf_app: Starlette, client: httpx.Client
) -> None:
    engine = hf_app.state.runtime.engine
    before = scrape(client, hf_server)
    params = {"prompt": "Write a long story about a dragon who learns to fly.", "max_tokens": 400}  # ends on the limit
    with client.stream("GET", f"{hf_server}/stream", params=params) as response:
        first = next(parse_sse(response.iter_lines()))
        assert first.event == "token"
    eventually(lambda: outcomes_moved(scrape(client, hf_server), before) != {}, timeout=60)
    eventually(lambda: engine.active == 0, timeout=60)  # the generation thread ended with the request
    after = scrape(client, hf_server)
    assert outcomes_moved(after, before) == {("stream", "cancelled"): 1}
    assert after.delta(before, TTFT_COUNT, endpoint="stream") == 1  # its first token did reach the client
    assert after.delta(before, "ttft_sse_generation_tokens_total", endpoint="stream") == 0  # no usage reported
    assert after.value("ttft_sse_num_requests_running") == 0


def test_invalid_requests_count_invalid(hf_server: str, client: httpx.Client) -> None:
    before = scrape(client, hf_server)
    too_many = client.post(f"{hf_server}/stream", json={"prompt": "hi", "max_tokens": 100_000})
    too_long = client.post(f"{hf_server}/complete", json={"prompt": "word " * 9000, "raw": True})
    after = scrape(client, hf_server)
    assert (too_many.status_code, too_long.status_code) == (400, 400)
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert outcomes_moved(after, before) == {("stream", "invalid"): 1, ("complete", "invalid"): 1}


def test_startup_stages_process_memory_and_idle_gauges(hf_server: str, hf_app: Starlette, client: httpx.Client) -> None:
    got = scrape(client, hf_server)
    stages = hf_app.state.runtime.lifecycle.clock.seconds()
    assert {"imports", "cache_lookup", "tokenizer", "model", "warmup"} <= set(stages)
    for stage, seconds in stages.items():
        assert got.value("ttft_sse_startup_stage_seconds", stage=stage) == seconds > 0
    assert got.value("process_resident_memory_bytes") > 100 * 2**20  # torch and a 135M-parameter model
    assert got.has("ttft_sse_num_requests_waiting")
    assert not got.has("ttft_sse_cuda_memory_reserved_bytes", device="cuda:0")  # CPU here: absent, not zero
    assert not any(dict(labels).get("endpoint") == "warmup" for labels in got.matching(REQUESTS))


def test_prefix_cache_and_kv_cache_metrics_are_the_batched_engine_s_own_counts(
    hf_server: str, hf_app: Starlette, client: httpx.Client
) -> None:
    engine = hf_app.state.runtime.engine
    assert isinstance(engine, BatchedEngine)  # the default engine
    # The server is shared: let whatever an earlier test left running (a resumable stream, say) end first.
    eventually(lambda: engine.active == 0, timeout=60)
    body = {"prompt": "Which ocean is the largest? Answer in one word.", "max_tokens": 4, "temperature": 0}
    first = client.post(f"{hf_server}/complete", json=body).json()
    between = engine.stats()
    second = client.post(f"{hf_server}/complete", json=body).json()
    # The loop's thread frees a finished request's blocks, perhaps after its answer went out: wait for that (a
    # condition, not a time); after it nothing moves until the next request.
    eventually(lambda: engine.stats().kv_tokens_in_use == 0, timeout=60)
    got = scrape(client, hf_server)
    stats = engine.stats()

    assert second["text"] == first["text"]
    assert set(BATCH_METRICS) <= got.names()
    # The exported series are the engine's own counts (the warm-up included).
    assert got.value("ttft_sse_prefix_cache_queries_tokens_total") == stats.prompt_tokens
    assert got.value("ttft_sse_prefix_cache_hits_tokens_total") == stats.prefix_hit_tokens > 0
    assert got.value("ttft_sse_batch_steps_total") == stats.steps > 0
    # The block kernel's helper threads (one on two cores or more, as here and in CI): their chunks as counted.
    assert (stats.kernel is not None) == (engine.info.kernel_helpers > 0)
    if stats.kernel is not None:
        assert stats.kernel.calls > 0 and stats.kernel.helpers == engine.info.kernel_helpers
        assert got.matching("ttft_sse_kernel_chunks_total") == {
            frozenset({("by", "caller")}): stats.kernel.by_caller - stats.kernel.taken_back,
            frozenset({("by", "helpers")}): stats.kernel.by_helpers,
            frozenset({("by", "taken_back")}): stats.kernel.taken_back,
        }
    # The second prompt was scheduled in full and served from the first one's blocks: every whole block short of
    # its last token.
    n = second["usage"]["prompt_tokens"]
    reused = (n - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert stats.prompt_tokens - between.prompt_tokens == n
    assert stats.prefix_hit_tokens - between.prefix_hit_tokens == reused > 0
    assert stats.steps - between.steps == second["usage"]["completion_tokens"]  # one token a step, alone
    # Idle: nothing in use, the prompts' blocks kept for reuse.
    capacity = hf_app.state.runtime.settings.kv_cache_tokens
    assert got.value("ttft_sse_kv_cache_capacity_tokens") == stats.kv_tokens_capacity == capacity
    assert got.has("ttft_sse_kv_cache_usage_ratio") and got.value("ttft_sse_kv_cache_usage_ratio") == 0
    assert got.has("ttft_sse_kv_cache_tokens", state="in_use")
    assert got.value("ttft_sse_kv_cache_tokens", state="in_use") == stats.kv_tokens_in_use == 0
    assert got.value("ttft_sse_kv_cache_tokens", state="cached") == stats.kv_tokens_cached >= reused


def test_model_and_tokenizer_stay_the_same_objects_across_requests(
    hf_server: str, hf_app: Starlette, client: httpx.Client
) -> None:
    engine = hf_app.state.runtime.engine
    loaded = (engine.model, engine.tokenizer)
    for _ in range(2):
        assert client.post(f"{hf_server}/complete", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert engine.model is loaded[0] and engine.tokenizer is loaded[1]


def test_tokenizer_and_model_are_loaded_once_per_process(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    """Counted at ``from_pretrained`` (and, for the model, ``from_config``: a GGUF's model is built empty, then read
    from the file): start-up loads each once; warm-up and requests load nothing more."""
    import transformers

    calls: dict[str, int] = {"tokenizer": 0, "model": 0}

    def counting(kind: str, original: Any) -> Any:
        def load(*args: Any, **kwargs: Any) -> Any:
            calls[kind] += 1
            return original(*args, **kwargs)

        return load

    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        counting("tokenizer", transformers.AutoTokenizer.from_pretrained),
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        counting("model", transformers.AutoModelForCausalLM.from_pretrained),
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_config",
        counting("model", transformers.AutoModelForCausalLM.from_config),
    )
    with TestClient(create_app(settings)) as c:
        eventually(lambda: c.get("/readyz").status_code == 200, timeout=120)
        for prompt in ("One", "Two", "Three"):
            assert c.post("/stream", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
            assert c.post("/complete", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
    assert calls == {"tokenizer": 1, "model": 1}
