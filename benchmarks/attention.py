"""The batched engine's attention three ways, in one batched engine, alternated: request by request over the KV
cache in place (``TTFT_PAGED_ATTENTION``, the default), one masked SDPA over the step's gathered keys with grouped KV
heads in place (``TTFT_GROUPED_ATTENTION``), and the same with each KV head copied per query head (transformers').

    python benchmarks/attention.py                  # 16 alternations, ~15 minutes on 2 cores
    python benchmarks/attention.py --alternations 4

Two parts, both on CPU, one torch thread:

* one attention call of a layer, µs, for the shapes of a decode step and of a prompt: SDPA with the engine's mask
  (requests side by side, each seeing its own rows), KV heads copied or in place, over keys already gathered;
  and engine/attention.c over the keys scattered in a cache of 8192 rows, read through the index;
* the batched engine with the bundled model, the marks of engine/attention.py switched between runs of the same
  scenarios, the order rotated every alternation. One engine, one model: no second copy of the weights elsewhere
  in memory, and nothing one engine warms for the other (see engine_speed.py's warm-up). Its cache reads in place
  in every mode; without the request-by-request mark, the attention gathers the step's keys first, as the
  library does. Prints the medians: TTFT of a new chat prompt at c=1, TTFT of a prompt behind a long system prompt
  already seen (prefix reuse), and tokens/s of 8 clients at once, greedy and sampled.
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

MODES = ("request by request, in place", "masked, grouped in place", "masked, copied per query head")


def calls(model: Any) -> None:

    import torch
    from transformers.integrations.sdpa_attention import repeat_kv

    def micros(call: Callable[[], Any]) -> float:
        for _ in range(10):
            call()
        began = time.perf_counter()
        for _ in range(200):
            call()
        return (time.perf_counter() - began) / 200 * 1e6

    module = next(m for m in model.modules() if getattr(m, attention.PAGED, None) is not None)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print("| one attention call | masked, heads copied, µs | masked, heads in place, µs | request by request, µs |")
    print("|---|---|---|---|")
    streams = [(1, 80)] * 8  # a decode step: 8 streams, one new row each, 80 tokens of KV
    shapes = [
        ("decode step, 8 streams of 80 tokens", streams),
        ("decode step, 8 streams of 200 tokens", [(1, 200)] * 8),
        ("decode step, 8 streams of 1000 tokens (long conversations)", [(1, 1000)] * 8),
        ("a 37-token prompt beside 7 streams of 80", [(37, 37), *streams[1:]]),
        ("a 37-token prompt alone", [(37, 37)]),
    ]
    for name, requests in shapes:
        q, k, v, m = attention.masked_step(torch, 9, 3, 64, requests)  # SmolLM2's heads
        kv = attention.in_cache(torch, k, v, slots=8192)
        cu_q, cu_k = attention.starts(torch, requests)
        longest = max(r for r, _ in requests)
        copied = micros(lambda: sdpa(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=m))  # noqa: B023
        grouped = micros(lambda: sdpa(q, k, v, attn_mask=m, enable_gqa=True))  # noqa: B023
        paged = micros(lambda: attention.paged_attention(module, q, kv, cu_q, cu_k, longest, 0.125))  # noqa: B023
        print(f"| {name} | {copied:.0f} | {grouped:.0f} | {paged:.0f} |")
    print()


async def engine_runs(engine: BatchedEngine, alternations: int) -> None:
    modules = [m for m in engine.model.modules() if getattr(m, attention.PAGED, None) is not None]
    if not modules or not all(getattr(m, attention.MARK, False) for m in modules):
        raise SystemExit("the engine marked no attention module (see its attention_not_paged or _grouped warning)")
    function = getattr(modules[0], attention.PAGED)
    await clients(engine, [(f"Warm-up {i}: {QUESTIONS[i % len(QUESTIONS)]}", 32) for i in range(16)], 8)
    await one(engine, prompt_of(engine, "Hello", SYSTEM), 2)  # the long system prompt, seen from now on
    figures: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    for k in range(alternations):
        for mode in MODES[k % 3 :] + MODES[: k % 3]:
            for module in modules:
                setattr(module, attention.PAGED, function if mode == MODES[0] else None)
                setattr(module, attention.MARK, mode != MODES[2])
            got = figures[mode]
            for i in range(2):
                question = f"Run {k}.{mode}.{i}: {QUESTIONS[(k + i) % len(QUESTIONS)]}"
                got.setdefault("c=1 TTFT ms", []).append((await one(engine, prompt_of(engine, question), 2))[2] * 1e3)
                seen = prompt_of(engine, question, SYSTEM)
                got.setdefault("reuse TTFT ms", []).append((await one(engine, seen, 2))[2] * 1e3)
            for name, sampled in (("c=8 tok/s", False), ("c=8 sampled tok/s", True)):
                asks = [(f"Run {k}.{mode}.{name}.{i}: {QUESTIONS[i % len(QUESTIONS)]}", 24) for i in range(8)]
                began = time.perf_counter()
                run, _ = await clients(engine, asks, 8, sampled)
                got.setdefault(name, []).append(run.tokens / (time.perf_counter() - began))
        print(f"alternation {k + 1}/{alternations}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for module in modules:
        setattr(module, attention.PAGED, function)
        setattr(module, attention.MARK, True)
    await engine.close()
    names = list(figures[MODES[0]])
    print()
    print(f"| attention | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for mode in MODES:
        print(f"| {mode} | {' | '.join(f'{statistics.median(figures[mode][n]):.1f}' for n in names)} |")
    for mode in MODES[1:]:
        ratios = [statistics.median(figures[MODES[0]][n]) / statistics.median(figures[mode][n]) for n in names]
        print(f"| request by request / {mode} | {' | '.join(f'{r:.2f}' for r in ratios)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alternations", type=int, default=16)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  (cpus: {os.cpu_count()})")
    engine = BatchedEngine(Settings(threads=1, log_level="warning"))
    engine.load(StageClock())
    calls(engine.model)
    asyncio.run(engine_runs(engine, args.alternations))


if __name__ == "__main__":
    main()
