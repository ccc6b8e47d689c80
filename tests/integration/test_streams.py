"""Resumable streams (``POST /streams``, ``GET|DELETE /streams/{id}``) over a real hypercorn server.

The scripted engine makes orderings exact: ``hold_after=n`` keeps a generation running after ``n`` pieces until
the test releases it, so "the client was gone while tokens were made" and "the reconnect came before the rest"
are facts the test sets up; ``prompt_delay`` makes a prompt take known steps, so that it tells its progress. The last
tests do the same with the real model and compare against an uninterrupted greedy run.
"""

from __future__ import annotations

import gc
import re
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from structlog.testing import capture_logs

from tests.support.servers import (
    TWO_KEYS,
    SSEEvent,
    StreamReader,
    check_streams_belong_to_their_key,
    eventually,
    fake_app,
    parse_sse,
    running,
    serving,
)
from ttft_sse.admission.grants import digest
from ttft_sse.engine.fake import FakeEngine

WORDS = tuple(f" w{i}" for i in range(12))
TEXT = "".join(WORDS)
LONG_PROMPT = " ".join(f"p{i}" for i in range(96))  # 96 tokens: 12 scripted steps
PROMPT_DELAY = 0.02  # seconds a scripted prompt token takes: 0.16 s a step, 1.92 s the prompt


@contextmanager
def server(engine: FakeEngine, **settings: Any) -> Iterator[tuple[str, Starlette, httpx.Client]]:
    app = fake_app(engine, **settings)
    with running(app) as base, httpx.Client(base_url=base, timeout=30) as client:
        yield base, app, client


def create(client: httpx.Client, body: dict[str, Any] | None = None) -> str:
    response = client.post("/streams", json=body or {"prompt": "hi"})
    assert response.status_code == 201, response.text
    created = response.json()
    assert set(created) == {"id", "url", "lane"} and created["lane"] == "normal"  # an open server: every caller normal
    assert created["url"] == f"/streams/{created['id']}" == response.headers["location"]
    url: str = created["url"]
    return url


def read(client: httpx.Client, url: str, count: int | None = None, last: str | None = None) -> list[SSEEvent]:
    """``count`` events (or all of them), then close the connection: a client whose network went away."""
    headers = {"Last-Event-ID": last} if last is not None else {}
    with client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.iter_lines())
        return list(events) if count is None else [next(events) for _ in range(count)]


