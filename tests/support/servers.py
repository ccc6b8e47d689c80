"""Test helpers: run an app under a real hypercorn server on a loopback port, in a background thread.

In-process ASGI clients buffer whole bodies, so they cannot see a first token arrive early, a mid-stream
disconnect or a shutdown; these tests need real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette

from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Served:
    """A server running in a background thread (see :func:`serving`)."""

    base: str
    port: int
    app: Starlette
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    _stop: asyncio.Event
    failure: list[BaseException]

    @property
    def runtime(self) -> Any:
        return self.app.state.runtime

    def stop(self) -> None:
        """What SIGTERM does to ``ttft-sse serve``: set the shutdown trigger's event (a second call hurries)."""

        def signal() -> None:
            if self._stop.is_set():
                self.runtime.hurry()
            self._stop.set()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped already
            self.loop.call_soon_threadsafe(signal)

    def wait_stopped(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def _start(
    app: Starlette, config: Config, trigger: Any, stop: asyncio.Event, port: int, ready_timeout: float
) -> Served:
    loop = asyncio.new_event_loop()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve(app, config, shutdown_trigger=trigger))  # type: ignore[arg-type]
        except BaseException as exc:
            failure.append(exc)
        finally:
            # What asyncio.run does: cancel what is left (sse-starlette's per-loop shutdown watcher) and close.
            leftover = asyncio.all_tasks(loop)
            for task in leftover:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
            loop.close()

    thread = threading.Thread(target=run, name="test-hypercorn", daemon=True)
    thread.start()
    served = Served(f"http://127.0.0.1:{port}", port, app, loop, thread, stop, failure)
    deadline = time.monotonic() + ready_timeout
    while True:
        if failure:
            raise RuntimeError("server failed to start") from failure[0]
        try:
            ready = httpx.get(f"{served.base}/readyz", timeout=2)
            if ready.status_code == 200:
                return served
            if ready.json()["status"] == "failed":
                raise RuntimeError(f"server failed to start: {ready.json()['reason']}")
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("server did not become ready")
        time.sleep(0.05)


@contextmanager
def running(app: Starlette, *, ready_timeout: float = 120.0) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 until the block ends; yields the base URL once ``/readyz`` says 200.

    No drain: the block's end stops the server with hypercorn's plain 2 s grace. Use :func:`serving` to test
    shutdown.
    """
    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.graceful_timeout = 2
    stop = asyncio.Event()
    served = _start(app, config, stop.wait, stop, port, ready_timeout)
    try:
        yield served.base
    finally:
        with contextlib.suppress(RuntimeError):
            served.loop.call_soon_threadsafe(stop.set)
        served.thread.join(30)


@contextmanager
def serving(app: Starlette, *, ready_timeout: float = 120.0) -> Iterator[Served]:
    """Serve ``app`` exactly as ``ttft-sse serve`` does (its hypercorn settings and its draining shutdown
    trigger), on a free loopback port. ``served.stop()`` is SIGTERM; the block's end stops it if the test did not.
    """
    from ttft_sse.__main__ import hypercorn_config, shutdown_trigger
    from ttft_sse.runtime import shutdown_budget

    port = free_port()
    runtime = app.state.runtime
    config = hypercorn_config(runtime.settings.replace(host="127.0.0.1", port=port))
    stop = asyncio.Event()
    served = _start(app, config, partial(shutdown_trigger, runtime, stop), stop, port, ready_timeout)
    try:
        yield served
    finally:
        served.stop()
        served.thread.join(shutdown_budget(runtime.settings.drain_seconds) + 30)


@dataclass
class SSEEvent:
    event: str
    data: Any
    id: str | None = None
    received: float = field(default_factory=time.perf_counter)


def parse_sse(lines: Iterator[str]) -> Iterator[SSEEvent]:
    """A minimal SSE reader for tests (comments skipped), yielding each event as its blank line arrives."""
    event, data, ident = "message", [], None
    for line in lines:
        if line == "":
            if data:
                text = "\n".join(data)
                try:
                    payload: Any = json.loads(text)
                except json.JSONDecodeError:
                    payload = text
                yield SSEEvent(event, payload, ident)
            event, data, ident = "message", [], None
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
            elif name == "id":
                ident = value


def stream_events(client: httpx.Client, method: str, url: str, **kwargs: Any) -> list[SSEEvent]:
    with client.stream(method, url, **kwargs) as response:
        assert response.status_code == 200, response.read()
        return list(parse_sse(response.iter_lines()))


class StreamReader(threading.Thread):
    """Reads one SSE response in a background thread, so that a test can act while the stream is open.

    ``next()`` returns each event as it arrives; after the last one it returns ``None``. ``status`` and
    ``headers`` are set once the response has started; ``error`` holds a transport error, if any.
    """

    def __init__(self, url: str, *, method: str = "GET", client: httpx.Client | None = None, **kwargs: Any):
        super().__init__(name="test-sse-reader", daemon=True)
        self._client = client or httpx.Client(timeout=httpx.Timeout(120, connect=10))
        self._owns_client = client is None
        self._request = (method, url, kwargs)
        self._events: queue.Queue[SSEEvent | None] = queue.Queue()
        self.started = threading.Event()
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.http_version: str | None = None
        self.body = b""
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        method, url, kwargs = self._request
        try:
            with self._client.stream(method, url, **kwargs) as response:
                self.status, self.headers, self.http_version = (
                    response.status_code,
                    response.headers,
                    response.http_version,
                )
                self.started.set()
                if response.status_code != 200:
                    self.body = response.read()
                    return
                for event in parse_sse(response.iter_lines()):
                    self._events.put(event)
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()
            self._events.put(None)
            if self._owns_client:
                self._client.close()

    def next(self, timeout: float = 60) -> SSEEvent | None:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no SSE event within {timeout} s") from None

    def rest(self, timeout: float = 60) -> list[SSEEvent]:
        """Every event until the stream ends."""
        events = []
        while (event := self.next(timeout)) is not None:
            events.append(event)
        return events


def eventually(check: Callable[[], bool], timeout: float = 30) -> None:
    """Poll ``check`` until it holds (bounded; a condition, not a speed, is what the caller asserts)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def fake_app(engine: FakeEngine, **settings: Any) -> Starlette:
    """An app over the scripted engine, without warm-up (a scripted failure or hold would otherwise hit it)."""
    return create_app(Settings(warmup=False, log_format="console", **settings), engine)


