"""Cold start: process start to ready, stage by stage, and the first request's time to first token.

    python benchmarks/startup.py               # five starts of the bundled model, one at a time
    python benchmarks/startup.py --runs 9 --env TTFT_ENGINE=single

Each run starts ``python -m ttft_sse serve`` on a free loopback port, polls ``/readyz`` every 10 ms from the moment
the process is started, and notes the wall time to the first answer (the port bound) and to the first 200 (ready),
with the stages ``/readyz`` reports and the CPU seconds the process used by then (``ready_cpu_s``: on shared
cores the wall times grow with the load, the CPU seconds hardly). Then it sends one streamed chat request and notes
its time to the first token event, and stops the server with SIGTERM. ``--root`` starts another checkout's server
(the same figures for a comparison). Printed: each run, then the median of each figure over the runs.
Run ``ttft-sse prepare`` first, so that no run pays the one-off conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from serve import ROOT, free_port

POLL_SECONDS = 0.010
QUESTION = "What is the capital of France?"


def _first_token(client: httpx.Client, base: str) -> float:
    """Seconds from sending a streamed chat request to its first ``token`` event."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8}
    sent = time.perf_counter()
    with client.stream("POST", f"{base}/stream", json=body) as response:
        response.raise_for_status()
        seen = None
        for line in response.iter_lines():  # read to the end: the generation finishes before the stop
            if line == "event: token" and seen is None:
                seen = time.perf_counter() - sent
    if seen is None:
        raise SystemExit("the stream ended without a token")
    return seen


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process has used so far (Linux): a figure that, unlike wall time, barely
    moves when other work shares the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(env: dict[str, str], timeout: float, root: Path) -> dict[str, Any]:
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("TTFT_")}
    full.update(TTFT_LOG_LEVEL="warning", **env)
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ttft_sse", "serve", "--port", str(port)],
        cwd=root,
        env=full,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    out: dict[str, Any] = {}
    try:
        with httpx.Client(timeout=5) as client:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode}")
                try:
                    answer = client.get(f"{base}/readyz")
                except httpx.TransportError:
                    answer = None
                now = time.perf_counter() - started
                if answer is not None:
                    out.setdefault("bound_s", now)
                    if answer.status_code == 200:
                        out["ready_s"] = now
                        out["ready_cpu_s"] = _cpu_seconds(proc.pid)
                        stages = answer.json()["startup"].items()
                        out.update({k.removesuffix("_ms") + "_s": v / 1000 for k, v in stages})
                        break
                if now > timeout:
                    raise SystemExit(f"the server was not ready in {timeout:g} s")
                time.sleep(POLL_SECONDS)
            out["first_ttft_s"] = _first_token(client, base)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server (repeatable)")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose ttft_sse is started")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    runs = []
    for i in range(args.runs):
        figures = run_once(env, args.timeout, args.root)
        runs.append(figures)
        print(f"run {i + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    names = list(dict.fromkeys(k for run in runs for k in run))
    print(f"median of {len(runs)} runs (seconds):")
    for name in names:
        values = [run[name] for run in runs if name in run]
        print(f"  {name:<18} {statistics.median(values):7.3f}   (min {min(values):.3f}, max {max(values):.3f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)


if __name__ == "__main__":
    main()
