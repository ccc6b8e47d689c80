"""SSE framing and transport over a real hypercorn server, with the scripted engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.servers import parse_sse, running, stream_events
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings


@pytest.fixture
def held() -> Iterator[tuple[str, FakeEngine]]:
    """A server whose engine emits one piece, then holds until the test releases it."""
    engine = FakeEngine(["first", " second", " third"], hold_after=1)
    with running(create_app(Settings(warmup=False), engine)) as base:
        yield base, engine


def test_first_token_is_flushed_while_the_engine_is_still_generating(held: tuple[str, FakeEngine]) -> None:
    base, engine = held
    with httpx.Client(timeout=10) as client, client.stream("GET", f"{base}/stream?prompt=hi") as response:
        assert response.status_code == 200
        events = parse_sse(response.iter_lines())
        first = next(events)
        # The engine has not produced anything past the first piece: it is blocked until we release it.
        assert (first.event, first.id, first.data) == ("token", "0", {"text": "first"})
        assert engine.active == 1 and not engine.release.is_set()
        engine.release.set()
        rest = list(events)
    assert [(e.event, e.id) for e in rest] == [("token", "1"), ("token", "2"), ("done", None)]
    assert rest[-1].data["finish_reason"] == "stop"
    assert rest[-1].data["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4, "cached_tokens": 0}


def test_the_event_loop_keeps_answering_while_a_generation_runs(held: tuple[str, FakeEngine]) -> None:
    base, engine = held
    with httpx.Client(timeout=10) as client, client.stream("GET", f"{base}/stream?prompt=hi") as response:
        events = parse_sse(response.iter_lines())
        next(events)
        assert engine.active == 1
        assert client.get(f"{base}/healthz").json() == {"status": "ok", "state": "ready"}
        assert client.get(f"{base}/readyz").json()["running"] == 1
        engine.release.set()
        assert [e.event for e in events][-1] == "done"


def test_client_disconnect_cancels_the_generation_and_its_thread(held: tuple[str, FakeEngine]) -> None:
    base, engine = held
    with httpx.Client(timeout=10) as client, client.stream("GET", f"{base}/stream?prompt=hi") as response:
        next(parse_sse(response.iter_lines()))
        assert engine.active == 1
    # The connection is closed; the server notices, cancels, and the worker thread ends.
    deadline = time.monotonic() + 10
    while (engine.active or engine.generated == []) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.active == 0
    assert engine.generated == [1]  # it never went past the piece it held on
    assert not [t for t in threading.enumerate() if t.name.startswith("ttft-fake")]


def test_engine_failure_mid_stream_becomes_an_error_event() -> None:
    engine = FakeEngine(["a", "b", "c"], fail_after=2)
    with running(create_app(Settings(warmup=False), engine)) as base, httpx.Client(timeout=10) as client:
        events = stream_events(client, "POST", f"{base}/stream", json={"prompt": "hi"})
        complete = client.post(f"{base}/complete", json={"prompt": "hi"})
    assert [(e.event, e.data) for e in events[:2]] == [("token", {"text": "a"}), ("token", {"text": "b"})]
    assert events[2].event == "error"
    assert events[2].data == {
        "error": {
            "message": "generation failed: scripted engine failure",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert len(events) == 3
    assert complete.status_code == 500
    assert complete.json()["error"]["message"] == "generation failed: scripted engine failure"


def test_sse_headers_tell_proxies_not_to_buffer_and_head_starts_nothing() -> None:
    engine = FakeEngine()
    with running(create_app(Settings(warmup=False), engine)) as base, httpx.Client(timeout=10) as client:
        with client.stream("GET", f"{base}/stream?prompt=hi") as response:
            headers = response.headers
            response.read()
        head = client.head(f"{base}/stream?prompt=hi")
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-accel-buffering"] == "no"
    assert headers["cache-control"] == "no-store, no-transform"
    assert "connection" not in {k.lower() for k in headers if headers[k].lower() == "keep-alive"}
    assert head.status_code == 200 and head.content == b""
    assert engine.generated == [4]  # the GET ran once; the HEAD generated nothing
