"""The transport's limits over raw sockets, against a real server run as ``ttft-sse serve`` runs it (its hypercorn
config and ``ttft_sse.http.transport``'s reader), with the scripted engine and short timeouts.

Regressions pinned here: a connection the client closed sat in CLOSE-WAIT until the 75 s keep-alive timer ended; a
body that stalled half-way was held for ever, and so was half a request head.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import Served, eventually, fake_app, serving
from ttft_sse.__main__ import hypercorn_config
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings

HEAD_S, BODY_S, KEEP_ALIVE_S = 1.0, 1.5, 5.0
SLACK = 2.5  # how much later than its deadline a closing may come on a busy machine; a held one never comes


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, FakeEngine]]:
    engine = FakeEngine(["a", "b", "c"], hold_after=1)
    app = fake_app(
        engine,
        header_timeout_seconds=HEAD_S,
        body_timeout_seconds=BODY_S,
        keep_alive_seconds=KEEP_ALIVE_S,
        max_header_bytes=4096,
    )
    with serving(app) as served:
        yield served, engine


def connect(served: tuple[Served, FakeEngine]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served[0].port))
    sock.settimeout(30)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (``perf_counter``)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received, time.perf_counter()


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (head and body), leaving the connection open."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, received
        body += chunk
    return head + b"\r\n\r\n" + body


def server_side_states(port: int) -> list[str]:
    """TCP states of the server's sockets on ``port`` (not the listener), from /proc/net/tcp{,6}."""
    states = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state != "0A":  # 0A: LISTEN
                states.append({"01": "ESTABLISHED", "08": "CLOSE_WAIT", "06": "TIME_WAIT"}.get(state, state))
    return states


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_a_connection_the_client_closed_is_released_at_once_not_after_the_keep_alive_timer(
    served: tuple[Served, FakeEngine],
) -> None:
    port = served[0].port
    with connect(served) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert "ESTABLISHED" in server_side_states(port)
    # The server side must close too (no CLOSE_WAIT left), well before the keep-alive timer could have.
    started = time.perf_counter()
    eventually(lambda: "CLOSE_WAIT" not in server_side_states(port) and "ESTABLISHED" not in server_side_states(port))
    assert time.perf_counter() - started < KEEP_ALIVE_S


def test_half_a_request_head_is_closed_at_the_head_deadline(served: tuple[Served, FakeEngine]) -> None:
    with connect(served) as sock:
        sock.sendall(b"POST /complete HTTP/1.1\r\nHost: t\r\nContent-Ty")
        started = time.perf_counter()
        received, closed = read_until_closed(sock)
    assert received == b""  # nothing to answer: there is no request yet
    assert HEAD_S * 0.9 <= closed - started < HEAD_S + SLACK


