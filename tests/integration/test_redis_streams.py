"""Resumable streams in Redis: two servers (the scripted engine, in-process hypercorn) share one redis-server.

A stream made on one server is resumed, taken over, deleted and refused on the other exactly as on its own
(tests/integration/test_streams.py holds the single-server rules). ``test_replicas.py`` does it again with two real
``ttft-sse serve`` processes, the real model, nginx in front, and a SIGKILL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.integration.test_page import LATEST, ask, expect_state, latest, shown
from tests.integration.test_streams import LONG_PROMPT, PROMPT_DELAY, check_progress_then_tokens, read_tokens
from tests.support.browser import chromium
from tests.support.nginx import nginx
from tests.support.servers import (
    TWO_KEYS,
    SSEEvent,
    StreamReader,
    check_streams_belong_to_their_key,
    eventually,
    fake_app,
    free_port,
    parse_sse,
    running,
)
from tests.support.tcpproxy import tcp_proxy
from ttft_sse.engine.base import Piece
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.stores.resumable_redis import LEASE_SECONDS, POLL_SECONDS, Keys, encode

WORDS = tuple(f" w{i}" for i in range(12))
TEXT = "".join(WORDS)


class Pair:
    """Two servers on one Redis, each with its own scripted engine."""

    def __init__(self, a: str, b: str, engine_a: FakeEngine, engine_b: FakeEngine) -> None:
        self.a, self.b = a, b
        self.engine_a, self.engine_b = engine_a, engine_b
        self.client = httpx.Client(timeout=30)

    def create(self, base: str) -> str:
        response = self.client.post(f"{base}/streams", json={"prompt": "hi"})
        assert response.status_code == 201, response.text
        stream_id: str = response.json()["id"]
        return stream_id

    def read(self, base: str, stream_id: str, count: int | None = None, last: str | None = None) -> list[SSEEvent]:
        headers = {"Last-Event-ID": last} if last is not None else {}
        with self.client.stream("GET", f"{base}/streams/{stream_id}", headers=headers) as response:
            assert response.status_code == 200, response.read()
            events = parse_sse(response.iter_lines())
            return list(events) if count is None else [next(events) for _ in range(count)]


@pytest.fixture
def pair(redis_url: str, r: redis.Redis, request: pytest.FixtureRequest) -> Iterator[Pair]:
    options: dict[str, Any] = getattr(request, "param", {})
    engine_a = FakeEngine(WORDS, **options.get("engine", {}))
    engine_b = FakeEngine(WORDS, **options.get("engine", {}))
    settings = {"redis_url": redis_url, **options.get("settings", {})}
    with running(fake_app(engine_a, **settings)) as a, running(fake_app(engine_b, **settings)) as b:
        pair = Pair(a, b, engine_a, engine_b)
        yield pair
        pair.client.close()


def text_of(events: list[SSEEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "token")


def seqs(events: list[SSEEvent]) -> list[int]:
    return [int(e.id.rsplit(".", 1)[1]) for e in events if e.id is not None]


@pytest.mark.parametrize("pair", [{"engine": {"hold_after": 6}}], indirect=True)
def test_a_stream_made_on_one_server_resumes_on_the_other_with_exactly_the_missed_events(
    pair: Pair, r: redis.Redis
) -> None:
    stream_id = pair.create(pair.a)
    first = pair.read(pair.a, stream_id, count=3)  # then the connection drops
    eventually(lambda: r.hget(Keys(stream_id).meta, "last") == "5")  # 3 more made while nobody listened
    reader = StreamReader(f"{pair.b}/streams/{stream_id}", headers={"Last-Event-ID": first[-1].id})
    missed = [reader.next() for _ in range(3)]  # made on A while nobody read, replayed by B from Redis
    assert pair.engine_a.active == 1 and pair.engine_b.generated == []  # A still generates, B never did
    pair.engine_a.release.set()
    live = reader.rest()
    events = [*first, *missed, *live]  # type: ignore[list-item]
    assert seqs(events) == list(range(len(WORDS) + 1))  # no duplicates, no gaps
    assert text_of(events) == TEXT and events[-1].event == "done"
    # The final event was read: both servers say 204 (EventSource stops), and HEAD attaches nothing.
    assert pair.client.get(f"{pair.a}/streams/{stream_id}", headers={"Last-Event-ID": events[-1].id}).status_code == 204
    assert pair.client.get(f"{pair.b}/streams/{stream_id}", headers={"Last-Event-ID": events[-1].id}).status_code == 204


@pytest.mark.parametrize(
    "pair", [{"engine": {"hold_after": 6, "prompt_delay": PROMPT_DELAY, "context_length": 4096}}], indirect=True
)
def test_a_long_prompt_tells_its_progress_on_the_other_server_and_a_resume_gets_exactly_the_missed_tokens(
    pair: Pair, r: redis.Redis
) -> None:
    created = pair.client.post(f"{pair.a}/streams", json={"prompt": LONG_PROMPT})
    assert created.status_code == 201, created.text
    stream_id: str = created.json()["id"]
    first = read_tokens(pair.client, f"{pair.b}/streams/{stream_id}", 3)  # A's progress, read on B; then a drop
    eventually(lambda: r.hget(Keys(stream_id).meta, "last") == "5")
    pair.engine_a.release.set()
    eventually(lambda: r.hget(Keys(stream_id).meta, "state") == "ended")
    resumed = pair.read(pair.a, stream_id, last=first[-1].id)
    again = pair.read(pair.b, stream_id)  # a reader from the start, once the prompt is long computed
    check_progress_then_tokens(first, stream_id, 96)
    # Progress is not history: it is no entry of the Redis Stream (13 entries: 12 tokens and done), no reader hears
    # it again, and the ids go on from the last token's.
    assert r.xlen(Keys(stream_id).events) == len(WORDS) + 1
    assert r.hget(Keys(stream_id).meta, "progress") == ""  # cleared by the first token
    assert [(e.event, e.id) for e in resumed] == [
        *[("token", f"{stream_id}.{i}") for i in range(3, len(WORDS))],
        ("done", f"{stream_id}.{len(WORDS)}"),
    ]
    assert text_of(first + resumed) == TEXT
    assert [(e.event, e.id) for e in again] == [(e.event, e.id) for e in first + resumed if e.event != "progress"]


@pytest.mark.parametrize(
    "pair", [{"engine": {"hold_after": 1, "delay": 0.05}, "settings": {"max_concurrency": 1}}], indirect=True
)
def test_a_queued_stream_says_its_place_once_and_not_position_0_between_its_tokens(pair: Pair) -> None:
    """The position Redis holds is 0 once the stream is admitted: that is the end of the queue, not a place in it."""
    holder = StreamReader(f"{pair.a}/stream?prompt=hi")  # takes A's only slot and holds it
    assert holder.next().event == "token"  # type: ignore[union-attr]
    stream_id = pair.create(pair.a)
    reader = StreamReader(f"{pair.b}/streams/{stream_id}")
    queued = reader.next()
    assert queued is not None and (queued.event, queued.data, queued.id) == ("queued", {"position": 1}, None)
    pair.engine_a.release.set()  # the tokens come 50 ms apart: B reads the stream's state between them
    events = reader.rest()
    assert holder.rest()[-1].event == "done"
    assert [e.event for e in events] == ["token"] * len(WORDS) + ["done"]
    assert text_of(events) == TEXT


@pytest.mark.parametrize("pair", [{"engine": {"hold_after": 2}}], indirect=True)
def test_delete_on_the_other_server_stops_the_generation_and_every_reader_gets_the_final_event(pair: Pair) -> None:
    stream_id = pair.create(pair.a)
    reader = StreamReader(f"{pair.a}/streams/{stream_id}")
    assert [reader.next().event for _ in range(2)] == ["token", "token"]  # type: ignore[union-attr]
    deleted = pair.client.delete(f"{pair.b}/streams/{stream_id}")
    rest = reader.rest()
    eventually(lambda: pair.engine_a.active == 0, timeout=5)
    after = [pair.client.get(f"{base}/streams/{stream_id}") for base in (pair.a, pair.b)]
    again = pair.client.delete(f"{pair.a}/streams/{stream_id}")
    assert deleted.status_code == 204
    assert [(e.event, e.id) for e in rest] == [("error", f"{stream_id}.2")]
    assert (rest[0].data["error"]["type"], rest[0].data["error"]["code"]) == ("cancelled_error", "cancelled")
    assert pair.engine_a.generated == [2]
    for response in (*after, again):
        assert response.status_code == 410
        assert response.json()["error"]["message"] == f"stream {stream_id} is gone: it was deleted"


def test_unknown_and_malformed_ids_are_refused_alike_on_every_server(pair: Pair) -> None:
    stream_id = pair.create(pair.a)
    done = pair.read(pair.a, stream_id)
    for base in (pair.a, pair.b):
        cases = {
            "unknown": pair.client.get(f"{base}/streams/no-such-stream"),
            "odd": pair.client.get(f"{base}/streams/{'x' * 65}"),
            "unknown-delete": pair.client.delete(f"{base}/streams/no-such-stream"),
            "never-sent": pair.client.get(f"{base}/streams/{stream_id}", headers={"Last-Event-ID": f"{stream_id}.99"}),
            "foreign": pair.client.get(f"{base}/streams/{stream_id}", headers={"Last-Event-ID": "other.1"}),
            "malformed": pair.client.get(f"{base}/streams/{stream_id}", headers={"Last-Event-ID": "7"}),
        }
        status = {name: (r.status_code, r.json()["error"]["code"]) for name, r in cases.items()}
        assert status == {
            "unknown": (404, "stream_not_found"),
            "odd": (404, "stream_not_found"),
            "unknown-delete": (404, "stream_not_found"),
            "never-sent": (400, "foreign_event_id"),
            "foreign": (400, "foreign_event_id"),
            "malformed": (400, "invalid_event_id"),
        }, base
        assert f"has sent events up to {done[-1].id}" in cases["never-sent"].json()["error"]["message"]


@pytest.mark.parametrize("pair", [{"settings": {"api_keys": TWO_KEYS}}], indirect=True)
def test_with_keys_a_stream_is_its_creators_on_every_server(pair: Pair) -> None:
    """Made on one server, refused to the other key and opened by its creator's key or grant on the other."""
    check_streams_belong_to_their_key(pair.a, pair.b, pair.client)


