"""The streaming service end to end: real hypercorn, real bundled model."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from structlog.testing import capture_logs

from tests.support.servers import eventually, parse_sse, stream_events

QUESTION = "What is the capital of France?"


@pytest.fixture
def client() -> httpx.Client:
    return httpx.Client(timeout=60)


def test_readyz_reports_model_and_every_startup_stage(hf_server: str, client: httpx.Client) -> None:
    body = client.get(f"{hf_server}/readyz").json()
    assert body["status"] == "ready"
    assert (body["model"], body["device"], body["dtype"]) == ("SmolLM2-135M-Instruct", "cpu", "float32")
    assert body["weights"] == "gguf-blocks"
    startup = body["startup"]
    assert {"imports_ms", "tokenizer_ms", "model_ms", "warmup_ms", "total_ms"} <= set(startup)
    assert startup["warmup_ms"] > 0
    assert startup["total_ms"] >= sum(v for k, v in startup.items() if k != "total_ms") - 1


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": QUESTION, "max_tokens": 32},
        {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]},
        {"prompt": "Once upon a time", "raw": True, "max_tokens": 20},
    ],
)
def test_streamed_text_equals_the_batch_text_for_greedy_requests(
    hf_server: str, client: httpx.Client, body: dict[str, object]
) -> None:
    events = stream_events(client, "POST", f"{hf_server}/stream", json=body)
    complete = client.post(f"{hf_server}/complete", json=body).json()
    tokens = [e for e in events if e.event == "token"]
    done = events[-1]
    assert done.event == "done" and [e.event for e in events[:-1]] == ["token"] * len(tokens)
    assert [e.id for e in tokens] == [str(i) for i in range(len(tokens))]
    assert all(e.data["text"] for e in tokens)
    assert "".join(e.data["text"] for e in tokens) == complete["text"]
    streamed, whole = dict(done.data["usage"]), dict(complete["usage"])
    # The second request finds the first's whole blocks in the prefix cache: all of its prompt but the last block.
    assert streamed.pop("cached_tokens") <= whole.pop("cached_tokens") >= (whole["prompt_tokens"] - 1) // 4 * 4
    assert streamed == whole
    assert done.data["finish_reason"] == complete["finish_reason"]


def test_get_stream_answers_the_readme_question(hf_server: str, client: httpx.Client) -> None:
    events = stream_events(client, "GET", f"{hf_server}/stream", params={"prompt": QUESTION, "max_tokens": 32})
    assert "".join(e.data["text"] for e in events if e.event == "token") == "The capital of France is Paris."
    done = events[-1].data
    assert done["finish_reason"] == "stop"
    usage = dict(done["usage"])
    assert 0 <= usage.pop("cached_tokens") < 37  # whatever earlier tests left of its template in the prefix cache
    assert usage == {"prompt_tokens": 37, "completion_tokens": 8, "total_tokens": 45}
    timings = done["timings"]
    assert set(timings) == {"queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "total_ms"}
    assert 0 < timings["prefill_ms"] <= timings["ttft_ms"] <= timings["total_ms"]


def test_first_token_arrives_before_generation_ends(hf_server: str, client: httpx.Client) -> None:
    body = {"prompt": "List the days of the week.", "max_tokens": 40}
    events = stream_events(client, "POST", f"{hf_server}/stream", json=body)
    tokens = [e for e in events if e.event == "token"]
    assert len(tokens) > 10
    # The tokens were received in the order generated, before the done event, at many instants: the body was not
    # buffered into one write (that would give every event the same arrival instant). Not one instant each: when
    # this process is stalled, events that arrived meanwhile are read in one go.
    arrivals = [e.received for e in events]
    assert arrivals == sorted(arrivals)
    assert len({round(t, 4) for t in arrivals}) >= 5
    assert events[-1].data["timings"]["ttft_ms"] < events[-1].data["timings"]["total_ms"]


def test_disconnect_stops_generation_and_leaves_no_thread(
    hf_server: str, hf_app: Starlette, client: httpx.Client
) -> None:
    engine = hf_app.state.runtime.engine
    # Greedy, the model writes this story to the limit (400 tokens, ~10 s here), so only the disconnect can end it.
    body = {"prompt": "Write a long story about a dragon who learns to fly.", "max_tokens": 400}
    with capture_logs() as logs:
        with client.stream("POST", f"{hf_server}/stream", json=body) as response:
            events = parse_sse(response.iter_lines())
            assert next(events).event == "token"
            assert engine.active == 1
        deadline = time.monotonic() + 30
        while engine.active and time.monotonic() < deadline:
            time.sleep(0.05)
    assert engine.active == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("ttft-gen")]
    eventually(lambda: hf_app.state.runtime.gate.running == 0)  # given back as the handler unwinds, just after
    # It was cancelled, not run to the end: the thread logged how far it got, far short of max_tokens.
    cancelled = [e for e in logs if e["event"] == "generation_cancelled"]
    assert len(cancelled) == 1 and cancelled[0]["completion_tokens"] < 100
    outcome = [e for e in logs if e["event"] == "generation"]
    assert [(e["endpoint"], e["outcome"]) for e in outcome] == [("stream", "cancelled")]