def test_a_body_that_stalls_half_way_is_a_408_and_a_closed_connection(served: tuple[Served, FakeEngine]) -> None:
    with connect(served) as sock:
        sock.sendall(
            b"POST /complete HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        started = time.perf_counter()
        sock.sendall(b'{"prompt": "half')
        received, closed = read_until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert BODY_S * 0.9 <= closed - started < BODY_S + SLACK


def test_a_body_that_trickles_is_cut_at_the_same_deadline(served: tuple[Served, FakeEngine]) -> None:
    """The deadline counts from the request's arrival, not from the last byte: a byte now and then does not hold."""
    with connect(served) as sock:
        sock.sendall(
            b"POST /complete HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        started = time.perf_counter()
        sock.settimeout(0.2)
        received = b""
        while not received and time.perf_counter() - started < BODY_S + SLACK:
            try:
                sock.sendall(b" ")
                received = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
    assert received.startswith(b"HTTP/1.1 408"), received
    assert time.perf_counter() - started < BODY_S + SLACK


def test_idle_time_between_requests_is_the_keep_alive_not_the_head_deadline(served: tuple[Served, FakeEngine]) -> None:
    with connect(served) as sock:
        for _ in range(2):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            time.sleep(HEAD_S * 1.3)  # idle past the head deadline: still open
        started = time.perf_counter()
        received, closed = read_until_closed(sock)  # now idle until the keep-alive timer closes it
    assert received == b""
    assert closed - started < KEEP_ALIVE_S + SLACK


def test_a_stream_outlives_every_read_deadline(served: tuple[Served, FakeEngine]) -> None:
    """An SSE client sends nothing while it listens: no read deadline may apply while a response streams."""
    _, engine = served
    body = b'{"prompt": "hi"}'
    with connect(served) as sock:
        sock.sendall(
            b"POST /stream HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b'"a"' not in received:
            received += sock.recv(4096)
        time.sleep(max(HEAD_S, BODY_S) + 1)  # the engine holds; the client is silent
        engine.release.set()
        try:
            while b"event: done" not in received:
                chunk = sock.recv(4096)
                assert chunk, received
                received += chunk
        finally:
            engine.release.clear()
    assert received.count(b"event: token") == 3


@pytest.mark.parametrize("size", [8192, 200_000])
def test_a_request_head_over_the_size_limit_is_refused(served: tuple[Served, FakeEngine], size: int) -> None:
    """h11's limit is on the part of a head still incomplete: a head that arrives whole in one read (up to 64 KiB)
    is parsed whatever its size; one that has not ended by the limit is refused."""
    with connect(served) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"x" * size)
        received, _ = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 431")


def test_the_server_still_serves_after_all_of_that(served: tuple[Served, FakeEngine]) -> None:
    with connect(served) as sock:
        sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        received, _ = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 200")


def test_the_transport_settings_reach_hypercorn() -> None:
    env = {
        "TTFT_HEADER_TIMEOUT_SECONDS": "4",
        "TTFT_BODY_TIMEOUT_SECONDS": "6",
        "TTFT_KEEP_ALIVE_SECONDS": "50",
        "TTFT_MAX_HEADER_BYTES": "8192",
    }
    settings = Settings.from_env(env)
    config = hypercorn_config(settings)
    assert (config.header_timeout, config.keep_alive_timeout, config.h11_max_incomplete_size) == (4, 50, 8192)
    assert settings.body_timeout_seconds == 6
    assert config.read_timeout is None  # see ttft_sse/http/transport.py: it would cut SSE streams
    defaults = hypercorn_config(Settings())
    assert (defaults.header_timeout, defaults.keep_alive_timeout, defaults.h11_max_incomplete_size) == (10, 75, 16384)


@pytest.mark.parametrize(
    ("data", "closes"),
    [
        (b"Content-Type: text/plain\r\nContent-Length: 16\r\n\r\n" + b'{"prompt": "hi"}', True),  # 415, body unread
        (b"Content-Type: application/json\r\nContent-Length: 99999999\r\n\r\n", True),  # 413 from the declared length
        (b"Content-Type: application/json\r\nContent-Length: 13\r\n\r\n" + b'{"prompt": 5}', False),  # read: reusable
        (b"Content-Type: application/json\r\nContent-Length: 7\r\n\r\n" + b'{"x": 1', False),  # a 400 after reading it
    ],
)
def test_a_response_given_before_the_body_was_read_says_connection_close(
    served: tuple[Served, FakeEngine], data: bytes, closes: bool
) -> None:
    """Without it, a client sends its next request down a connection the server is closing (the fuzz suite met
    "server disconnected without sending a response" so)."""
    with connect(served) as sock:
        sock.sendall(b"POST /complete HTTP/1.1\r\nHost: t\r\n" + data)
        head = read_response(sock).partition(b"\r\n\r\n")[0].lower()
        assert (b"\r\nconnection: close" in head) is closes, head
        if closes:
            assert read_until_closed(sock)[0] == b""
        else:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # the same connection serves the next one
            assert read_response(sock).startswith(b"HTTP/1.1 200")
