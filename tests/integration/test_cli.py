"""`ttft-sse serve` as a user runs it: a real process, the real model, readiness, logs and shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ttft_sse", "serve", *args],
        cwd=ROOT,
        env={**os.environ, "TTFT_LOG_FORMAT": "json", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_serve_reports_ready_only_after_warmup_then_streams_and_exits_on_sigterm() -> None:
    port = free_port()
    proc = serve("--port", str(port), "--threads", "1")
    base = f"http://127.0.0.1:{port}"
    seen: list[tuple[int, str]] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                r = httpx.get(f"{base}/readyz", timeout=5)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                ready = r.json()
                break
            assert httpx.get(f"{base}/healthz").status_code == 200  # alive while loading
            time.sleep(0.02)
        assert seen[-1] == (200, "ready")
        assert (503, "starting") in seen  # it answered, unready, while the model loaded
        assert "warmup_ms" in ready["startup"]
        text = httpx.get(f"{base}/stream", params={"prompt": "What is the capital of France?"}, timeout=60).text
        assert "event: done" in text and '"finish_reason":"stop"' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ready_logs = [e for e in lines if e.get("event") == "ready"]
    assert len(ready_logs) == 1
    assert {"imports_ms", "tokenizer_ms", "model_ms", "warmup_ms", "total_ms"} <= set(ready_logs[0])
    generations = [e for e in lines if e.get("event") == "generation" and e["endpoint"] == "stream"]
    assert len(generations) == 1
    g = generations[0]
    assert (g["outcome"], g["prompt_tokens"], g["completion_tokens"]) == ("ok", 37, 8)
    assert g["ttft_ms"] > 0 and len(g["request_id"]) == 32


def test_a_missing_model_file_exits_non_zero_with_the_reason() -> None:
    proc = serve("--port", str(free_port()), "--model", "/nonexistent/model.gguf")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "model file /nonexistent/model.gguf does not exist" in out


def test_a_bad_setting_exits_2_naming_it() -> None:
    proc = serve(env={"TTFT_PORT": "eighty"})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "TTFT_PORT must be an integer, got 'eighty'" in out


def test_a_port_in_use_exits_1_naming_it_before_loading_the_model() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve("--port", str(port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    # One sentence, and nothing before it: no model was loaded, no traceback.
    assert out == f"ttft-sse: cannot listen on 127.0.0.1:{port}: Address already in use\n"
