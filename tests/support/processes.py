"""Test helpers for real processes: a private redis-server, ``ttft-sse serve`` and ``ttft-sse worker``.

Every process is started by these helpers with ``sys.executable`` (so it imports this checkout's code) and is
stopped by its own PID (or its own process group, for a Celery worker and its pool): never by name, never a
system instance. Redis runs on a free loopback port with persistence off, in its own temporary directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
# The CLI arguments the suite runs the server and the worker with (deploy/compose.yaml runs the same).
SERVE_ARGS = ("serve",)
WORKER_ARGS = ("worker", "--concurrency", "1")
# How redis-server runs (deploy/compose.yaml too): a store of jobs and streams with expiries, nothing persisted.
REDIS_ARGS = ("--save", "", "--appendonly", "no")
# The settings every server and worker the suite starts runs with (deploy/compose.yaml's too): one torch thread
# each, so that several share a small machine; JSON logs; no prefill process.
SERVICE_ENV = {"TTFT_THREADS": "1", "TTFT_LOG_FORMAT": "json", "TTFT_PREFILL_PROCESS": "false"}


def system_binary(name: str, package: str) -> str:
    """A program from a Debian package that the suite drives (redis-server, nginx, promtool, chromium).

    Missing, the test is skipped on a developer's machine but fails under CI, where ``.ci/run`` installs it.
    """
    found = shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/usr/bin") if os.access(p := os.path.join(d, name), os.X_OK)), None
    )
    if found:
        return found
    missing(f"{name} (apt-get install {package})")
    raise AssertionError("unreachable")


def missing(what: str) -> None:
    """Skip on a developer's machine, fail under CI: there ``.ci/run`` installs what the suite needs."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed; .ci/run installs it")
    pytest.skip(f"{what} is not installed; CI runs these tests")


def redis_or_skip() -> str:
    return system_binary("redis-server", "redis-server")


@contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """A private redis-server on a free loopback port; yields its URL."""
    binary = redis_or_skip()
    port = free_port()
    data = tmp / f"redis-{port}"
    data.mkdir()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", *REDIS_ARGS]
    args += ["--dir", str(data), "--logfile", str(data / "redis.log")]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        client = redis.Redis.from_url(url)
        wait_until(lambda: _pings(client), timeout=20, what="redis-server to answer PING")
        client.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _pings(client: object) -> bool:
    import redis

    try:
        return bool(client.ping())  # type: ignore[attr-defined]
    except redis.ConnectionError:
        return False


def wait_until(check: Callable[[], object], *, timeout: float, what: str, every: float = 0.05) -> object:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def env_for(settings: Mapping[str, str]) -> dict[str, str]:
    """The test process's environment less any TTFT_ setting, plus ``settings``: one thread, quiet, JSON logs, no
    prefill process (unless ``settings`` ask for one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTFT_")}
    env.update(SERVICE_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(settings)
    return env


class Proc:
    """A child process whose output goes to a file (read it with :meth:`log`)."""

    def __init__(self, args: list[str], env: Mapping[str, str], logfile: Path) -> None:
        self.logfile = logfile
        self._out = logfile.open("wb")
        # Its own session: the Celery worker's pool processes share its group, so the group can be ended by id.
        self.popen = subprocess.Popen(
            args, cwd=ROOT, env=dict(env), stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.logfile.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.alive():
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._out.close()


@contextmanager
def serve(tmp: Path, settings: Mapping[str, str], *, name: str = "server") -> Iterator[tuple[str, Proc]]:
    """``ttft-sse serve`` in a subprocess with the real model; yields (base URL, process) once ready."""
    base, proc = start_server(tmp, settings, name=name)
    try:
        wait_server_ready(base, proc, name=name)
        yield base, proc
    finally:
        proc.stop()


def start_server(tmp: Path, settings: Mapping[str, str], *, name: str) -> tuple[str, Proc]:
    """``ttft-sse serve`` on a free port, not waited for (start several, then :func:`wait_server_ready` each)."""
    port = free_port()
    proc = Proc(
        [sys.executable, "-m", "ttft_sse", *SERVE_ARGS, "--port", str(port)],
        env_for(settings),
        tmp / f"{name}-{port}.log",
    )
    return f"http://127.0.0.1:{port}", proc


def wait_server_ready(base: str, proc: Proc, *, name: str, timeout: float = 180) -> None:
    wait_until(lambda: _ready(base, proc), timeout=timeout, what=f"{name} to be ready", every=0.2)


def _ready(base: str, proc: Proc) -> bool:
    if not proc.alive():
        raise AssertionError(f"the server exited early:\n{proc.log()[-3000:]}")
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def start_worker(tmp: Path, settings: Mapping[str, str], *, name: str) -> Proc:
    """``ttft-sse worker`` (a Celery prefork worker, one pool process) in a subprocess."""
    return Proc([sys.executable, "-m", "ttft_sse", *WORKER_ARGS], env_for(settings), tmp / f"{name}.log")


def wait_worker_ready(worker: Proc, *, count: int = 1, timeout: float = 180) -> None:
    """Until ``count`` pool processes of ``worker`` have loaded and warmed the model."""

    def ready() -> bool:
        if not worker.alive():
            raise AssertionError(f"the worker exited early:\n{worker.log()[-3000:]}")
        return worker.log().count('"worker_process_ready"') >= count

    wait_until(ready, timeout=timeout, what="the worker's pool process to load the model", every=0.2)
