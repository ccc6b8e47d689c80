"""Graceful drain, driven the way SIGTERM drives it (the CLI's shutdown trigger), over real sockets.

The scripted engine makes every ordering exact: ``hold_after=1`` keeps a generation running after its first
token until the test releases it, so "still running when the drain began" and "outlived the grace" are facts
the test sets up, not timings it hopes for. ``test_drain_process.py`` does the same with the real model and a
real SIGTERM.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.servers import StreamReader, eventually, serving
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.runtime import shutdown_budget
from ttft_sse.settings import Settings

PIECES = ("Hello", ",", " world", "!")


def settings(**changes: object) -> Settings:
    return Settings(warmup=False, log_format="console", **changes)  # type: ignore[arg-type]


def test_running_streams_finish_queued_and_new_requests_are_refused() -> None:
    engine = FakeEngine(PIECES, hold_after=1)
    app = create_app(settings(max_concurrency=1, max_queue=4, drain_seconds=120), engine)
    with serving(app) as served:
        running = StreamReader(f"{served.base}/stream?prompt=hi")
        first = running.next()
        assert first is not None and (first.event, first.data) == ("token", {"text": "Hello"})
        queued = StreamReader(f"{served.base}/stream?prompt=hi")
        waiting = queued.next()
        assert waiting is not None and (waiting.event, waiting.data) == ("queued", {"position": 1})

        served.stop()  # SIGTERM

        # The queued request is refused at once, with a reason, and nothing was generated for it.
        refused = queued.rest()
        assert [e.event for e in refused] == ["error"]
        assert refused[0].data["error"]["type"] == "shutdown_error"
        assert refused[0].data["error"]["code"] == "draining"
        # Readiness is 503 while the running stream is still going; new generations get 503 + Retry-After.
        eventually(lambda: httpx.get(f"{served.base}/readyz").status_code == 503)
        ready = httpx.get(f"{served.base}/readyz").json()
        assert (ready["status"], ready["running"], ready["waiting"]) == ("stopping", 1, 0)
        assert httpx.get(f"{served.base}/healthz").status_code == 200  # alive: no restart while draining
        for method, path in (("POST", "/stream"), ("POST", "/complete")):
            new = httpx.request(method, f"{served.base}{path}", json={"prompt": "hi"})
            assert new.status_code == 503, new.text
            assert new.headers["retry-after"] == "1"
            assert (new.json()["error"]["type"], new.json()["error"]["code"]) == ("shutdown_error", "draining")
        assert engine.generated == [] and engine.active == 1  # the running generation is still held

        engine.release.set()  # it may finish: the grace (120 s) is far from over
        rest = running.rest()
        assert [e.event for e in rest] == ["token", "token", "token", "done"]
        assert "".join(e.data["text"] for e in [first, *rest[:-1]]) == "Hello, world!"
        assert rest[-1].data["finish_reason"] == "stop"
        # The drain ended when the last generation did, not when the grace ran out.
        assert served.wait_stopped(shutdown_budget(5)), "the server did not stop after its streams finished"
    assert served.failure == []
    assert engine.generated == [4] and engine.active == 0


@pytest.mark.parametrize("path", ["/stream", "/complete"])
def test_a_generation_that_outlives_the_grace_ends_with_a_shutdown_error(path: str) -> None:
    engine = FakeEngine(PIECES, hold_after=1)  # never released: it would run forever
    app = create_app(settings(drain_seconds=0.5), engine)
    with serving(app) as served:
        reader = StreamReader(f"{served.base}{path}", method="POST", json={"prompt": "hi"})
        if path == "/stream":
            first = reader.next()
            assert first is not None and first.event == "token"
        else:
            eventually(lambda: engine.active == 1)
        served.stop()
        assert served.wait_stopped(shutdown_budget(0.5) + 30)
    reader.join(30)
    if path == "/stream":
        events = reader.rest()
        assert [e.event for e in events] == ["error"]
        error = events[0].data["error"]
    else:
        assert reader.status == 503, reader.body
        error = httpx.Response(503, content=reader.body).json()["error"]
    assert (error["type"], error["code"]) == ("shutdown_error", "drain_timeout")
    assert "0.5 s drain grace" in error["message"]
    assert engine.generated == [1] and engine.active == 0  # cut after one piece, and its thread is gone


def test_a_second_signal_cuts_the_grace_short() -> None:
    engine = FakeEngine(PIECES, hold_after=1)
    app = create_app(settings(drain_seconds=3600), engine)
    with serving(app) as served:
        reader = StreamReader(f"{served.base}/stream?prompt=hi")
        assert reader.next() is not None
        served.stop()
        eventually(lambda: httpx.get(f"{served.base}/readyz").status_code == 503)
        served.stop()  # Ctrl-C twice: do not wait out the hour
        events = reader.rest()
        assert [e.event for e in events] == ["error"]
        assert events[0].data["error"]["code"] == "drain_timeout"
        assert served.wait_stopped(60)
    assert engine.active == 0
