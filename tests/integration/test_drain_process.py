"""SIGTERM to a real ``ttft-sse serve`` process with the real model: 8 streams in flight, every one ends with an
event that says how it ended, readiness is 503 while the process drains, and the process exits 0.

The process uses the converted-model cache that ``make test`` prepares (the default ``TTFT_CACHE_DIR``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.paths import CACHE_DIR
from tests.support.servers import StreamReader, free_port
from ttft_sse.runtime import shutdown_budget

ROOT = Path(__file__).resolve().parents[2]
DRAIN_SECONDS = 3.0
# Raw text the model continues for thousands of tokens, so that a running stream cannot end on its own within the
# grace: 2048 tokens at CPU speed take minutes.
COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "raw": True, "max_tokens": 2048}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTFT_")}
    env.update(
        TTFT_HOST="127.0.0.1",
        TTFT_PORT=str(port),
        TTFT_CACHE_DIR=str(CACHE_DIR),
        TTFT_THREADS="1",
        TTFT_MAX_CONCURRENCY="4",
        TTFT_MAX_QUEUE="8",
        TTFT_DRAIN_SECONDS=str(DRAIN_SECONDS),
        TTFT_LOG_FORMAT="json",
    )
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ttft_sse", "serve"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not ready:\n{log_path.read_text()}"
            time.sleep(0.2)
        yield proc, base, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def log_events(path: Path) -> list[dict[str, object]]:
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a stray non-JSON line (a library's warning)
            events.append(json.loads(line))
    return events


def test_sigterm_drains_eight_streams_then_exits_cleanly(server: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    proc, base, log_path = server
    readers = [StreamReader(f"{base}/stream", method="POST", json=COUNTING) for _ in range(8)]
    firsts = [reader.next(timeout=120) for reader in readers]  # each is generating or queued: all in flight
    kinds = sorted(first.event for first in firsts if first is not None)
    assert kinds == ["queued"] * 4 + ["token"] * 4, kinds

    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    # Readiness turns 503 while the process is still draining, and a newcomer is refused with Retry-After.
    ready_status = None
    while proc.poll() is None and ready_status != 503:
        try:
            ready_status = httpx.get(f"{base}/readyz", timeout=5).status_code
        except httpx.TransportError:
            break
        time.sleep(0.02)
    assert ready_status == 503, "readiness did not turn 503 before the process exited"
    refused = httpx.post(f"{base}/stream", json={"prompt": "hi"}, timeout=5)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "shutdown_error"

    budget = shutdown_budget(DRAIN_SECONDS)
    returncode = proc.wait(timeout=budget + 120)  # bounded generously: this asserts that it exits, not how fast
    exited_after = time.monotonic() - signalled
    assert returncode == 0, log_path.read_text()

    endings: list[str] = []
    for first, reader in zip(firsts, readers, strict=True):
        reader.join(30)
        assert reader.error is None, f"a stream was cut without a final event: {reader.error!r}"
        events = [first, *reader.rest(timeout=5)]
        last = events[-1]
        assert last is not None and last.event in ("done", "error"), [e.event for e in events if e]
        if last.event == "error":
            error = last.data["error"]
            assert error["type"] == "shutdown_error", error
            endings.append(error["code"])
        else:
            endings.append(f"done:{last.data['finish_reason']}")
        if first is not None and first.event == "queued":
            assert last.event == "error" and last.data["error"]["code"] == "draining"  # never silently dropped
    # The running ones cannot have produced 2048 tokens within the grace: they end with the shutdown event.
    assert endings.count("draining") == 4 and endings.count("drain_timeout") >= 1, endings

    logged = log_events(log_path)
    drained = [e for e in logged if e.get("event") == "drained"]
    assert len(drained) == 1 and drained[0]["left_running"] == 0, drained  # every generation thread had ended
    print(f"\nSIGTERM → exit: {exited_after:.1f} s (grace {DRAIN_SECONDS:g} s, budget {budget:g} s); {endings}")
