"""Test helpers: run an app under a real hypercorn server on a loopback port, in a background thread.

In-process ASGI clients buffer whole bodies, so they cannot see a first token arrive early, a mid-stream
disconnect or a shutdown; these tests need real sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def running(app: Starlette, *, ready_timeout: float = 120.0) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 until the block ends; yields the base URL once ``/readyz`` says 200."""
    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.graceful_timeout = 2
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
        except BaseException as exc:
            failure.append(exc)
        finally:  # end what the server left behind (sse-starlette's shutdown watcher) before the loop goes
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    thread = threading.Thread(target=run, name="test-hypercorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while True:
        if failure:
            raise RuntimeError("server failed to start") from failure[0]
        try:
            ready = httpx.get(f"{base}/readyz", timeout=2)
            if ready.status_code == 200:
                break
            if ready.json()["status"] == "failed":
                raise RuntimeError(f"server failed to start: {ready.json()['reason']}")
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("server did not become ready")
        time.sleep(0.05)
    try:
        yield base
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


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
