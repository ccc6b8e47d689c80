"""Admission over a real hypercorn server (fake engine): queued events, pings, lanes, leaving, 503 before headers.

The fake engine holds the first generation after one token until the test releases it, so who waits and who is
admitted next is decided by the gate alone: every assertion is about order and content, none about time.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import pytest

from tests.support.processes import wait_until
from tests.support.servers import SSEEvent, parse_sse, running
from ttft_sse.app import create_app
from ttft_sse.engine.base import Finished, Piece, Prompt, SamplingParams
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings

VIP, USER = "vip-secret-0001", "user-secret-0002"


class RecordingEngine(FakeEngine):
    """The fake engine, noting each generation's prompt as it starts: the order in which the gate admitted them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started: list[str] = []

    async def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Piece | Finished, None]:
        self.started.append(prompt.text)
        async for item in super().stream(prompt, params):
            yield item


class Reader:
    """Reads one SSE response in a thread, keeping every raw line (pings included)."""

    def __init__(self, base: str, prompt: str, key: str | None = None) -> None:
        self.lines: list[str] = []
        self.status: int | None = None
        self.closed = threading.Event()
        self._stop = threading.Event()
        headers = {"X-API-Key": key} if key else {}
        self._thread = threading.Thread(target=self._read, args=(base, prompt, headers), daemon=True)
        self._thread.start()

    def _read(self, base: str, prompt: str, headers: dict[str, str]) -> None:
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{base}/stream", json={"prompt": prompt}, headers=headers) as response,
        ):
            self.status = response.status_code
            for line in response.iter_lines():
                self.lines.append(line)
                if self._stop.is_set():
                    break  # closing the response drops the connection: the client has left
        self.closed.set()

    def events(self) -> list[SSEEvent]:
        return list(parse_sse(iter([*self.lines, ""])))

    def positions(self) -> list[int]:
        return [e.data["position"] for e in self.events() if e.event == "queued"]

    def wait_for(self, what: str, check: Any) -> None:
        wait_until(lambda: check(self), timeout=20, what=what, every=0.01)

    def leave(self) -> None:
        self._stop.set()

    def join(self) -> None:
        self._thread.join(30)
        assert self.closed.is_set()


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    engine = RecordingEngine(hold_after=1)
    yield engine
    engine.release.set()


def serve(engine: FakeEngine, **settings: Any) -> Any:
    # No warm-up: it would be held too. Pings every 0.1 s so that a queued stream shows one soon.
    return running(create_app(Settings(warmup=False, max_concurrency=1, ping_seconds=0.1, **settings), engine))


def test_queued_streams_see_their_position_move_get_pings_and_the_high_lane_goes_first(
    engine: RecordingEngine,
) -> None:
    with serve(engine, max_queue=4, api_keys=f"{VIP}:high,{USER}") as base:
        # A high holder: the high lane queues only behind its own work (normal work would let it in at once).
        holder = Reader(base, "holder", VIP)
        holder.wait_for("the holder's first token", lambda r: any(e.event == "token" for e in r.events()))
        n1 = Reader(base, "normal one", USER)
        n1.wait_for("n1 to be queued at 1", lambda r: r.positions() == [1])
        n2 = Reader(base, "normal two", USER)
        n2.wait_for("n2 to be queued at 2", lambda r: r.positions() == [2])
        high = Reader(base, "high", VIP)
        high.wait_for("the VIP to be queued first", lambda r: r.positions() == [1])
        n1.wait_for("n1 to move back to 2", lambda r: r.positions() == [1, 2])
        n2.wait_for("n2 to move back to 3", lambda r: r.positions() == [2, 3])
        n1.wait_for("a ping while n1 waits", lambda r: any(line.startswith(":") for line in r.lines))
        assert n1.status == 200 and not any(e.event == "token" for e in n1.events())

        engine.release.set()
        for reader in (holder, n1, n2, high):
            reader.join()
            assert [e.event for e in reader.events()][-1] == "done"
        assert engine.started == ["holder", "high", "normal one", "normal two"]
        assert n1.positions() == [1, 2, 1] and n2.positions() == [2, 3, 2, 1]  # then each moved up as others left


def test_a_client_that_leaves_while_queued_frees_its_place_and_a_full_queue_is_a_503_before_any_header(
    engine: RecordingEngine,
) -> None:
    with serve(engine, max_queue=1) as base:
        holder = Reader(base, "holder")
        holder.wait_for("the holder's first token", lambda r: any(e.event == "token" for e in r.events()))
        leaver = Reader(base, "leaver")
        leaver.wait_for("the leaver to be queued", lambda r: r.positions() == [1])

        full = httpx.post(f"{base}/stream", json={"prompt": "no room"}, timeout=10)
        assert full.status_code == 503
        assert full.headers["content-type"] == "application/json"
        assert int(full.headers["retry-after"]) >= 1
        assert full.json()["error"]["type"] == "overloaded_error"
        assert "1 generations running and 1 waiting" in full.json()["error"]["message"]

        leaver.leave()
        leaver.join()
        wait_until(lambda: httpx.get(f"{base}/readyz").json()["waiting"] == 0, timeout=20, what="the place to be freed")
        after = Reader(base, "after")
        after.wait_for("the newcomer to take the freed place", lambda r: r.positions() == [1])
        engine.release.set()
        after.join()
        holder.join()
        assert engine.started == ["holder", "after"]  # the leaver never generated


def test_an_overflow_job_waits_for_every_interactive_request(engine: RecordingEngine) -> None:
    with serve(engine, max_queue=4) as base:
        holder = Reader(base, "holder")
        holder.wait_for("the holder's first token", lambda r: any(e.event == "token" for e in r.events()))
        job = httpx.post(f"{base}/jobs", json={"prompt": "the job"}).json()
        wait_until(
            lambda: httpx.get(f"{base}/readyz").json()["waiting_by_lane"]["jobs"] == 1,
            timeout=20,
            what="the job to wait at the gate",
        )
        interactive = Reader(base, "interactive")
        interactive.wait_for("the request to be queued ahead of the job", lambda r: r.positions() == [1])
        engine.release.set()
        interactive.join()
        holder.join()
        wait_until(
            lambda: httpx.get(f"{base}/result/{job['id']}").json()["status"] == "done", timeout=20, what="the job"
        )
        assert engine.started == ["holder", "interactive", "the job"]