ALICE, BOB = "alice-key-0001", "bob-key-00002"
TWO_KEYS = f"{ALICE}:high,{BOB}"
"""Two API keys (``TTFT_API_KEYS``) for the tests of what one key may do to another's resources."""


def check_streams_belong_to_their_key(create_on: str, read_on: str, client: httpx.Client) -> str:
    """The probe's finding, checked on a server (or two sharing Redis) with :data:`TWO_KEYS` whose engine makes a
    short answer: a stream made with one key is another key's unknown id (404, the same words), needs a credential
    (401), opens with its creator's key or its grant (``?grant=``, in the url the POST answered), and is deleted by
    those alone. Returns the stream's id (for the caller's log checks)."""
    alice, bob = {"Authorization": f"Bearer {ALICE}"}, {"X-API-Key": BOB}
    assert client.post(f"{create_on}/streams", json={"prompt": "hi"}).status_code == 401
    created = client.post(f"{create_on}/streams", json={"prompt": "hi"}, headers=alice)
    assert created.status_code == 201, created.text
    body = created.json()
    stream_id, grant = body["id"], body["grant"]
    assert body["url"] == f"/streams/{stream_id}?grant={grant}" == created.headers["location"]
    assert body["lane"] == "high"
    path = f"{read_on}/streams/{stream_id}"

    def error(response: httpx.Response) -> tuple[int, str, str]:
        error = response.json()["error"]
        return response.status_code, error["code"], error["message"]

    unknown = (404, "stream_not_found", f"no stream {stream_id!r}; create one with POST /streams")
    assert error(client.get(path, headers=bob)) == unknown
    assert error(client.get(path, params={"lastEventId": f"{stream_id}.0"}, headers=bob)) == unknown
    assert error(client.delete(path, headers=bob)) == unknown
    assert client.get(path).status_code == 401
    assert client.delete(path).status_code == 401
    assert error(client.get(path, headers={"X-API-Key": "not-a-key-at-all"}))[:2] == (401, "invalid_api_key")
    expiry, _, signature = grant.partition(".")
    forged = f"{int(expiry) + 1}.{signature}"
    for wrong in (forged, "", "1.x", "x" * 5000):
        assert client.get(path, params={"grant": wrong}).status_code == 401, wrong
    other = client.post(f"{create_on}/streams", json={"prompt": "hi"}, headers=alice).json()
    assert error(client.get(path, params={"grant": other["grant"]}))[:2] == (401, "invalid_grant")
    assert error(client.get(path, params=[("grant", grant), ("grant", grant)]))[:2] == (400, None)
    # The creator's key, or the grant alone (what EventSource sends): the whole answer.
    with client.stream("GET", f"{read_on}{body['url']}") as response:
        assert response.status_code == 200, response.read()
        events = list(parse_sse(response.iter_lines()))
    assert events[-1].event == "done"
    finished = client.get(path, headers={**alice, "Last-Event-ID": events[-1].id})
    assert finished.status_code == 204
    # Deleted with the grant; then gone for its key, and still unknown for the other.
    assert client.delete(f"{read_on}{body['url']}").status_code == 204
    assert error(client.get(path, headers=alice))[:2] == (410, "stream_expired")
    assert error(client.get(path, headers=bob)) == unknown
    client.delete(f"{read_on}{other['url']}")
    return str(stream_id)
