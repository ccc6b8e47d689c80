"""Time to first token per priority lane, under saturation, against a real server with the real model.

    python benchmarks/lanes.py                       # starts `ttft-sse serve` itself (1 slot, keys for 2 lanes)
    python benchmarks/lanes.py --base http://127.0.0.1:8000 --high-key K1 --normal-key K2

Requests arrive faster than the server's slots can serve them (two normal to one high, one every --gap
seconds), so a queue builds; each one's TTFT is measured on the client, from sending the request to reading
its first ``token`` event. The high lane should wait only for the generation in progress; the normal lane
waits behind everything that arrived before it plus every high request that arrives while it waits.
Loopback only; the run is bounded by the number of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from serve import serving

HIGH_KEY, NORMAL_KEY = "bench-high-key-01", "bench-normal-key-02"
PROMPT = "Name three colours of the rainbow."


@contextmanager
def _server(concurrency: int) -> Iterator[str]:
    with serving(
        {
            "TTFT_API_KEYS": f"{HIGH_KEY}:high,{NORMAL_KEY}:normal",
            "TTFT_MAX_CONCURRENCY": str(concurrency),
            "TTFT_MAX_QUEUE": "256",
            "TTFT_QUEUE_TIMEOUT_SECONDS": "600",
            "TTFT_THREADS": os.environ.get("TTFT_THREADS", "1"),
        }
    ) as base:
        yield base


async def _one(client: httpx.AsyncClient, base: str, lane: str, key: str, max_tokens: int) -> dict[str, Any]:
    sent = time.perf_counter()
    first: float | None = None
    positions: list[int] = []
    body = {"prompt": PROMPT, "max_tokens": max_tokens}
    async with client.stream("POST", f"{base}/stream", json=body, headers={"X-API-Key": key}) as response:
        response.raise_for_status()
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:") and event == "token" and first is None:
                first = time.perf_counter()
            elif line.startswith("data:") and event == "queued":
                positions.append(int(line.split('"position":')[1].rstrip("}")))
    return {"lane": lane, "ttft": (first or time.perf_counter()) - sent, "positions": positions}


async def _run(base: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    lanes = [("normal", args.normal_key), ("normal", args.normal_key), ("high", args.high_key)]
    plan = [lanes[i % 3] for i in range(args.requests)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for lane, key in plan:
            tasks.append(asyncio.create_task(_one(client, base, lane, key, args.max_tokens)))
            await asyncio.sleep(args.gap)
        return list(await asyncio.gather(*tasks))


def _report(results: list[dict[str, Any]]) -> None:
    print(f"{'lane':<8}{'n':>4}{'median s':>11}{'p90 s':>9}{'max s':>9}{'mean s':>9}  worst queue position seen")
    for lane in ("high", "normal"):
        ttfts = sorted(r["ttft"] for r in results if r["lane"] == lane)
        worst = max((max(r["positions"], default=0) for r in results if r["lane"] == lane), default=0)
        p90 = ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))]
        print(
            f"{lane:<8}{len(ttfts):>4}{statistics.median(ttfts):>11.2f}{p90:>9.2f}{ttfts[-1]:>9.2f}"
            f"{statistics.fmean(ttfts):>9.2f}  {worst}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a running server (default: start one with 1 generation slot)")
    parser.add_argument("--high-key", default=HIGH_KEY)
    parser.add_argument("--normal-key", default=NORMAL_KEY)
    parser.add_argument("--requests", type=int, default=15, help="how many, two normal to one high (default 15)")
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between arrivals (default 0.2)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1, help="slots of the server this script starts")
    args = parser.parse_args()
    if args.base:
        results = asyncio.run(_run(args.base, args))
    else:
        with _server(args.concurrency) as base:
            results = asyncio.run(_run(base, args))
    _report(results)


if __name__ == "__main__":
    main()
