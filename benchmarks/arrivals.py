"""TTFT at a busy batch when requests arrive at random instants, engines alternated in rounds (issue 8).

    python benchmarks/arrivals.py --engines batched:float32:midstep,batched:float32 --rounds 4

``engine_speed.py``'s c=8 scenario is a closed loop: a client sends its next request the instant its last one
ends, which is the end of a step, so a newcomer nearly always arrives while the next step's layers run. Real
clients arrive at any instant. Here 8 clients each send 10 requests (new conversations from
benchmarks/chat-questions.txt, greedy, max_tokens 16-44), each after an exponential pause (mean ``--pause``
seconds) from the end of its last one; the clients start 150 ms apart. Printed per engine: the TTFT of the
requests that arrived while the batch had streams (the first of each client left out), p50 / p90 / p99 / max,
pieces of text a second, and how many first tokens the interludes gave. Engine specs as ``engine_speed.py``'s;
each engine runs once to warm up, then every round runs each engine once, in alternating order.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.engine_speed import load  # noqa: E402
from ttft_sse.bench import prompts  # noqa: E402
from ttft_sse.bench.stats import percentile  # noqa: E402
from ttft_sse.engine.base import ChatMessage, Engine, SamplingParams  # noqa: E402
from ttft_sse.engine.batched import BatchedEngine  # noqa: E402

CLIENTS, REQUESTS = 8, 10


async def scenario(engine: Engine, seed: int, pause: float) -> tuple[list[float], int, float]:
    """TTFTs in ms of the requests that found the batch busy, pieces of text, and seconds taken."""
    questions = [p.messages[-1]["content"] for p in prompts.load(ROOT / "benchmarks" / "chat-questions.txt")]
    rng = random.Random(seed)
    ttfts: list[float] = []
    pieces = 0

    async def client(c: int) -> None:
        nonlocal pieces
        await asyncio.sleep(c * 0.15)
        for i in range(REQUESTS):
            await asyncio.sleep(rng.expovariate(1 / pause))
            ask = f"{rng.choice(questions)} ({seed}-{c}-{i})"
            prompt = engine.prepare(prompt=None, messages=[ChatMessage(role="user", content=ask)], raw=False)
            busy = isinstance(engine, BatchedEngine) and engine.stats().streams > 0
            sent, first = time.perf_counter(), None
            async for _ in engine.stream(prompt, SamplingParams(max_tokens=rng.randint(16, 44), temperature=0)):
                first = first or time.perf_counter() - sent
                pieces += 1
            if busy and i > 0 and first is not None:
                ttfts.append(first * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(CLIENTS)))
    return ttfts, pieces, time.perf_counter() - start


async def bench(args: argparse.Namespace) -> None:
    specs = args.engines.split(",")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    engines = {spec: load(spec, args) for spec in specs}
    ttfts: dict[str, list[float]] = {spec: [] for spec in specs}
    pieces = dict.fromkeys(specs, 0)
    seconds = dict.fromkeys(specs, 0.0)
    for engine in engines.values():
        await scenario(engine, 1000, args.pause)  # warm-up
    for r in range(args.rounds):
        for spec in specs if r % 2 == 0 else specs[::-1]:
            got, n, took = await scenario(engines[spec], r, args.pause)
            ttfts[spec] += got
            pieces[spec] += n
            seconds[spec] += took
        print(f"round {r + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.2f}", flush=True)
    print("| engine | at a busy batch | TTFT p50 / p90 / p99 / max ms | pieces/s | first tokens from interludes |")
    print("|---|---|---|---|---|")
    for spec, engine in engines.items():
        got = ttfts[spec]
        p50, p90, p99 = (percentile(got, q) for q in (50, 90, 99))
        side = engine.stats().interlude_first_tokens if isinstance(engine, BatchedEngine) else 0
        print(
            f"| {spec} | {len(got)} | {p50:.0f} / {p90:.0f} / {p99:.0f} / {max(got):.0f} "
            f"| {pieces[spec] / seconds[spec]:.1f} | {side} |"
        )
    for engine in engines.values():
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="batched:float32:midstep,batched:float32", help="as engine_speed.py's")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.25, help="mean seconds between a client's requests")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--kernel-helpers", type=int, default=-1, help="the block kernel's helper threads")
    parser.add_argument("--concurrency", type=int, default=CLIENTS, help="the batch size (TTFT_MAX_CONCURRENCY)")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