@pytest.mark.parametrize("pair", [{"settings": {"stream_buffer_events": 4}}], indirect=True)
def test_the_buffer_bound_holds_in_redis_as_in_memory(pair: Pair, r: redis.Redis) -> None:
    stream_id = pair.create(pair.a)
    # Every event in Redis first (the engine's own count comes before the last writes): 12 tokens, then done.
    eventually(lambda: r.hget(Keys(stream_id).meta, "last") == "12")
    tail = pair.read(pair.b, stream_id, last=f"{stream_id}.8")
    too_old = pair.client.get(f"{pair.b}/streams/{stream_id}", headers={"Last-Event-ID": f"{stream_id}.7"})
    assert too_old.status_code == 410
    assert too_old.json()["error"]["code"] == "events_dropped"
    assert "keeps the last 4 events (from 9 now)" in too_old.json()["error"]["message"]
    assert [(e.event, e.id) for e in tail] == [
        ("token", f"{stream_id}.9"),
        ("token", f"{stream_id}.10"),
        ("token", f"{stream_id}.11"),
        ("done", f"{stream_id}.12"),
    ]


@pytest.mark.parametrize(
    "pair", [{"engine": {"hold_after": 1}, "settings": {"resume_grace_seconds": 1}}], indirect=True
)
def test_after_the_grace_with_no_reader_anywhere_the_generation_is_cancelled_and_every_server_says_410(
    pair: Pair, r: redis.Redis
) -> None:
    stream_id = pair.create(pair.a)
    assert text_of(pair.read(pair.b, stream_id, count=1)) == " w0"  # read on B, then gone from both
    eventually(lambda: pair.engine_a.active == 0, timeout=1 + LEASE_SECONDS + 3 * POLL_SECONDS)
    for base in (pair.a, pair.b):
        gone = pair.client.get(f"{base}/streams/{stream_id}")
        assert gone.status_code == 410
        assert "no client was attached for 1 s" in gone.json()["error"]["message"]
    assert pair.engine_a.generated == [1]
    assert r.ttl(Keys(stream_id).meta) > 0  # the tombstone expires too


