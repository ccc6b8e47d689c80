"""A client that leaves, mid-upload or mid-stream, is an outcome of its own: one info line, no traceback, never a server
error. A real hypercorn server (as ``ttft-sse serve`` configures it) over raw sockets, with the scripted engine.

Mid-upload was a 500 once: Starlette's ``ClientDisconnect`` from the body read went to the catch-all handler, which
logged a traceback (and hypercorn a second one) and counted the request under ``error``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.servers import Served, eventually, fake_app, serving
from ttft_sse.engine.fake import FakeEngine

REQUESTS = "ttft_sse_requests_total"
CHAT_BODY = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, FakeEngine]]:
    engine = FakeEngine(["a", "b", "c"], hold_after=1)  # one piece, then it holds until the client leaves
    with serving(fake_app(engine, max_concurrency=1, max_queue=4)) as served:
        yield served, engine


def counted(served: Served, endpoint: str, outcome: str) -> float:
    value = served.runtime.metrics.registry.get_sample_value(REQUESTS, {"endpoint": endpoint, "outcome": outcome})
    return value or 0.0


def request_head(method: str, path: str, *, length: int | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def statuses(logs: list[dict[str, Any]], path: str) -> list[int]:
    """The access lines' statuses for ``path``: the fixture's last ``/readyz`` probe may log its line (after its
    response) inside a test's capture, so the lines are told apart by path."""
    return [e["status"] for e in logs if e["event"] == "request" and e["path"] == path]


def no_faults(logs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    faults = [e for e in logs if e["log_level"] in ("error", "critical", "exception") or "exc_info" in e]
    assert not faults, faults
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.records


@pytest.mark.parametrize(
    ("path", "endpoint"),
    [
        ("/complete", "complete"),
        ("/stream", "stream"),
        ("/streams", "create_stream"),
        ("/jobs", "submit_job"),
        ("/v1/chat/completions", "chat_completions"),
    ],
)
def test_a_client_that_leaves_mid_upload_is_client_gone_with_one_info_line(
    served: tuple[Served, FakeEngine], caplog: pytest.LogCaptureFixture, path: str, endpoint: str
) -> None:
    server, _ = served
    before = {outcome: counted(server, endpoint, outcome) for outcome in ("client_gone", "error")}
    with capture_logs() as logs, caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request_head("POST", path, length=100) + b'{"prompt": "half a bo')
        eventually(lambda: counted(server, endpoint, "client_gone") == before["client_gone"] + 1)
        eventually(lambda: bool(statuses(logs, path)))  # the access line ends the request
    gone = [e for e in logs if e["event"] == "client_gone"]
    assert len(gone) == 1 and gone[0]["log_level"] == "info"
    assert gone[0]["path"] == path
    assert statuses(logs, path) == [499]
    assert counted(server, endpoint, "error") == before["error"]
    no_faults(logs, caplog)


@pytest.mark.parametrize(
    ("head", "path", "endpoint"),
    [
        (request_head("GET", "/stream?prompt=hi"), "/stream", "stream"),
        (
            request_head("POST", "/v1/chat/completions", length=len(CHAT_BODY)) + CHAT_BODY,
            "/v1/chat/completions",
            "chat_completions",
        ),
    ],
)
def test_a_client_that_leaves_mid_stream_is_cancelled_with_one_info_line(
    served: tuple[Served, FakeEngine], caplog: pytest.LogCaptureFixture, head: bytes, path: str, endpoint: str
) -> None:
    server, engine = served
    before = counted(server, endpoint, "cancelled")
    with capture_logs() as logs, caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head)
            received = b""
            while b'"a"' not in received:  # the first piece is on the wire; the engine now holds
                chunk = sock.recv(4096)
                assert chunk, received
                received += chunk
        eventually(lambda: counted(server, endpoint, "cancelled") == before + 1)
        eventually(lambda: engine.active == 0)  # the generation's thread ended with the request
        eventually(lambda: bool(statuses(logs, path)))
    lines = [e for e in logs if e["event"] == "generation"]
    assert len(lines) == 1 and (lines[0]["outcome"], lines[0]["log_level"]) == ("cancelled", "info")
    assert statuses(logs, path) == [200]  # the stream's head was sent before the client left
    no_faults(logs, caplog)


def test_a_client_that_leaves_a_complete_while_queued_or_generating_is_cancelled(
    served: tuple[Served, FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    server, engine = served
    before = counted(server, "complete", "cancelled")
    body = b'{"prompt": "hi"}'
    with capture_logs() as logs, caplog.at_level(logging.INFO):
        generating = socket.create_connection(("127.0.0.1", server.port))
        generating.sendall(request_head("POST", "/complete", length=len(body)) + body)
        eventually(lambda: engine.active == 1)
        queued = socket.create_connection(("127.0.0.1", server.port))  # the one slot is taken: this one waits
        queued.sendall(request_head("POST", "/complete", length=len(body)) + body)
        eventually(lambda: server.runtime.gate.waiting == 1)
        queued.close()
        generating.close()
        eventually(lambda: counted(server, "complete", "cancelled") == before + 2)
        eventually(lambda: engine.active == 0 and server.runtime.gate.running == 0)
    no_faults(logs, caplog)
