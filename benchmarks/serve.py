"""Start ``ttft-sse serve`` for a benchmark script: a free loopback port, the environment given, ready when
``/readyz`` says 200, stopped with SIGTERM (the drain) when the block ends. Imported by the scripts beside it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serving(env: dict[str, str], ready_timeout: float = 300, log: IO[bytes] | None = None) -> Iterator[str]:
    """A server with this process's environment less every ``TTFT_`` variable, plus ``env``; yields its base URL.
    ``log``: a file its output goes to (else this process's)."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("TTFT_")}
    full.update({"TTFT_LOG_LEVEL": "warning", **env})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ttft_sse", "serve", "--port", str(port)],
        cwd=ROOT,
        env=full,
        start_new_session=True,
        stdout=log,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not become ready in {ready_timeout:g} s")
            time.sleep(0.2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