def text_of(events: list[SSEEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "token")


def stream_of(app: Starlette, url: str) -> Any:
    return app.state.runtime.streams.get(url.rsplit("/", 1)[1])


def test_the_generation_starts_at_the_post_and_every_event_has_an_id_of_its_stream() -> None:
    engine = FakeEngine(WORDS)
    with server(engine) as (_, app, client):
        url = create(client)
        stream_id = url.rsplit("/", 1)[1]
        # Nobody has attached yet, and the whole answer is already made and buffered.
        eventually(lambda: stream_of(app, url).ended)
        assert engine.generated == [len(WORDS)]
        head = client.head(url)  # headers only: attaches nothing, sends nothing
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["content-type"].startswith("text/event-stream")
        events = read(client, url)
        # Reading again from the final event: nothing left to send, and 204 is what stops EventSource retrying.
        again = client.get(url, headers={"Last-Event-ID": events[-1].id})
    assert [(e.event, e.id) for e in events] == [
        *[("token", f"{stream_id}.{i}") for i in range(len(WORDS))],
        ("done", f"{stream_id}.{len(WORDS)}"),
    ]
    assert text_of(events) == TEXT
    done = events[-1].data
    assert done["finish_reason"] == "stop"
    words = len(WORDS)
    assert done["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": words,
        "total_tokens": words + 1,
        "cached_tokens": 0,
    }
    assert 0 <= done["timings"]["ttft_ms"] <= done["timings"]["total_ms"]
    assert again.status_code == 204 and again.content == b""


def test_a_reconnect_gets_exactly_the_missed_events_then_the_live_rest() -> None:
    engine = FakeEngine(WORDS, hold_after=6)
    with server(engine) as (_, app, client):
        url = create(client)
        first = read(client, url, count=3)  # then the connection drops
        stream = stream_of(app, url)
        eventually(lambda: not stream.attached and stream.last == 5)  # 3 more made while nobody listened
        assert engine.active == 1  # and the generation kept going: it is held, not cancelled
        reader = StreamReader(f"{client.base_url}{url}", headers={"Last-Event-ID": first[-1].id})
        missed = [reader.next() for _ in range(3)]
        assert engine.active == 1 and not stream.ended  # the replay came from the buffer, the engine still holds
        engine.release.set()
        live = reader.rest()
    assert [e.id for e in first + missed] == [f"{stream.id}.{i}" for i in range(6)]  # type: ignore[union-attr]
    assert text_of(first + missed + live) == TEXT  # type: ignore[operator]
    assert [e.event for e in live] == ["token"] * (len(WORDS) - 6) + ["done"]
    assert live[0].id == f"{stream.id}.6"


def test_cut_at_several_points_joins_to_the_uninterrupted_text() -> None:
    engine = FakeEngine(WORDS, delay=0.01)  # still generating during most of the reconnects
    with server(engine) as (_, _app, client):
        url = create(client)
        events: list[SSEEvent] = []
        for count in (1, 2, 4, 3):
            events += read(client, url, count=count, last=events[-1].id if events else None)
        events += read(client, url, last=events[-1].id)
    ids = [int(e.id.rsplit(".", 1)[1]) for e in events if e.id is not None]
    assert ids == list(range(len(WORDS) + 1))  # no duplicates, no gaps
    assert text_of(events) == TEXT
    assert events[-1].event == "done"


def read_tokens(client: httpx.Client, url: str, tokens: int) -> list[SSEEvent]:
    """The events up to the ``tokens``-th token, then close the connection."""
    events: list[SSEEvent] = []
    with client.stream("GET", url) as response:
        assert response.status_code == 200, response.read()
        for event in parse_sse(response.iter_lines()):
            events.append(event)
            if sum(e.event == "token" for e in events) == tokens:
                return events
    raise AssertionError(f"the stream ended after {events}")


def check_progress_then_tokens(events: list[SSEEvent], stream_id: str, prompt_tokens: int) -> None:
    """Progress, then the tokens from the stream's first id: a few progress events, with no id (they are no place
    to resume from), of the whole prompt, growing, and none after the first token."""
    kinds = [e.event for e in events]
    first_token = kinds.index("token")
    assert first_token >= 2 and kinds[:first_token] == ["progress"] * first_token, kinds
    assert "progress" not in kinds[first_token:]
    progress = events[:first_token]
    assert {e.id for e in progress} == {None}
    assert {e.data["prompt_tokens"] for e in progress} == {prompt_tokens}
    computed = [e.data["computed"] for e in progress]
    assert computed == sorted(set(computed)) and computed[0] >= 0 and computed[-1] <= prompt_tokens
    tokens = [e.id for e in events[first_token:] if e.event == "token"]
    assert tokens == [f"{stream_id}.{i}" for i in range(len(tokens))]


def test_a_long_prompt_tells_its_progress_before_the_first_token_and_a_resume_gets_exactly_the_missed_tokens() -> None:
    engine = FakeEngine(WORDS, hold_after=6, prompt_delay=PROMPT_DELAY, context_length=4096)
    with server(engine) as (_, app, client):
        url = create(client, {"prompt": LONG_PROMPT})
        first = read_tokens(client, url, 3)  # then the connection drops
        stream = stream_of(app, url)
        eventually(lambda: not stream.attached and stream.last == 5)
        engine.release.set()
        eventually(lambda: stream.ended)
        resumed = read(client, url, last=first[-1].id)
        again = read(client, url)  # a reader from the start, once the prompt is long computed
    check_progress_then_tokens(first, stream.id, 96)
    # Progress is not history: neither reader hears it again, and the ids go on from the last token's.
    assert [(e.event, e.id) for e in resumed] == [
        *[("token", f"{stream.id}.{i}") for i in range(3, len(WORDS))],
        ("done", f"{stream.id}.{len(WORDS)}"),
    ]
    assert text_of(first + resumed) == TEXT
    assert [(e.event, e.id) for e in again] == [(e.event, e.id) for e in first + resumed if e.event != "progress"]
    assert resumed[-1].data["usage"]["prompt_tokens"] == 96


@pytest.mark.parametrize("attach_first", [True, False], ids=["client-left", "client-never-came"])
def test_after_the_grace_with_no_client_the_generation_is_cancelled_and_the_buffer_freed(attach_first: bool) -> None:
    held = 2 if attach_first else 0
    engine = FakeEngine(WORDS, hold_after=held)  # never released: only the expiry can end it
    with capture_logs() as logs, server(engine, resume_grace_seconds=1) as (_, app, client):
        url = create(client)
        runtime = app.state.runtime
        stream = weakref.ref(stream_of(app, url))
        if attach_first:
            assert text_of(read(client, url, count=2)) == " w0 w1"
        eventually(lambda: engine.active == 0)

        def freed() -> bool:
            gc.collect()
            return stream() is None

        eventually(freed)
        gone = client.get(url)
        assert (len(runtime.streams), runtime.streams.buffered, runtime.gate.running) == (0, 0, 0)
    assert engine.generated == [held]  # cut while held: it never went past the piece it held on
    assert gone.status_code == 410
    error = gone.json()["error"]
    assert (error["type"], error["code"]) == ("not_found_error", "stream_expired")
    assert "no client was attached for 1 s" in error["message"]
    outcome = [(e["endpoint"], e["outcome"]) for e in logs if e["event"] == "generation"]
    assert outcome == [("streams", "cancelled")]
    assert [e["event"] for e in logs if e["event"].startswith("stream_expired")] == ["stream_expired"]


def test_an_attached_reader_keeps_the_stream_alive_past_the_grace() -> None:
    engine = FakeEngine(WORDS, hold_after=2)
    with server(engine, resume_grace_seconds=1) as (_, app, client):
        url = create(client)
        reader = StreamReader(f"{client.base_url}{url}")
        assert [reader.next().event for _ in range(2)] == ["token", "token"]  # type: ignore[union-attr]
        time.sleep(3)  # three graces
        assert engine.active == 1 and stream_of(app, url).attached
        engine.release.set()
        rest = reader.rest()
    assert [e.event for e in rest] == ["token"] * (len(WORDS) - 2) + ["done"]


def test_buffers_are_bounded_and_a_reconnect_too_far_behind_is_told_so() -> None:
    engine = FakeEngine(WORDS)
    with server(engine, stream_buffer_events=4) as (_, app, client):
        url = create(client)
        stream = stream_of(app, url)
        eventually(lambda: stream.ended)
        assert (stream.buffered, app.state.runtime.streams.buffered) == (4, 4)  # 12 tokens + done made, 4 kept
        from_start = client.get(url)
        too_old = client.get(url, headers={"Last-Event-ID": f"{stream.id}.7"})
        tail = read(client, url, last=f"{stream.id}.8")
    for response in (from_start, too_old):
        assert response.status_code == 410
        error = response.json()["error"]
        assert error["code"] == "events_dropped"
        assert "keeps the last 4 events (from 9 now)" in error["message"]
    assert [(e.event, e.id) for e in tail] == [
        ("token", f"{stream.id}.9"),
        ("token", f"{stream.id}.10"),
        ("token", f"{stream.id}.11"),
        ("done", f"{stream.id}.12"),
    ]


def test_streams_are_capped_and_finished_ones_are_evicted_first() -> None:
    engine = FakeEngine(WORDS, hold_after=1)
    with server(engine, max_streams=2) as (_, app, client):
        first, second = create(client), create(client)
        eventually(lambda: engine.active == 2)
        refused = client.post("/streams", json={"prompt": "hi"})
        assert refused.status_code == 503
        assert refused.headers["retry-after"]
        assert (refused.json()["error"]["type"], refused.json()["error"]["code"]) == (
            "overloaded_error",
            "too_many_streams",
        )
        assert app.state.runtime.gate.running == 2  # the refused one took no slot
        engine.release.set()
        eventually(lambda: stream_of(app, first).ended and stream_of(app, second).ended)
        third = create(client)  # room is made by dropping the oldest finished stream
        evicted = client.get(first)
        assert len(app.state.runtime.streams) == 2
        assert read(client, second)[-1].event == "done"
        assert read(client, third)[-1].event == "done"
    assert evicted.status_code == 410
    assert "evicted to make room (TTFT_MAX_STREAMS=2)" in evicted.json()["error"]["message"]


def test_unknown_foreign_and_malformed_reconnects_get_a_clear_error_and_start_nothing() -> None:
    engine = FakeEngine(WORDS)
    with server(engine) as (_, app, client):
        url, other = create(client), create(client)
        eventually(lambda: stream_of(app, url).ended and stream_of(app, other).ended)
        other_id = other.rsplit("/", 1)[1]
        stream_id = url.rsplit("/", 1)[1]
        cases = {
            "unknown": client.get("/streams/no-such-stream"),
            "unknown-delete": client.delete("/streams/no-such-stream"),
            "foreign": client.get(url, headers={"Last-Event-ID": f"{other_id}.3"}),
            "foreign-query": client.get(url, params={"lastEventId": f"{other_id}.3"}),
            "never-sent": client.get(url, headers={"Last-Event-ID": f"{stream_id}.99"}),
            "malformed": client.get(url, headers={"Last-Event-ID": "7"}),
            "unknown-param": client.get(url, params={"prompt": "hi"}),
        }
        generated = list(engine.generated)
    assert generated == [len(WORDS), len(WORDS)]  # none of the requests below started a generation
    status = {name: (r.status_code, r.json()["error"]["code"]) for name, r in cases.items()}
    assert status == {
        "unknown": (404, "stream_not_found"),
        "unknown-delete": (404, "stream_not_found"),
        "foreign": (400, "foreign_event_id"),
        "foreign-query": (400, "foreign_event_id"),
        "never-sent": (400, "foreign_event_id"),
        "malformed": (400, "invalid_event_id"),
        "unknown-param": (400, None),
    }
    assert cases["foreign"].json()["error"]["message"] == (
        f"Last-Event-ID '{other_id}.3' belongs to another stream, not {stream_id}"
    )
    assert cases["foreign"].json()["error"]["param"] == "Last-Event-ID"
    assert f"has sent events up to {stream_id}.12" in cases["never-sent"].json()["error"]["message"]


def test_with_api_keys_creating_a_stream_needs_one_and_its_url_carries_the_grant_that_reads_it() -> None:
    engine = FakeEngine(WORDS)
    with server(engine, api_keys="sekrit-key-1") as (_, _app, client):
        refused = client.post("/streams", json={"prompt": "hi"})
        created = client.post("/streams", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekrit-key-1"})
        events = read(client, created.json()["url"])  # no key: EventSource cannot send one; the url's grant reads it
    assert (refused.status_code, refused.json()["error"]["code"]) == (401, "missing_api_key")
    assert created.status_code == 201
    assert text_of(events) == TEXT
    assert engine.generated == [len(WORDS)]


def test_delete_stops_the_generation_and_an_attached_reader_gets_the_final_event() -> None:
    engine = FakeEngine(WORDS, hold_after=1)
    with capture_logs() as logs, server(engine) as (_, app, client):
        url = create(client)
        stream_id = url.rsplit("/", 1)[1]
        reader = StreamReader(f"{client.base_url}{url}")
        assert reader.next().event == "token"  # type: ignore[union-attr]
        deleted = client.delete(url)
        rest = reader.rest()
        eventually(lambda: engine.active == 0)
        after = client.get(url)
        again = client.delete(url)
        assert app.state.runtime.gate.running == 0
    assert deleted.status_code == 204
    assert [(e.event, e.id) for e in rest] == [("error", f"{stream_id}.1")]
    assert rest[0].data["error"]["type"] == "cancelled_error"
    assert engine.generated == [1]
    assert (after.status_code, again.status_code) == (410, 410)
    assert after.json()["error"]["message"] == f"stream {stream_id} is gone: it was deleted"
    outcome = [(e["endpoint"], e["outcome"]) for e in logs if e["event"] == "generation"]
    assert outcome == [("streams", "cancelled")]


def test_a_new_reader_takes_over_from_one_the_server_still_thinks_is_connected() -> None:
    engine = FakeEngine(WORDS, hold_after=2)
    with server(engine) as (base, app, client):
        url = create(client)
        old = StreamReader(f"{base}{url}")
        seen = [old.next(), old.next()]
        new = StreamReader(f"{base}{url}", headers={"Last-Event-ID": seen[-1].id})  # type: ignore[union-attr]
        assert old.rest() == []  # the old response ends, quietly: it was replaced, not failed
        assert new.error is None and stream_of(app, url).attached
        engine.release.set()
        rest = new.rest()
    assert text_of([*seen, *rest]) == TEXT  # type: ignore[list-item]
    assert rest[-1].event == "done"


def test_a_queued_stream_says_so_then_streams() -> None:
    engine = FakeEngine(WORDS, hold_after=1)
    with server(engine, max_concurrency=1) as (base, _app, client):
        holder = StreamReader(f"{base}/stream?prompt=hi")
        assert holder.next().event == "token"  # type: ignore[union-attr]
        url = create(client)
        reader = StreamReader(f"{base}{url}")
        queued = reader.next()
        assert queued is not None and (queued.event, queued.data, queued.id) == ("queued", {"position": 1}, None)
        engine.release.set()
        events = reader.rest()
        assert holder.rest()[-1].event == "done"
    assert text_of(events) == TEXT and events[-1].event == "done"


def test_the_drain_ends_a_stream_with_its_final_event_and_refuses_new_streams() -> None:
    engine = FakeEngine(WORDS, hold_after=1)
    app = fake_app(engine, drain_seconds=3)
    with serving(app) as served:
        response = httpx.post(f"{served.base}/streams", json={"prompt": "hi"})
        url = response.json()["url"]
        reader = StreamReader(f"{served.base}{url}")
        assert reader.next().event == "token"  # type: ignore[union-attr]
        served.stop()  # SIGTERM
        eventually(lambda: app.state.runtime.lifecycle.state == "stopping")
        refused = httpx.post(f"{served.base}/streams", json={"prompt": "hi"})  # within the 3 s grace
        events = reader.rest()
        assert served.wait_stopped(60)
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "draining")
    assert [(e.event, e.id) for e in events] == [("error", f"{url.rsplit('/', 1)[1]}.1")]
    assert (events[0].data["error"]["type"], events[0].data["error"]["code"]) == ("shutdown_error", "drain_timeout")
    assert engine.active == 0 and engine.generated == [1]


# --- the real model ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [(1, 3, 5), (8,), (2, 2, 2, 2, 2)])
def test_resumed_real_model_text_equals_an_uninterrupted_greedy_run(hf_server: str, cuts: tuple[int, ...]) -> None:
    body = {"prompt": "List the days of the week.", "max_tokens": 48}
    with httpx.Client(base_url=hf_server, timeout=120) as client:
        expected = client.post("/complete", json=body).json()
        url = create(client, body)
        events: list[SSEEvent] = []
        for count in cuts:
            events += read(client, url, count=count, last=events[-1].id if events else None)
        events += read(client, url, last=events[-1].id)
    ids = [int(e.id.rsplit(".", 1)[1]) for e in events if e.id is not None]
    assert ids == list(range(len(ids)))
    assert len(ids) > sum(cuts) + 1  # the answer went on past every cut
    assert text_of(events) == expected["text"]
    assert events[-1].event == "done"
    assert {**events[-1].data["usage"], "cached_tokens": 0} == {**expected["usage"], "cached_tokens": 0}
    assert events[-1].data["finish_reason"] == expected["finish_reason"]


def test_with_keys_a_stream_is_its_creators_and_its_id_stays_out_of_the_logs() -> None:
    """The probe's finding: with keys on, any caller with a stream's id (another key, or none) could read and delete
    it, and the id (the credential) was in every info line about it."""
    with capture_logs() as logs, server(FakeEngine(WORDS), api_keys=TWO_KEYS) as (base, _app, client):
        stream_id = check_streams_belong_to_their_key(base, base, client)
    lines = [entry for entry in logs if entry["event"].startswith("stream_")]
    assert {"stream_created", "stream_attached", "stream_deleted"} <= {entry["event"] for entry in lines}
    assert digest(stream_id) in {entry["stream"] for entry in lines}
    assert all(re.fullmatch("s-[0-9a-f]{10}", entry["stream"]) for entry in lines)
    assert stream_id not in repr(logs)  # nor in the access lines' paths
