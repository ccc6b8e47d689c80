"""What c=8 / c=1 is made of: the batched engine's steps timed by their rows, and what 4x would ask of a row (issue 8).

    python benchmarks/step_costs.py                  # 20 s at c=1, then 20 s at c=8, answers of 16-44 tokens
    python benchmarks/step_costs.py --seconds 40 --tokens 64

Engine level (no HTTP), the defaults (``Settings()`` with ``threads=1``), a closed loop: each client sends its next
question as soon as its last answer has ended (engine_speed.py's ``asks``: its questions, each one new, and its
answer lengths). Every step of the library's batching loop is timed (start to start, less the interludes in it:
its forward pass, pick, bookkeeping and the next step's preparation) with its row count, and every interlude (a
newcomer's first token computed between two steps or two layers: engine/interlude.py). Prints:

* tokens/s at c=1 and c=8, and their ratio;
* the step's period by rows (medians), and a least-squares line ``a + b * rows`` over the decode steps of 1 to 8
  rows: ``a`` is what a step costs whatever it holds, ``b`` what each row adds;
* where c=8's time went: steps, interludes, the rest (the loop waiting, the event loop);
* the row cost ``b'`` at which c=8 / c=1 would reach 4x, all else as measured. A faster row speeds both sides (c=1
  steps hold a row too, and its prompts' rows), so ``b'`` solves ``(tokens8 / T8(b')) / (tokens1 / T1(b')) = 4``
  with ``T(b') = T + rows * (b' - b)``, where an interlude's rows are its time past ``a`` over ``b``;
* the multiply-adds a row takes in the linear layers and the output layer (from the model's config), and the rate
  that ``b'`` would ask of them if nothing else in a row cost anything: compare it with the machine's fp32
  multiply-add rate (docs/benchmarks.md: 65-70 GMAC/s a core on the AVX-512 machines of these runs).

Shared machines vary from run to run: the rows' costs and the ratio come from the same run, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_speed import asks, prompt_of
from ttft_sse.engine import interlude
from ttft_sse.engine.base import Piece, SamplingParams
from ttft_sse.engine.batched import BatchedEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock


@dataclass
class Clock:
    """Each step's start and rows, and each interlude's start and seconds, while ``on``."""

    on: bool = False
    steps: list[tuple[float, int]] = field(default_factory=list)
    interludes: list[tuple[float, float]] = field(default_factory=list)

    def clear(self) -> None:
        self.steps.clear()
        self.interludes.clear()


def instrument(clock: Clock) -> None:
    """Times the library's steps (its runner's forward, pick and processing, whose input ids give the rows) and
    the engine's interludes."""
    from transformers.generation.continuous_batching import model_runner

    forward: Callable[..., Any] = model_runner.ModelRunner._forward_process_and_sample

    def timed_forward(self: Any, model: Any, batch_data: dict[str, Any], *args: Any) -> Any:
        if clock.on:
            clock.steps.append((time.perf_counter(), int(batch_data["input_ids"].shape[-1])))
        return forward(self, model, batch_data, *args)

    compute: Callable[..., Any] = interlude.Interlude._compute

    def timed_compute(self: Any, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return compute(self, *args)
        finally:
            if clock.on:  # one that ends in the window
                clock.interludes.append((started, time.perf_counter() - started))

    setattr(model_runner.ModelRunner, "_forward_process_and_sample", timed_forward)  # noqa: B010
    setattr(interlude.Interlude, "_compute", timed_compute)  # noqa: B010


@dataclass
class Window:
    concurrency: int
    seconds: float
    tokens: int
    periods: dict[int, list[float]]  # rows -> each step's period (s): to the next step's start, less interludes
    interludes: list[float]  # seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_seconds(self) -> float:
        return sum(sum(p) for p in self.periods.values())

    @property
    def step_rows(self) -> int:
        return sum(rows * len(p) for rows, p in self.periods.items())

    @property
    def step_count(self) -> int:
        return sum(len(p) for p in self.periods.values())


async def window(engine: BatchedEngine, clock: Clock, c: int, seconds: float, tokens: int, warm: float) -> Window:
    """``c`` clients in a closed loop: ``warm`` seconds, then ``seconds`` timed (the tokens and steps in them
    counted), then each client's answer in flight finished, untimed."""
    stop = False
    count = 0
    questions = iter(asks(f"c{c}-", 100_000, tokens))  # each new; more than a window asks
    span = [0.0, 0.0]

    async def client() -> None:
        nonlocal count
        while not stop:
            question, max_tokens = next(questions)
            async for out in engine.stream(prompt_of(engine, question), SamplingParams(max_tokens)):
                if isinstance(out, Piece) and clock.on:
                    count += 1

    async def timer() -> None:
        nonlocal stop
        await asyncio.sleep(warm)
        clock.clear()
        clock.on = True
        span[0] = time.perf_counter()
        await asyncio.sleep(seconds)
        clock.on = False
        span[1] = time.perf_counter()
        stop = True

    await asyncio.gather(timer(), *(client() for _ in range(c)))
    # A step's period runs to the next step's start (the last step's is left out), less the interludes in it:
    # between two of its layers, or between it and the next step.
    periods: dict[int, list[float]] = defaultdict(list)
    for (start, rows), (following, _) in itertools.pairwise(clock.steps):
        inside = sum(length for at, length in clock.interludes if start <= at < following)
        periods[rows].append(following - start - inside)
    return Window(c, span[1] - span[0], count, dict(periods), [length for _, length in clock.interludes])


def line(windows: list[Window], most: int) -> tuple[float, float]:
    """Least squares ``a + b * rows`` over every step of 1 to ``most`` rows (each step's period a point)."""
    points = [(rows, p) for w in windows for rows, ps in w.periods.items() if 1 <= rows <= most for p in ps]
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - b * mean_x, b


def rows_of(w: Window, a: float, b: float) -> float:
    """The rows ``w`` computed: its steps', and its interludes' (their time past ``a``, over ``b``)."""
    return w.step_rows + sum(max(0.0, t - a) / b for t in w.interludes)


def row_cost_for(ratio: float, one: Window, eight: Window, a: float, b: float) -> float:
    """The row cost at which eight.rate / one.rate would be ``ratio``, every other cost as measured."""
    r1, r8 = rows_of(one, a, b), rows_of(eight, a, b)
    # tokens8 / (T8 + r8 d) = ratio * tokens1 / (T1 + r1 d)  =>  d = (tokens8 T1 - ratio tokens1 T8)
    #                                                                / (ratio tokens1 r8 - tokens8 r1)
    t1, t8 = one.seconds, eight.seconds
    d = (eight.tokens * t1 - ratio * one.tokens * t8) / (ratio * one.tokens * r8 - eight.tokens * r1)
    return b + d


def multiply_adds(config: Any) -> int:
    """A row's multiply-adds in the decoder layers' linear layers and the output layer of a model of ``config``
    (a Llama-like transformers config)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inner = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inner
    return int(config.num_hidden_layers * layer + hidden * config.vocab_size)


def report(one: Window, eight: Window, macs: int) -> None:
    a, b = line([one, eight], 8)
    ms = 1000.0
    print(f"c=1 {one.rate:.1f} tok/s, c=8 {eight.rate:.1f} tok/s: c=8 / c=1 {eight.rate / one.rate:.2f}x")
    print()
    print("| rows of a step | steps at c=1 | steps at c=8 | period p50 ms |")
    print("|---|---|---|---|")
    for rows in sorted(set(one.periods) | set(eight.periods)):
        both = one.periods.get(rows, []) + eight.periods.get(rows, [])
        if len(both) >= 5:
            n1, n8 = len(one.periods.get(rows, [])), len(eight.periods.get(rows, []))
            print(f"| {rows} | {n1} | {n8} | {statistics.median(both) * ms:.1f} |")
    print()
    print(f"decode steps of 1-8 rows: a step costs {a * ms:.2f} ms + {b * ms:.2f} ms a row")
    for w in (one, eight):
        rest = w.seconds - w.step_seconds - sum(w.interludes)
        inter = f"{len(w.interludes)} interludes {sum(w.interludes):.2f} s" if w.interludes else "no interludes"
        print(
            f"c={w.concurrency}: {w.seconds:.1f} s: {w.step_count} steps {w.step_seconds:.2f} s "
            f"({w.step_rows} rows), {inter}, the rest {rest:.2f} s; rows computed ~{rows_of(w, a, b):.0f}"
        )
    need = row_cost_for(4.0, one, eight, a, b)
    print()
    if need <= 0:
        print("c=8 / c=1 = 4x needs no row to cost anything: the steps' fixed cost alone holds the ratio under 4x")
        return
    print(
        f"c=8 / c=1 = 4x, every other cost as measured, needs a row to cost {need * ms:.2f} ms "
        f"({need / b:.2f}x today's {b * ms:.2f})"
    )
    print(
        f"a row's linear and output layers: {macs / 1e6:.1f} M multiply-adds; at {need * ms:.2f} ms a row, with "
        f"nothing else in a row costing anything, {macs / need / 1e9:.0f} GMAC/s (today: "
        f"{macs / b / 1e9:.0f} GMAC/s for the whole row)"
    )
    if eight.interludes:
        # Their rows in the batch's steps instead (TTFT_PREFILL_BETWEEN_LAYERS=false): each interlude's fixed cost
        # saved, and nothing else (the newcomers' first tokens wait for the step in flight then).
        merged = Window(
            eight.concurrency,
            eight.seconds - a * len(eight.interludes),
            eight.tokens,
            eight.periods,
            [t - a for t in eight.interludes],
        )
        need = row_cost_for(4.0, one, merged, 0.0, b)
        print(
            f"without the interludes' own fixed cost ({a * len(eight.interludes):.2f} s of c=8's): c=8 / c=1 "
            f"{merged.rate / one.rate:.2f}x; 4x needs a row to cost {need * ms:.2f} ms ({macs / need / 1e9:.0f} "
            "GMAC/s for the linear and output layers alone)"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds at each concurrency")
    parser.add_argument("--warm", type=float, default=5.0, help="untimed seconds first, at each concurrency")
    parser.add_argument("--tokens", type=int, default=32, help="mean max_tokens (from 1/2 to 11/8 of it)")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  (cpus: {os.cpu_count()})")
    clock = Clock()
    instrument(clock)
    engine = BatchedEngine(Settings(threads=1, log_level="warning"))
    engine.load(StageClock())
    try:
        one = await window(engine, clock, 1, args.seconds, args.tokens, args.warm)
        eight = await window(engine, clock, 8, args.seconds, args.tokens, args.warm)
    finally:
        await engine.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"answers of {args.tokens // 2}..{args.tokens * 11 // 8} tokens, {args.seconds:.0f} s a side")
    print()
    report(one, eight, multiply_adds(engine.model.config))


if __name__ == "__main__":
    asyncio.run(main())
