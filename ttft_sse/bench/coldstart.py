"""``--cold-start CMD``: start the server N times and time each start, as a user or an autoscaler sees it.

For each start: process start (just before ``exec``) → the readiness endpoint's first 200, the server's own
start-up stage breakdown (the ``startup`` object of ttft-sse's ``/readyz``; absent for servers that have none),
then the TTFT of the first request after ready and of ``steady`` more requests of the same prompt. The process is
stopped with SIGTERM, by its PID, and killed if it has not exited within ``STOP_SECONDS``. Only that process is
signalled: ``CMD`` should exec the server itself (``ttft-sse serve …``, ``llama-server …``), not a shell script
that forks it and returns.

The last start's server can be kept running (``keep_last``) for the load and soak phases of the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from ttft_sse.bench import stats
from ttft_sse.bench.client import Record, Target, send
from ttft_sse.bench.load import discover_model
from ttft_sse.bench.prompts import Prompt
from ttft_sse.bench.protocol import Lengths

POLL_SECONDS = 0.02
STOP_SECONDS = 60.0  # above ttft-sse's default drain (10 s) + cut + flush


class ColdStartError(RuntimeError):
    """A start could not be measured; the message says why (and where the server's output went)."""


@dataclass
class Launched:
    """A server process this benchmark started (and will stop)."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    log: BinaryIO
    url: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = STOP_SECONDS) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code. Safe to call twice."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(30)
            return int(self.proc.returncode)
        finally:
            self.log.close()

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class Trial:
    number: int
    pid: int
    ready_ms: float
    startup: dict[str, Any] | None
    first: Record
    steady: list[Record] = field(default_factory=list)
    exit_code: int | None = None

    def as_dict(self) -> dict[str, Any]:
        steady_ttft = [r.ttft_ms for r in self.steady if r.ok and r.ttft_ms is not None]
        return {
            "number": self.number,
            "pid": self.pid,
            "ready_ms": self.ready_ms,
            "startup": self.startup,
            "first_ttft_ms": self.first.ttft_ms if self.first.ok else None,
            "steady_ttft_ms": stats.percentile(steady_ttft, 50) if steady_ttft else None,
            "first": self.first.as_dict(),
            "steady": [r.as_dict() for r in self.steady],
            "exit_code": self.exit_code,
        }


def summarize(trials: list[Trial]) -> dict[str, Any]:
    rows = [t.as_dict() for t in trials]
    stages: dict[str, list[float]] = {}
    for t in trials:
        for name, value in (t.startup or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                stages.setdefault(name, []).append(float(value))
    return {
        "starts": len(trials),
        "ready_ms": stats.distribution([t.ready_ms for t in trials]),
        "startup_ms_median": {name: stats.percentile(values, 50) for name, values in stages.items()},
        "first_ttft_ms": stats.distribution([r["first_ttft_ms"] for r in rows if r["first_ttft_ms"] is not None]),
        "steady_ttft_ms": stats.distribution([r["steady_ttft_ms"] for r in rows if r["steady_ttft_ms"] is not None]),
        "failed_requests": sum(not r.ok for t in trials for r in (t.first, *t.steady)),
    }


def section(command: str, trials: list[Trial]) -> dict[str, Any]:
    """The ``cold_start`` section of the results document; ``command`` is ``--cold-start`` as given."""
    return {"command": command, "summary": summarize(trials), "trials": [t.as_dict() for t in trials]}


async def answers(url: str, path: str) -> bool:
    """Whether anything answers HTTP at ``url`` (any status)."""
    async with httpx.AsyncClient(timeout=2) as client:
        try:
            await client.get(url.rstrip("/") + path)
        except httpx.HTTPError:
            return False
    return True


async def launch(
    command: str, url: str, *, ready_path: str, log_path: Path, ready_timeout: float
) -> tuple[Launched, float, Any]:
    """Start ``command`` and wait for ``url + ready_path`` to answer 200; returns the process, ms to ready, body."""
    if await answers(url, ready_path):
        raise ColdStartError(
            f"something already answers at {url}; --cold-start starts its own server there: stop the other one first"
        )
    argv = shlex.split(command)
    if not argv:
        raise ColdStartError("--cold-start needs a command")
    log = log_path.open("wb")
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as exc:
        log.close()
        raise ColdStartError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
    launched = Launched(proc, log_path, log, url)
    deadline = started + ready_timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            if proc.poll() is not None:
                launched.stop()
                raise ColdStartError(
                    f"the server exited with code {proc.returncode} before it was ready; its output "
                    f"({log_path}) ends with:\n{launched.tail()}"
                )
            try:
                response = await client.get(url.rstrip("/") + ready_path)
                if response.status_code == 200:
                    ready_ms = round((time.perf_counter() - started) * 1000, 3)
                    try:
                        body: Any = response.json()
                    except ValueError:
                        body = None
                    return launched, ready_ms, body
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                launched.stop()
                raise ColdStartError(
                    f"the server was not ready within {ready_timeout:g} s; its output is in {log_path}"
                )
            await asyncio.sleep(POLL_SECONDS)


async def measure(
    command: str,
    target: Target,
    *,
    starts: int,
    steady: int,
    prompt: Prompt,
    max_tokens: Lengths,
    out_dir: Path,
    epoch: float,
    ready_path: str = "/readyz",
    ready_timeout: float = 300.0,
    request_timeout: float = 300.0,
    keep_last: bool = False,
) -> tuple[list[Trial], Launched | None]:
    """Run ``starts`` cold starts; with ``keep_last`` the last server is left running and returned."""
    trials: list[Trial] = []
    kept: Launched | None = None
    for number in range(1, starts + 1):
        launched, ready_ms, body = await launch(
            command,
            target.url,
            ready_path=ready_path,
            log_path=out_dir / f"cold-start-{number}.log",
            ready_timeout=ready_timeout,
        )
        try:
            startup = body.get("startup") if isinstance(body, dict) else None
            if target.protocol == "openai" and not target.model:  # the server can only be asked once it is up
                target = replace(target, model=await discover_model(target))
            records = []
            async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=10)) as client:
                for i in range(steady + 1):
                    record = Record(target.label, target.protocol, "stream", 1, i, prompt.name, phase="cold_start")
                    await send(
                        client, target, "stream", prompt, max_tokens=max_tokens.at(i), record=record, epoch=epoch
                    )
                    records.append(record)
        except BaseException:
            await asyncio.to_thread(launched.stop)
            raise
        first, *rest = records
        trial = Trial(number, launched.pid, ready_ms, startup if isinstance(startup, dict) else None, first, rest)
        trials.append(trial)
        if keep_last and number == starts:
            kept = launched
        else:
            trial.exit_code = await asyncio.to_thread(launched.stop)
    return trials, kept
