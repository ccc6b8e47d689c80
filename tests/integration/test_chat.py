"""``/chat``, the seed design's WebSocket protocol, over real sockets: hypercorn, and the ``websockets`` client.

With the real model: a greedy answer's frames are exactly ``/stream``'s pieces, then ``[DONE]``, and their text is
``/complete``'s. With the scripted engine, where orderings must be exact: ``[ERROR]`` frames and close codes for
every refusal (bad JSON, bad fields, a binary frame, no room, keys, origins), a client that leaves mid-answer
stops its generation, several prompts on one connection, and the drain on SIGTERM.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from structlog.testing import capture_logs
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.support.nginx import nginx
from tests.support.scrape import parse
from tests.support.servers import eventually, fake_app, parse_sse, running, serving
from ttft_sse.admission.auth import key_id
from ttft_sse.engine.fake import FakeEngine

PIECES = ("Hello", ",", " world", "!")
KEY, VIP_KEY = "normal-key-123", "vip-key-4567"


def ws_url(base: str, query: str = "") -> str:
    return base.replace("http://", "ws://", 1) + "/chat" + query


@contextmanager
def fake_server(engine: FakeEngine, **settings: Any) -> Iterator[tuple[str, Starlette]]:
    app = fake_app(engine, **settings)
    with running(app) as base:
        yield base, app


def answer(ws: ClientConnection, body: dict[str, Any]) -> list[str]:
    """Send one prompt; every frame up to and including ``[DONE]``."""
    ws.send(json.dumps(body))
    frames = []
    while not frames or frames[-1] != "[DONE]":
        frame = ws.recv(timeout=120)
        assert isinstance(frame, str)
        frames.append(frame)
    return frames


def until_closed(ws: ClientConnection) -> tuple[list[str | bytes], int | None, str]:
    """Every frame until the server closes; then its close code and reason."""
    frames: list[str | bytes] = []
    try:
        while True:
            frames.append(ws.recv(timeout=60))
    except ConnectionClosed as closed:
        assert closed.rcvd is not None, "the connection ended without a close frame from the server"
        return frames, closed.rcvd.code, closed.rcvd.reason


def refused(url: str, *messages: str | bytes, **options: Any) -> tuple[list[str | bytes], int | None, str]:
    with connect(url, open_timeout=30, **options) as ws:
        for message in messages:
            try:
                ws.send(message)
            except ConnectionClosed:
                break  # refused before the prompt was read (a key, an origin, the drain): the frames are kept
        return until_closed(ws)


def chat_requests(base: str) -> dict[str, float]:
    """``ttft_sse_requests_total{endpoint="chat"}`` by outcome."""
    samples = parse(httpx.get(f"{base}/metrics").text).matching("ttft_sse_requests_total")
    return {dict(labels)["outcome"]: value for labels, value in samples.items() if ("endpoint", "chat") in labels}


# -- the real model ------------------------------------------------------------------------------------------------


def test_a_greedy_answer_is_the_pieces_of_stream_then_done_and_its_text_is_completes(hf_server: str) -> None:
    body = {"prompt": "What is the capital of France? Answer in one sentence.", "max_tokens": 24}
    with connect(ws_url(hf_server), open_timeout=30) as ws:
        frames = answer(ws, body)
    with httpx.Client(timeout=120) as client:
        complete = client.post(f"{hf_server}/complete", json=body)
        assert complete.status_code == 200, complete.text
        with client.stream("POST", f"{hf_server}/stream", json=body) as response:
            pieces = [e.data["text"] for e in parse_sse(response.iter_lines()) if e.event == "token"]
    assert frames[-1] == "[DONE]" and "[DONE]" not in frames[:-1]
    assert frames[:-1] == pieces  # one frame a piece, as /stream's token events
    assert "".join(frames[:-1]) == complete.json()["text"] != ""


# -- the protocol's refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "frame", "code"),
    [
        ("{not json", "[ERROR] the request body is not valid JSON: Expecting property name enclosed in double quotes: "
         "line 1 column 2 (char 1)", 1008),
        ('{"prompt": "hi", "max_tokens": 0}', "[ERROR] max_tokens must be between 1 and 2048, got 0", 1008),
        ('{"prompt": "hi", "maxtokens": 3}', "[ERROR] unknown field(s): maxtokens; accepted: prompt, messages, raw, "
         "parse_special, max_tokens, temperature, top_p, stop, seed, cache_salt", 1008),
        ('{"max_tokens": 3}', "[ERROR] prompt or messages is required", 1008),
        ("[1, 2]", "[ERROR] the request body must be a JSON object, not an array", 1008),
        (b'{"prompt": "hi"}', '[ERROR] frames must be text: send the prompt as one JSON text frame such as '
         '{"prompt": "Hello", "max_tokens": 32}', 1003),
    ],
)  # fmt: skip
def test_a_bad_message_gets_an_error_frame_and_a_close_and_generates_nothing(
    message: str | bytes, frame: str, code: int
) -> None:
    engine = FakeEngine(PIECES)
    with fake_server(engine) as (base, _):
        assert refused(ws_url(base), message)[:2] == ([frame], code)
        assert chat_requests(base) == {"invalid": 1}
    assert engine.generated == []


def test_with_no_room_the_error_frame_says_when_to_retry() -> None:
    engine = FakeEngine(PIECES, hold_after=1)
    with fake_server(engine, max_concurrency=1, max_queue=0) as (base, _), connect(ws_url(base)) as holder:
        holder.send(json.dumps({"prompt": "hi"}))
        assert holder.recv(timeout=60) == "Hello"  # the one slot is taken, and held
        frames, code, reason = refused(ws_url(base), json.dumps({"prompt": "hi"}))
        assert frames == [
            "[ERROR] server is at capacity: 1 generations running and 0 waiting; retry after 1 s, or POST the same "
            "body to /jobs to run it later (Retry-After: 1)"
        ]
        assert (code, reason) == (1013, "overloaded_error")  # Try Again Later; the reason: the error type
        engine.release.set()
        assert [holder.recv(timeout=60) for _ in range(4)] == [",", " world", "!", "[DONE]"]
        assert chat_requests(base) == {"ok": 1, "overloaded": 1}


def test_a_prompt_that_never_comes_ends_the_connection_with_a_timeout() -> None:
    with fake_server(FakeEngine(PIECES), body_timeout_seconds=0.2) as (base, _):
        frames, code, _ = refused(ws_url(base))
        assert frames == [
            '[ERROR] no prompt arrived within 0.2 s of the connection; send one JSON object such as {"prompt": '
            '"Hello", "max_tokens": 32}'
        ]
        assert code == 3008


def test_a_plain_get_is_told_to_open_a_websocket() -> None:
    with fake_server(FakeEngine(PIECES)) as (base, _):
        response = httpx.get(f"{base}/chat")
    assert response.status_code == 426 and response.headers["upgrade"] == "websocket"
    assert response.json()["error"]["code"] == "websocket_required"


# -- one connection, the generation path ---------------------------------------------------------------------------


def test_one_connection_takes_prompts_one_after_another_through_the_generation_path() -> None:
    engine = FakeEngine(PIECES)
    with capture_logs() as logs, fake_server(engine) as (base, _), connect(ws_url(base)) as ws:
        assert ws.response is not None
        request_id = ws.response.headers["x-request-id"]
        assert answer(ws, {"prompt": "hi"}) == ["Hello", ",", " world", "!", "[DONE]"]
        assert answer(ws, {"prompt": "again", "max_tokens": 2}) == ["Hello", ",", "[DONE]"]
        assert answer(ws, {"prompt": "stop", "stop": [" world"]}) == ["Hello", ",", "[DONE]"]
        assert chat_requests(base) == {"ok": 3}
    generations = [e for e in logs if e["event"] == "generation"]
    assert [(e["endpoint"], e["outcome"], e["finish_reason"]) for e in generations] == [
        ("chat", "ok", "stop"),
        ("chat", "ok", "length"),
        ("chat", "ok", "stop"),
    ]
    [access] = [e for e in logs if e["event"] == "request" and e["path"] == "/chat"]
    assert (access["method"], access["status"]) == ("GET", 101)
    assert len(request_id) == 32  # the handshake's response carries the connection's request id, as HTTP ones do


def test_a_client_that_leaves_mid_answer_stops_its_generation() -> None:
    engine = FakeEngine([f" w{i}" for i in range(20)], hold_after=3)
    with capture_logs() as logs, fake_server(engine) as (base, app):
        with connect(ws_url(base)) as ws:
            ws.send(json.dumps({"prompt": "hi"}))
            assert [ws.recv(timeout=60) for _ in range(3)] == [" w0", " w1", " w2"]
            assert engine.active == 1
        # The socket is closed; the engine is never released: only the cancel can end the generation.
        eventually(lambda: engine.active == 0)
        eventually(lambda: app.state.runtime.gate.running == 0)
        assert engine.generated == [3]
        assert chat_requests(base) == {"cancelled": 1}
    assert [(e["endpoint"], e["outcome"]) for e in logs if e["event"] == "generation"] == [("chat", "cancelled")]


def test_a_frame_sent_while_an_answer_streams_is_refused_and_the_answer_stops() -> None:
    engine = FakeEngine(PIECES, hold_after=1)
    with fake_server(engine) as (base, _), connect(ws_url(base)) as ws:
        ws.send(json.dumps({"prompt": "hi"}))
        assert ws.recv(timeout=60) == "Hello"
        ws.send(json.dumps({"prompt": "too soon"}))
        frames, code, _ = until_closed(ws)
        assert frames == ["[ERROR] a frame arrived while an answer was streaming; send the next prompt after [DONE]"]
        assert code == 1008
        eventually(lambda: engine.active == 0)
        assert engine.generated == [1]


def test_through_the_shipped_nginx_config_the_upgrade_reaches_the_server() -> None:
    with (
        fake_server(FakeEngine(PIECES)) as (base, _),
        nginx(int(base.rsplit(":", 1)[1])) as proxy,
        connect(ws_url(proxy), origin=proxy) as ws,  # type: ignore[arg-type]  # a page the proxy serves
    ):
        assert answer(ws, {"prompt": "hi"}) == ["Hello", ",", " world", "!", "[DONE]"]


# -- keys and origins ----------------------------------------------------------------------------------------------


def test_keys_come_from_the_query_the_protocol_or_the_headers_and_set_the_lane() -> None:
    engine = FakeEngine(PIECES)
    keys = f"{KEY}:normal,{VIP_KEY}:high"
    with capture_logs() as logs, fake_server(engine, api_keys=keys) as (base, _):
        frames, code, _ = refused(ws_url(base), json.dumps({"prompt": "hi"}))
        assert frames == [
            "[ERROR] an API key is required: a browser passes it as /chat?api_key=<key> or as the WebSocket protocol "
            "'bearer.<key>'; other clients may send 'Authorization: Bearer <key>'"
        ]
        assert code == 3000
        assert refused(ws_url(base, "?api_key=wrong-key-000"))[:2] == (["[ERROR] the API key is not valid"], 3000)
        assert refused(ws_url(base), subprotocols=["bearer.wrong-key-000"])[:2] == (
            ["[ERROR] the API key is not valid"],
            3000,
        )

        with connect(ws_url(base, f"?api_key={VIP_KEY}")) as ws:
            assert answer(ws, {"prompt": "hi"})[-1] == "[DONE]"
        with connect(ws_url(base), subprotocols=["chat", f"bearer.{KEY}"]) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "chat"  # the key is never echoed where another protocol was offered
            assert answer(ws, {"prompt": "hi"})[-1] == "[DONE]"
        with connect(ws_url(base), subprotocols=[f"bearer.{VIP_KEY}"]) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == f"bearer.{VIP_KEY}"  # the only one offered: a browser needs one back
            assert answer(ws, {"prompt": "hi"})[-1] == "[DONE]"
        with connect(ws_url(base), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            assert answer(ws, {"prompt": "hi"})[-1] == "[DONE]"
        assert chat_requests(base) == {"ok": 4, "invalid": 3}
    lanes = [(e["lane"], e["key_id"]) for e in logs if e["event"] == "generation"]
    assert lanes == [
        ("high", key_id(VIP_KEY)),
        ("normal", key_id(KEY)),
        ("high", key_id(VIP_KEY)),
        ("normal", key_id(KEY)),
    ]
    assert engine.generated == [4, 4, 4, 4]


def test_a_page_of_another_origin_is_refused_unless_listed() -> None:
    engine = FakeEngine(PIECES)
    prompt = json.dumps({"prompt": "hi"})
    with fake_server(engine, chat_origins="https://app.example.com") as (base, _):
        port = base.rsplit(":", 1)[1]
        frames, code, _ = refused(ws_url(base), prompt, origin="https://evil.example.net")  # type: ignore[arg-type]
        assert frames == [
            "[ERROR] a page from 'https://evil.example.net' may not open /chat: only the server's own pages and "
            "TTFT_CHAT_ORIGINS may"
        ]
        assert code == 3003
        for origin in (f"http://127.0.0.1:{port}", "http://127.0.0.1:9", "https://app.example.com"):
            with connect(ws_url(base), origin=origin) as ws:  # type: ignore[arg-type]
                assert answer(ws, {"prompt": "hi"})[-1] == "[DONE]"
    assert engine.generated == [4, 4, 4]


def test_a_refusal_before_the_prompt_is_read_takes_the_prompt_before_it_closes() -> None:
    """hypercorn closes the TCP connection as soon as its Close frame is out; a prompt left unread would make that a
    reset, which can cost a client the ``[ERROR]`` frame (1 in 200 under load before this wait)."""
    engine = FakeEngine(PIECES)
    with (
        fake_server(engine, chat_origins="https://app.example.com") as (base, _),
        connect(ws_url(base), origin="https://evil.example.net") as ws,  # type: ignore[arg-type]
    ):
        assert str(ws.recv(timeout=30)).startswith("[ERROR] a page from 'https://evil.example.net'")
        time.sleep(0.2)  # the Close frame would be out by now, had the server not waited for a message
        ws.send(json.dumps({"prompt": "hi"}))  # still open: the server is waiting for it
        frames, code, reason = until_closed(ws)
    assert (frames, code, reason) == ([], 3003, "origin_not_allowed")
    assert engine.generated == []


# -- SIGTERM -------------------------------------------------------------------------------------------------------


def test_on_sigterm_an_answer_in_flight_finishes_idle_connections_close_and_newcomers_are_refused() -> None:
    engine = FakeEngine(PIECES, hold_after=1)
    app = fake_app(engine, drain_seconds=120)
    with serving(app) as served:
        idle = connect(ws_url(served.base))
        engine.release.set()
        assert answer(idle, {"prompt": "hi"})[-1] == "[DONE]"
        engine.release.clear()
        busy = connect(ws_url(served.base))
        busy.send(json.dumps({"prompt": "hi"}))
        assert busy.recv(timeout=60) == "Hello"

        served.stop()  # SIGTERM

        assert until_closed(idle) == ([], 1001, "the server is shutting down")
        frames, code, _ = refused(ws_url(served.base), json.dumps({"prompt": "hi"}))
        assert frames == [
            "[ERROR] the server is shutting down and starts no new generations; nothing was generated, retry "
            "(Retry-After: 1)"
        ]
        assert code == 1001
        assert engine.active == 1  # the answer in flight is still held, within the grace
        engine.release.set()
        assert until_closed(busy) == ([",", " world", "!", "[DONE]"], 1001, "the server is shutting down")
        assert served.wait_stopped(30)
    assert engine.generated == [4, 4]