@pytest.mark.parametrize("pair", [{"engine": {"hold_after": 2}}], indirect=True)
def test_a_reader_on_the_other_server_takes_over(pair: Pair) -> None:
    stream_id = pair.create(pair.a)
    old = StreamReader(f"{pair.a}/streams/{stream_id}")
    seen = [old.next(), old.next()]
    new = StreamReader(f"{pair.b}/streams/{stream_id}", headers={"Last-Event-ID": seen[-1].id})  # type: ignore[union-attr]
    assert old.rest(timeout=3 * POLL_SECONDS + 5) == []  # the old one ends quietly within a poll
    pair.engine_a.release.set()
    rest = new.rest()
    assert text_of([*seen, *rest]) == TEXT  # type: ignore[list-item]


def test_a_stream_whose_owner_stopped_beating_ends_with_owner_lost(pair: Pair, r: redis.Redis) -> None:
    """The owner's heartbeat key is what readers watch: a stream whose owner has none ends for its readers with a
    final error they all share (its id is the next number), within a poll."""
    keys = Keys("ghostly-stream")
    r.hset(keys.meta, mapping={"owner": "ghost-replica", "state": "live", "last": 1, "position": 0})
    for seq in range(2):
        kind, data = encode(Piece(seq, WORDS[seq]))
        r.xadd(keys.events, {"kind": kind, "data": data}, id=f"0-{seq + 1}")
    r.set(keys.alive, "1", px=30_000)
    started = time.monotonic()
    events = pair.read(pair.b, "ghostly-stream")
    took = time.monotonic() - started
    again = pair.read(pair.a, "ghostly-stream", last="ghostly-stream.1")
    assert [(e.event, e.id) for e in events] == [
        ("token", "ghostly-stream.0"),
        ("token", "ghostly-stream.1"),
        ("error", "ghostly-stream.2"),
    ]
    assert events[-1].data["error"]["code"] == "owner_lost"
    assert took < 2 * POLL_SECONDS + 1
    assert [(e.event, e.id, e.data) for e in again] == [(e.event, e.id, e.data) for e in events[-1:]]


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def test_the_page_finishes_its_answer_when_the_reconnect_lands_on_the_other_replica(
    redis_url: str, r: redis.Redis
) -> None:
    """Headless Chromium through nginx (the shipped file, both replicas). The network is cut mid-answer; when it
    comes back it leads to an nginx in front of the replica that does not run the generation, so the page's
    EventSource reconnect lands there, and that replica finishes the answer from Redis."""
    words = [f" word{i}" for i in range(30)]
    engines = [FakeEngine(words, hold_after=8, context_length=4096) for _ in range(2)]
    with (
        running(fake_app(engines[0], redis_url=redis_url)) as a,
        running(fake_app(engines[1], redis_url=redis_url)) as b,
        nginx([port_of(a), port_of(b)]) as both,
        tcp_proxy(port_of(both)) as net,
        chromium() as browser,
    ):
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(f"{net.base}/")
        stream_id = ask(page, "Say thirty words.")
        eventually(lambda: sum(engine.active for engine in engines) == 1)
        owner = 0 if engines[0].active else 1
        page.wait_for_function(f"() => ({LATEST})()[0] == {len(''.join(words[:8]).strip())}")
        net.cut()
        expect_state(page, "reconnecting")
        with nginx([port_of((a, b)[1 - owner])]) as other:
            net.upstream = ("127.0.0.1", port_of(other))  # where the network leads once it is back
            engines[owner].release.set()  # the rest is made while the page is cut off
            eventually(lambda: r.hget(Keys(stream_id).meta, "state") == "ended")
            net.restore()
            expect_state(page, "done")
            text = shown(latest(page))
        context.close()
    assert text == "".join(words).strip()  # no gap, no duplicate
    assert engines[owner].generated == [30] and engines[1 - owner].generated == []


def test_with_redis_unreachable_stream_requests_are_503_and_give_their_slot_back() -> None:
    engine = FakeEngine(WORDS)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with running(fake_app(engine, redis_url=nowhere, max_concurrency=1)) as base, httpx.Client(timeout=30) as client:
        created = client.post(f"{base}/streams", json={"prompt": "hi"})
        read_back = client.get(f"{base}/streams/some-stream")
        deleted = client.delete(f"{base}/streams/some-stream")
        streamed = client.post(f"{base}/complete", json={"prompt": "hi"})  # the slot it took is free again
    for response in (created, read_back, deleted):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "5"
        assert "stream store (Redis) cannot be reached" in response.json()["error"]["message"]
    assert streamed.status_code == 200 and streamed.json()["text"] == TEXT
    assert engine.generated == [len(WORDS)]  # the refused stream generated nothing
