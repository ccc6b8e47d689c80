"""Overload with first-token targets per lane, against a real server with the real model, one arm at a time.

    python benchmarks/targets.py                          # three arms: lanes only, targets, targets + degrade
    python benchmarks/targets.py --seconds 40 --rate 12   # longer, more arrivals a second
    python benchmarks/targets.py --burst 32,4             # 32 normal and 4 high requests at one instant

Each arm starts ``ttft-sse serve`` itself (keys for three lanes; the arm's TTFT_SLA_MS and TTFT_DEGRADE), warms it,
then sends streamed chat requests at random instants (Poisson, ``--rate`` a second; one in five high, three normal,
one low) for ``--seconds``, each a new question (``benchmarks/chat-questions.txt``) of ``--max-tokens`` at most.
Printed per arm and lane: requests, served, refused (503) and how fast the refusal came, first-token p50 / p99 of
the served ones and how many met the lane's target; then tokens/s over the arm and the share of answers made in the
degraded mode. Loopback only; bounded by ``--seconds``.

``--burst NORMAL,HIGH`` sends that many normal and high requests at the same instant instead (arm ``burst``:
``--burst-targets``, TTFT_DEGRADE=int8, 8 slots), ``--bursts`` times with a pause between, and adds per lane the
requests admitted (200) and then refused with an ``error`` event (``first_token_target``): what a client cannot
retry elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any

import httpx
from serve import ROOT, serving

KEYS = {"high": "bench-high-key-01", "normal": "bench-normal-key-02", "low": "bench-low-key-003"}
TARGETS = "high:300,normal:1500,low:6000"
ARMS = {"lanes": {}, "targets": {"TTFT_SLA_MS": TARGETS}, "degrade": {"TTFT_SLA_MS": TARGETS, "TTFT_DEGRADE": "int8"}}
MIX = ["high", "normal", "normal", "normal", "low"]


def _server(extra: dict[str, str], log: IO[bytes] | None = None) -> AbstractContextManager[str]:
    keys = ",".join(f"{key}:{lane}" for lane, key in KEYS.items())
    return serving({"TTFT_API_KEYS": keys, "TTFT_MAX_QUEUE": "64", **extra}, log=log)


def _server_refusals(log: str) -> list[float]:
    """The ``duration_ms`` of every 503 in a server's access log (JSON lines)."""
    durations = []
    for line in log.splitlines():
        if '"status": 503' in line:
            try:
                durations.append(float(json.loads(line)["duration_ms"]))
            except (ValueError, KeyError):
                continue
    return durations


async def _one(client: httpx.AsyncClient, base: str, lane: str, question: str, max_tokens: int) -> dict[str, Any]:
    sent = time.perf_counter()
    out: dict[str, Any] = {"lane": lane, "status": 0, "ttft": None, "tokens": 0, "degraded": None, "late": None}
    out["server_ttft"] = None
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
    async with client.stream("POST", f"{base}/stream", json=body, headers={"X-API-Key": KEYS[lane]}) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            await response.aread()
            out["refused_after"] = time.perf_counter() - sent
            return out
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:") and event == "token" and out["ttft"] is None:
                out["ttft"] = time.perf_counter() - sent
            elif line.startswith("data:") and event == "error":
                out["late"] = json.loads(line.partition(":")[2]).get("code", "error")
            elif line.startswith("data:") and event == "done":
                done = json.loads(line.partition(":")[2])
                out["tokens"] = done["usage"]["completion_tokens"]
                out["server_ttft"] = done["timings"]["ttft_ms"] / 1000
                out["degraded"] = done.get("degraded")
    return out


async def _arm(base: str, args: argparse.Namespace, questions: list[str]) -> tuple[list[dict[str, Any]], float]:
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=600) as client:
        await _one(client, base, "normal", "Hello!", 8)  # warm the route
        tasks: list[asyncio.Task[dict[str, Any]]] = []
        started = time.perf_counter()
        n = 0
        while time.perf_counter() - started < args.seconds:
            lane = MIX[n % len(MIX)]
            question = f"({n}) {questions[n % len(questions)]}"
            tasks.append(asyncio.create_task(_one(client, base, lane, question, args.max_tokens)))
            n += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - started


async def _burst(base: str, args: argparse.Namespace, questions: list[str]) -> tuple[list[dict[str, Any]], float]:
    """``--bursts`` bursts of ``--burst`` normal and high requests sent at one instant, each to its end."""
    normal, high = (int(n) for n in args.burst.split(","))
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, base, "normal", "Hello!", 8)  # warm the route
        started = time.perf_counter()
        n = 0
        for _ in range(args.bursts):
            lanes = ["normal"] * normal + ["high"] * high
            random.Random(n).shuffle(lanes)
            batch = []
            for lane in lanes:
                batch.append(_one(client, base, lane, f"({n}) {questions[n % len(questions)]}", args.max_tokens))
                n += 1
            results.extend(await asyncio.gather(*batch))
            await asyncio.sleep(1.0)
        return results, time.perf_counter() - started


