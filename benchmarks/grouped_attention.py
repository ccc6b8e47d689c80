"""Grouped KV heads in SDPA (``TTFT_GROUPED_ATTENTION``) on and off, in one batched engine, alternated.

    python benchmarks/grouped_attention.py                  # 16 alternations, ~10 minutes on 2 cores
    python benchmarks/grouped_attention.py --alternations 4

Two parts, both on CPU, one torch thread:

* one SDPA call with the engine's mask (requests side by side, each seeing its own rows), KV heads copied for
  every query head (transformers' way) against grouped heads in place: µs a call, for the shapes of a decode step
  and of a prompt;
* the batched engine with the bundled model, the mark of engine/attention.py switched off and on between runs of
  the same scenarios, the order swapped every alternation. One engine, one model: no second copy of the weights
  elsewhere in memory, and nothing one engine warms for the other (see engine_speed.py's warm-up). Prints the
  medians: TTFT of a new chat prompt at c=1, TTFT of a prompt behind a long system prompt already seen (prefix
  reuse), and tokens/s of 8 clients at once, greedy and sampled.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_speed import QUESTIONS, SYSTEM, clients, one, prompt_of
from ttft_sse.engine import attention
from ttft_sse.engine.batched import BatchedEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

MODES = {True: "grouped in place", False: "copied per query head"}


def sdpa_calls() -> None:
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv

    def micros(call: Callable[[], Any]) -> float:
        for _ in range(10):
            call()
        began = time.perf_counter()
        for _ in range(200):
            call()
        return (time.perf_counter() - began) / 200 * 1e6

    sdpa = torch.nn.functional.scaled_dot_product_attention
    print("| one SDPA call | heads copied, µs | heads in place, µs |")
    print("|---|---|---|")
    streams = [(1, 80)] * 8  # a decode step: 8 streams, one new row each, 80 tokens of KV
    shapes = [
        ("decode step, 8 streams of 80 tokens", streams),
        ("decode step, 8 streams of 200 tokens", [(1, 200)] * 8),
        ("a 37-token prompt beside 7 streams of 80", [(37, 37), *streams[1:]]),
        ("a 37-token prompt alone", [(37, 37)]),
    ]
    for name, requests in shapes:
        q, k, v, m = attention.masked_step(torch, 9, 3, 64, requests)  # SmolLM2's heads
        copied = micros(lambda: sdpa(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=m))  # noqa: B023
        grouped = micros(lambda: sdpa(q, k, v, attn_mask=m, enable_gqa=True))  # noqa: B023
        print(f"| {name} | {copied:.0f} | {grouped:.0f} |")
    print()


async def engine_runs(alternations: int) -> None:
    engine = BatchedEngine(Settings(threads=1, log_level="warning"))
    engine.load(StageClock())
    marked = [m for m in engine.model.modules() if getattr(m, attention.MARK, False)]
    if not marked:
        raise SystemExit("the engine grouped no attention module (see its attention_not_grouped warning)")
    await clients(engine, [(f"Warm-up {i}: {QUESTIONS[i % len(QUESTIONS)]}", 32) for i in range(16)], 8)
    await one(engine, prompt_of(engine, "Hello", SYSTEM), 2)  # the long system prompt, seen from now on
    figures: dict[bool, dict[str, list[float]]] = {on: {} for on in MODES}
    for k in range(alternations):
        for on in (True, False) if k % 2 == 0 else (False, True):
            for module in marked:
                setattr(module, attention.MARK, on)
            got = figures[on]
            for i in range(2):
                question = f"Run {k}.{on}.{i}: {QUESTIONS[(k + i) % len(QUESTIONS)]}"
                got.setdefault("c=1 TTFT ms", []).append((await one(engine, prompt_of(engine, question), 2))[2] * 1e3)
                seen = prompt_of(engine, question, SYSTEM)
                got.setdefault("reuse TTFT ms", []).append((await one(engine, seen, 2))[2] * 1e3)
            for name, sampled in (("c=8 tok/s", False), ("c=8 sampled tok/s", True)):
                asks = [(f"Run {k}.{on}.{name}.{i}: {QUESTIONS[i % len(QUESTIONS)]}", 24) for i in range(8)]
                began = time.perf_counter()
                run, _ = await clients(engine, asks, 8, sampled)
                got.setdefault(name, []).append(run.tokens / (time.perf_counter() - began))
        print(f"alternation {k + 1}/{alternations}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for module in marked:
        setattr(module, attention.MARK, True)
    await engine.close()
    names = list(figures[True])
    print()
    print(f"| KV heads | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for on, label in MODES.items():
        print(f"| {label} | {' | '.join(f'{statistics.median(figures[on][n]):.1f}' for n in names)} |")
    ratios = [statistics.median(figures[True][n]) / statistics.median(figures[False][n]) for n in names]
    print(f"| in place / copied | {' | '.join(f'{r:.2f}' for r in ratios)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alternations", type=int, default=16)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  (cpus: {os.cpu_count()})")
    sdpa_calls()
    asyncio.run(engine_runs(args.alternations))


if __name__ == "__main__":
    main()
