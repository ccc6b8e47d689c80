"""Running streams' largest token gap while a 1,100-token prompt is computed beside them, as a ``/prefill`` or as a
request: docs/performance.md's "The first token while the user types".

    python benchmarks/prefill_gaps.py [--rounds 4] [--streams 3]

starts ``ttft-sse serve`` (its defaults, the bundled model), then, each round, opens ``--streams`` streams of a long
answer (``max_tokens`` 320) and, once each has its eighth token, computes a new conversation (a 1,100-token system
prompt and a question) beside them in one of three ways, taking turns: nothing (the streams alone), ``POST
/prefill``, or ``POST /stream`` (``max_tokens`` 1). For each stream it takes the largest gap between two tokens from
that moment to the stream's end, and prints each arm's median and largest such gap over the rounds, with the
conversation's own time (the request's TTFT; a prefill answers 202 at once, and its computation ends at the server's
``prefill`` log line, which is read back to check that it ended before its round's streams did).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from serve import serving
from typing_prompts import system_prompt

from ttft_sse.engine.loading.sources import bundled_gguf, model_dir
from ttft_sse.settings import Settings

STORY = "Write a long story about a dragon who learns to bake bread, with many small events."
ARMS = ("alone", "prefill", "request")


async def tokens(client: httpx.AsyncClient, body: dict[str, Any], times: list[float]) -> dict[str, Any]:
    """Stream ``body`` from /stream, appending each token's arrival time; the ``done`` event's data."""
    event, done = "", {}
    async with client.stream("POST", "/stream", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "token":
                times.append(time.perf_counter())
            elif line.startswith("data:") and event == "done":
                done = json.loads(line[5:])
    return done


async def one_round(
    client: httpx.AsyncClient, arm: str, conversation: dict[str, Any], streams: int, n: int
) -> tuple[list[float], float]:
    """Each stream's largest gap after the conversation began (ms), and the conversation's own time (ms): the
    request's TTFT, the prefill's 202."""
    times: list[list[float]] = [[] for _ in range(streams)]
    running = [
        asyncio.create_task(tokens(client, {"prompt": f"{STORY} ({n}-{i})", "max_tokens": 320}, times[i]))
        for i in range(streams)
    ]
    while min(len(t) for t in times) < 8:
        await asyncio.sleep(0.005)
    began = time.perf_counter()
    own = 0.0
    if arm == "prefill":
        reply = await client.post("/prefill", json=conversation, headers={"X-Prefill-Session": f"gaps-{n}"})
        reply.raise_for_status()
        own = (time.perf_counter() - began) * 1000
    elif arm == "request":
        first: list[float] = []
        await tokens(client, {**conversation, "max_tokens": 1}, first)
        own = (first[0] - began) * 1000
    await asyncio.gather(*running)
    gaps = []
    for t in times:
        after = [b - a for a, b in itertools.pairwise(t) if b > began]
        gaps.append(max(after) * 1000 if after else 0.0)
    return gaps, own


def prefill_ends(log: Path) -> list[float]:
    """When each prefill the server logged as done (``prefill``, outcome ok) ended, in order (Unix seconds)."""
    ends = []
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "prefill" and record.get("outcome") == "ok":
            ends.append(datetime.fromisoformat(record["timestamp"]).timestamp())
    return ends


Results = dict[str, tuple[list[float], list[float], list[float]]]
"""Each arm's streams' largest gaps (ms), its conversations' own times (ms), and when its rounds' streams ended."""


async def run(base: str, rounds: int, streams: int, system: list[str]) -> Results:
    results: Results = {arm: ([], [], []) for arm in ARMS}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await client.get("/readyz")
        n = 0
        for _ in range(rounds):
            for arm in ARMS:
                conversation = {
                    "messages": [
                        {"role": "system", "content": system[n]},
                        {"role": "user", "content": "What should a visitor see first in this town?"},
                    ]
                }
                gaps, own = await one_round(client, arm, conversation, streams, n)
                results[arm][0].extend(gaps)
                results[arm][1].append(own)
                results[arm][2].append(time.time())
                n += 1
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=3)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(model_dir(bundled_gguf(), Settings.from_env().cache_dir) / "tokenizer.json"))
    system = [system_prompt(7000 + n, tokenizer) for n in range(args.rounds * len(ARMS))]
    log = Path(tempfile.mkdtemp(prefix="prefill-gaps-")) / "server.log"
    with log.open("wb") as out, serving({"TTFT_LOG_FORMAT": "json", "TTFT_LOG_LEVEL": "info"}, log=out) as base:
        results = asyncio.run(run(base, args.rounds, args.streams, system))
    ends = prefill_ends(log)
    within = sum(done < ended for done, ended in zip(ends, results["prefill"][2], strict=False))
    print(f"{args.streams} streams, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}; server log {log}")
    for arm, (gaps, own, _) in results.items():
        print(
            f"{arm:8} largest gap per stream: median {statistics.median(gaps):.0f} ms, max {max(gaps):.0f} ms; "
            f"the conversation's own time (TTFT or 202): median {statistics.median(own):.0f} ms"
        )
    print(f"prefills that ended while their round's streams ran: {within} of {len(ends)} logged, {args.rounds} sent")


if __name__ == "__main__":
    main()
