"""Two replicas behind one address, for real: two ``ttft-sse serve`` with the bundled model and one Redis URL, a
``ttft-sse worker``, redis-server, and nginx running the shipped config in front of both (loopback only).

One stack serves the whole module (the model loads once per process); the tests run in this order, and the last
one kills replica A. Each replica runs one generation at a time with no queue, so that one held stream fills it.
deploy/compose.yaml describes the same stack (tests/test_compose.py keeps the two equal).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.nginx import nginx
from tests.support.processes import (
    Proc,
    redis_server,
    start_server,
    start_worker,
    wait_server_ready,
    wait_until,
    wait_worker_ready,
)
from tests.support.scrape import scrape
from tests.support.servers import SSEEvent, StreamReader, parse_sse
from ttft_sse.stores.resumable_redis import LEASE_SECONDS, POLL_SECONDS

# Only here, not in the compose stack: one generation per replica and no queue, so one held stream fills it.
SATURATING = {"TTFT_MAX_CONCURRENCY": "1", "TTFT_MAX_QUEUE": "0"}
SHORT = {"prompt": "List the days of the week.", "max_tokens": 48}
# A raw prompt the model carries on counting from, to max_tokens (no early end of text): seconds of generation.
LONG = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "raw": True, "max_tokens": 600}
# An owner killed mid-stream is noticed by its readers within a lease and a poll; a second more for the rest.
OWNER_LOST_SECONDS = LEASE_SECONDS + 2 * POLL_SECONDS + 1


@dataclass
class Stack:
    a: str
    b: str
    proxy: str
    proc_a: Proc
    proc_b: Proc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("replicas")
    with redis_server(tmp) as url:
        env = {"TTFT_REDIS_URL": url, **SATURATING}
        a, proc_a = start_server(tmp, env, name="replica-a")
        b, proc_b = start_server(tmp, env, name="replica-b")
        worker = start_worker(tmp, {"TTFT_REDIS_URL": url}, name="worker")
        try:
            wait_server_ready(a, proc_a, name="replica-a")
            wait_server_ready(b, proc_b, name="replica-b")
            wait_worker_ready(worker)
            with nginx([port_of(a), port_of(b)]) as proxy:
                yield Stack(a, b, proxy, proc_a, proc_b)
        finally:
            for proc in (worker, proc_b, proc_a):
                proc.stop()


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def create(base: str, body: dict[str, Any]) -> str:
    response = httpx.post(f"{base}/streams", json=body, timeout=30)
    assert response.status_code == 201, response.text
    stream_id: str = response.json()["id"]
    return stream_id


def read(base: str, stream_id: str, count: int | None = None, last: str | None = None) -> list[SSEEvent]:
    """``count`` events (or all of them) of the stream from ``base``, then the connection closes."""
    headers = {"Last-Event-ID": last} if last is not None else {}
    with httpx.Client(timeout=120) as client, client.stream("GET", f"{base}/streams/{stream_id}", headers=headers) as r:
        assert r.status_code == 200, r.read()
        events = parse_sse(r.iter_lines())
        return list(events) if count is None else [next(events) for _ in range(count)]


def text_of(events: list[SSEEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "token")


def seqs(events: list[SSEEvent]) -> list[int]:
    return [int(e.id.rsplit(".", 1)[1]) for e in events if e.id is not None]


def running(base: str) -> float:
    return scrape(httpx, base).value("ttft_sse_num_requests_running")


def until_idle(base: str, timeout: float = 30) -> None:
    wait_until(lambda: running(base) == 0, timeout=timeout, what=f"{base} to have no generation running")


@contextmanager
def holding(base: str) -> Iterator[None]:
    """A long generation on ``base`` (its one slot taken) until the block ends and the connection with it."""
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{base}/stream", json=LONG) as response:
        assert response.status_code == 200, response.read()
        # Kept: the iterator closes the response (and the server cancels) when it is collected.
        events = parse_sse(response.iter_lines())
        assert next(events).event == "token"
        yield
    until_idle(base)


def test_a_stream_made_on_a_resumes_on_b_with_exactly_what_was_missed(stack: Stack) -> None:
    expected = httpx.post(f"{stack.b}/complete", json=SHORT, timeout=120).json()
    stream_id = create(stack.a, SHORT)
    first = read(stack.a, stream_id, count=4)  # then the connection drops; A generates on
    rest = read(stack.b, stream_id, last=first[-1].id)  # the reconnect lands on B
    events = [*first, *rest]
    assert [e.event for e in first] == ["token"] * 4
    assert seqs(events) == list(range(len(events)))  # no event missing or doubled
    assert text_of(events) == expected["text"]
    assert events[-1].event == "done"
    assert {**events[-1].data["usage"], "cached_tokens": 0} == {**expected["usage"], "cached_tokens": 0}
    assert events[-1].data["finish_reason"] == expected["finish_reason"]
    again = httpx.get(f"{stack.a}/streams/{stream_id}", headers={"Last-Event-ID": events[-1].id})
    assert again.status_code == 204  # both replicas know it has ended


def test_delete_on_b_stops_the_generation_on_a(stack: Stack) -> None:
    before = scrape(httpx, stack.a)
    stream_id = create(stack.a, LONG)
    reader = StreamReader(f"{stack.b}/streams/{stream_id}")
    first = [reader.next() for _ in range(3)]
    deleted = httpx.delete(f"{stack.b}/streams/{stream_id}")
    rest = reader.rest(timeout=30)
    until_idle(stack.a, timeout=10)  # A's slot is free long before 600 tokens could have been made
    after = scrape(httpx, stack.a)
    assert deleted.status_code == 204
    assert [e.event for e in first] == ["token"] * 3  # type: ignore[union-attr]
    assert rest[-1].event == "error" and rest[-1].data["error"]["type"] == "cancelled_error"
    assert seqs([*first, *rest]) == list(range(3 + len(rest)))  # type: ignore[list-item]
    assert after.delta(before, "ttft_sse_requests_total", endpoint="streams", outcome="cancelled") == 1
    assert after.delta(before, "ttft_sse_requests_total", endpoint="streams", outcome="ok") == 0
    assert len([e for e in rest if e.event == "token"]) < LONG["max_tokens"] // 4  # type: ignore[operator]
    for base in (stack.a, stack.b):
        gone = httpx.get(f"{base}/streams/{stream_id}")
        assert (gone.status_code, gone.json()["error"]["code"]) == (410, "stream_expired")


def test_through_nginx_a_full_replica_hands_requests_to_the_other_and_two_full_ones_refuse(stack: Stack) -> None:
    proxy = stack.proxy
    with httpx.Client(timeout=120) as client, holding(stack.a):
        before_a, before_b = scrape(client, stack.a), scrape(client, stack.b)
        served = [client.post(f"{proxy}/complete", json=SHORT) for _ in range(3)]
        # A stream made through nginx lands on B; read through nginx, from whichever replica nginx picks.
        stream_id = create(proxy, SHORT)
        events = read(proxy, stream_id)
        after_a, after_b = scrape(client, stack.a), scrape(client, stack.b)
        with holding(stack.b):
            refused = {
                "complete": client.post(f"{proxy}/complete", json=SHORT),
                "streams": client.post(f"{proxy}/streams", json=SHORT),
                "stream": client.get(f"{proxy}/stream", params={"prompt": "hi"}),
            }
    assert [r.status_code for r in served] == [200, 200, 200]
    assert after_b.delta(before_b, "ttft_sse_requests_total", endpoint="complete", outcome="ok") == 3
    # nginx tried A for some of them (least_conn sees no connection of its own there): A refused, B served.
    assert after_a.delta(before_a, "ttft_sse_requests_total", endpoint="complete", outcome="overloaded") >= 1
    assert after_a.delta(before_a, "ttft_sse_requests_total", endpoint="complete", outcome="ok") == 0
    assert events[-1].event == "done" and text_of(events) == served[0].json()["text"]
    for name, response in refused.items():
        assert response.status_code == 503, (name, response.text)
        assert int(response.headers["retry-after"]) >= 1, name
        assert response.json()["error"]["type"] == "overloaded_error", name


def test_a_job_submitted_on_b_is_polled_on_a(stack: Stack) -> None:
    expected = httpx.post(f"{stack.a}/complete", json=SHORT, timeout=120).json()
    submitted = httpx.post(f"{stack.b}/jobs", json=SHORT)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]

    def finished() -> dict[str, Any] | None:
        view: dict[str, Any] = httpx.get(f"{stack.a}/result/{job_id}").json()
        return view if view["status"] in ("done", "failed", "cancelled") else None

    done = wait_until(finished, timeout=120, what="the job to end", every=0.1)
    assert isinstance(done, dict)
    assert (done["status"], done["text"]) == ("done", expected["text"])


def test_replica_a_killed_mid_stream_ends_its_stream_for_readers_on_b_with_owner_lost(stack: Stack) -> None:
    stream_id = create(stack.a, LONG)
    reader = StreamReader(f"{stack.b}/streams/{stream_id}")
    first = [reader.next() for _ in range(3)]
    stack.proc_a.stop(signal.SIGKILL)
    killed = time.monotonic()
    rest = reader.rest(timeout=30)
    ended = time.monotonic() - killed
    events = [*first, *rest]
    assert [e.event for e in first] == ["token"] * 3  # type: ignore[union-attr]
    assert rest[-1].event == "error", rest[-3:]
    assert rest[-1].data["error"]["code"] == "owner_lost"
    assert ended < OWNER_LOST_SECONDS, ended
    assert seqs(events) == list(range(len(events)))  # type: ignore[arg-type]
    # The final event is the stream's for good: a reconnect that has it hears 204, one that has not gets it.
    final = rest[-1].id
    assert httpx.get(f"{stack.b}/streams/{stream_id}", headers={"Last-Event-ID": final}).status_code == 204
    replay = read(stack.b, stream_id, last=rest[-2].id if len(rest) > 1 else first[-1].id)  # type: ignore[union-attr]
    assert [(e.event, e.id) for e in replay] == [("error", final)]
    # nginx goes on through B alone: A's refused connections are errors it passes over.
    assert httpx.post(f"{stack.proxy}/complete", json=SHORT, timeout=120).status_code == 200
