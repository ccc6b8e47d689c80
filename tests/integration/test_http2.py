"""HTTP/2: hypercorn speaks it (h2c with prior knowledge on a plain socket, h2 over TLS), and HTTP/2 forbids
connection-specific headers such as ``Connection: keep-alive`` (RFC 9113 §8.2.2), which sse-starlette sets."""

from __future__ import annotations

import httpx

from tests.support.servers import parse_sse, running
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings


def test_a_stream_over_http2_has_no_connection_header_and_completes() -> None:
    app = create_app(Settings(warmup=False, log_format="console"), FakeEngine())
    with running(app) as base:
        # http1=False: HTTP/2 with prior knowledge on the plain socket. The client's h2 stack rejects a response
        # that carries a connection-specific header, so a completed stream is itself the proof.
        with httpx.Client(http1=False, http2=True, timeout=30) as h2, h2.stream("GET", f"{base}/stream?prompt=hi") as r:
            assert r.http_version == "HTTP/2"
            assert "connection" not in r.headers
            assert r.headers["x-accel-buffering"] == "no"
            events = list(parse_sse(r.iter_lines()))
        # Over HTTP/1.1 hypercorn adds no Connection header of its own, so this shows what the app itself sends:
        # none (TokenStream drops sse-starlette's). Hypercorn's h2 layer would also strip one; a server or proxy
        # that does not would otherwise forward it.
        with httpx.Client(timeout=30) as h1, h1.stream("GET", f"{base}/stream?prompt=hi") as r1:
            assert r1.http_version == "HTTP/1.1"
            assert "connection" not in r1.headers
            assert [e.event for e in parse_sse(r1.iter_lines())] == [e.event for e in events]
    assert [e.event for e in events] == ["token"] * 4 + ["done"]
    assert "".join(e.data["text"] for e in events[:-1]) == "Hello, world!"