def _sat_out(base: str) -> str:
    """The rows of lower-lane generations the server's batch left out of steps for the high lane (its /metrics)."""
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("ttft_sse_batch_rows_sat_out_total "):
            return str(int(float(line.split()[1])))
    return "-"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _report(name: str, results: list[dict[str, Any]], seconds: float, spec: str) -> None:
    targets = {lane: float(ms) / 1000 for lane, _, ms in (t.partition(":") for t in spec.split(","))}
    print(f"\n{name}: {len(results)} requests in {seconds:.0f} s; targets {spec} (ms)")
    print(
        "| lane | sent | served | refused at once (503) | refusal p50 / max ms | admitted, then refused "
        "| TTFT p50 ms | TTFT p99 ms | within target | within 1.5x / 2x |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lane in ("high", "normal", "low"):
        mine = [r for r in results if r["lane"] == lane]
        if not mine:
            continue
        served = [r["ttft"] for r in mine if r["status"] == 200 and r["ttft"] is not None]
        refused = [r["refused_after"] for r in mine if r["status"] == 503]
        late = sum(r["status"] == 200 and r["late"] is not None for r in mine)
        target = targets.get(lane, float("inf"))
        within = sum(t <= target for t in served)
        wider = f"{sum(t <= 1.5 * target for t in served)} / {sum(t <= 2 * target for t in served)}"
        p50 = f"{_quantile(served, 0.5) * 1000:.0f}" if served else "-"
        p99 = f"{_quantile(served, 0.99) * 1000:.0f}" if served else "-"
        fast = f"{_quantile(refused, 0.5) * 1000:.0f} / {max(refused) * 1000:.0f}" if refused else "-"
        row = [lane, len(mine), len(served), len(refused), fast, late, p50, p99, f"{within}/{len(served)}", wider]
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    inside = [r for r in results if r["server_ttft"] is not None]
    if inside:
        print(
            "in the server (arrival to first token, `done` timings), p50 / p99 ms: "
            + "; ".join(
                f"{lane} {_quantile(ts, 0.5) * 1000:.0f} / {_quantile(ts, 0.99) * 1000:.0f}"
                for lane in ("high", "normal", "low")
                if (ts := [r["server_ttft"] for r in inside if r["lane"] == lane])
            )
        )
    tokens = sum(r["tokens"] for r in results)
    degraded = [r for r in results if r["status"] == 200 and r["degraded"]]
    served_all = sum(r["status"] == 200 for r in results)
    lanes = ", ".join(
        f"{lane} {sum(r['tokens'] for r in results if r['lane'] == lane) / seconds:.1f}"
        for lane in ("high", "normal", "low")
    )
    print(f"tokens/s {tokens / seconds:.1f} ({lanes}); answers made degraded: {len(degraded)}/{served_all}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which arms, in order (default {','.join(ARMS)})")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=8.0, help="arrivals a second (default 8)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--burst", help="NORMAL,HIGH: requests of each lane sent at one instant (e.g. 32,4)")
    parser.add_argument("--bursts", type=int, default=3, help="how many bursts (default 3)")
    parser.add_argument("--burst-targets", default="high:200,normal:600", help="TTFT_SLA_MS of the burst arm")
    parser.add_argument("--slots", type=int, default=8, help="TTFT_MAX_CONCURRENCY of the burst arm (default 8)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="TTFT_NAME=VALUE", help="another setting of the burst arm"
    )
    args = parser.parse_args()
    questions = [q for q in (ROOT / "benchmarks" / "chat-questions.txt").read_text().splitlines() if q.strip()]
    if args.burst:
        print(f"CPU: {_cpu()}; bursts of {args.burst} (normal,high) on {args.slots} slots, x{args.bursts} {args.set}")
        env = {"TTFT_SLA_MS": args.burst_targets, "TTFT_DEGRADE": "int8", "TTFT_MAX_CONCURRENCY": str(args.slots)}
        env.update(item.split("=", 1) for item in args.set)
        env["TTFT_LOG_LEVEL"] = "info"  # the access log: how long each refusal took in the server
        with tempfile.TemporaryFile() as log, _server(env, log) as base:
            results, seconds = asyncio.run(_burst(base, args, questions))
            sat_out = _sat_out(base)
            log.seek(0)
            refusals = _server_refusals(log.read().decode(errors="replace"))
        _report("burst", results, seconds, args.burst_targets)
        print(f"lower-lane rows left out of a step for the high lane: {sat_out}")
        if refusals:
            print(
                f"in the server (access log, arrival to response): {len(refusals)} refusals, "
                f"p50 {_quantile(refusals, 0.5):.1f} ms, max {max(refusals):.1f} ms"
            )
        return
    print(f"CPU: {_cpu()}; targets {TARGETS} (ms); {args.rate:g} arrivals/s for {args.seconds:g} s")
    for name in args.arms.split(","):
        with _server(ARMS[name]) as base:
            results, seconds = asyncio.run(_arm(base, args, questions))
            sat_out = _sat_out(base)
        _report(name, results, seconds, TARGETS)
        print(f"lower-lane rows left out of a step for the high lane: {sat_out}")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


if __name__ == "__main__":
    main()
