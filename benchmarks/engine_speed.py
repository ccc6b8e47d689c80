"""Engine speed: the single-request engine against the batched one, in one process, without HTTP.

    python benchmarks/engine_speed.py                       # fp32 single vs batched, 3 rounds
    python benchmarks/engine_speed.py --engines single:bfloat16,batched:bfloat16
    python benchmarks/engine_speed.py --engines batched:float32:masked,batched:float32     # a setting off, then on

Each ``--engines`` entry is ``kind:dtype[:variant[+variant]]``: ``single`` or ``batched``, a torch dtype, and
variants that turn a setting from its default (docs/settings.md):

    int8rows      the block kernel's rows quantised to int8 (TTFT_GGUF_ACTIVATIONS=int8)
    dense         no block kernel: fp32 weights, column-major and pre-packed (TTFT_GGUF_KERNEL off)
    plain         no block kernel and no pre-packed copies: column-major only (TTFT_PACKED_WEIGHTS off too)
    repeat        grouped KV heads copied for every query head, as transformers does (TTFT_GROUPED_ATTENTION off)
    masked        the batched steps' attention as one masked SDPA over the gathered keys (TTFT_PAGED_ATTENTION off)
    noprefill     no prefill process (TTFT_PREFILL_PROCESS off)
    nointerludes  no interludes (TTFT_PREFILL_BETWEEN_LAYERS off)
    unfused       transformers' decoder layers around the block kernel (TTFT_FUSED_LAYERS off)
    degrade       both the fp32 and the int8 rows held (TTFT_DEGRADE=int8), left in the normal mode
    int8mode      the same, switched to the int8 mode after load (Engine.set_mode): it answers as int8rows

The engine leaves the prefill process off while the kernel has helper threads or interludes run: compare
``:noprefill`` under ``--kernel-helpers 0`` with ``:nointerludes``.

Every engine is warmed with the c=8 scenario, then every scenario runs once per engine per round, each round starting
with the next engine, so that a change in the machine's load, and whatever the first engine of a round pays, hits
every engine alike: compare the ratios, and read the load average printed with them. It prints:

* c=1 (one request after another) and c=8 (8 clients, each sending its next request as soon as its previous one has
  ended; answers of different lengths, so that requests come and go while others decode): aggregate generated
  tokens/s and TTFT p50/p99, from the call to the first piece of text. At c=8 the TTFT of the first request of each
  client (all 8 at the same instant: a burst) is reported apart from the rest (steady state);
* prefix reuse at c=1: TTFT of prompts sharing a long system prompt already seen (reuse) against the same prompts
  behind a system prompt seen for the first time (miss), and the 37-token chat prompt sent again;
* the time to the second piece of text (c=1, and c=8 steady state), and how many first tokens came from the prefill
  process or interludes (they race the batch's own steps for them);
* sampled requests (temperature 1, top_p 0.95, no seed: the OpenAI default) at c=8: tokens/s and TTFT;
* whether every greedy text is the same as the single-request engine's for the same prompt: the single engine's with
  the same variants if it ran (``single:float32:dense`` for ``batched:float32:dense``), else ``single:<dtype>``'s
  (``single:<dtype>:int8rows``' only, for int8 rows or the int8 mode: their answers are the int8 model's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttft_sse.engine.base import ChatMessage, Engine, Finished, Piece, Prompt, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

# Questions whose greedy answers run past 32 tokens, so every request generates the same amount.
QUESTIONS = [
    "Write a long story about a dragon who learns to bake bread.",
    "Explain in detail how a steam engine works.",
    "Write a poem about the ocean.",
    "Describe your ideal city in detail.",
    "What is Python?",
    "Explain how photosynthesis works, step by step.",
    "Write a letter to a friend about your summer holidays.",
    "Describe the history of the bicycle.",
]
CHAT = "What is the capital of France?"  # 37 tokens with the chat template
SYSTEM = (
    "You are the assistant of a railway company. You answer questions about timetables, tickets, seat "
    "reservations, luggage, bicycles, pets, accessibility, delays and refunds. Keep every answer short and "
    "friendly. Never invent a train, a platform or a price: when you do not know, say so and point the traveller "
    "to the help desk in the main hall, open from six in the morning to ten at night. Refunds for delays of more "
    "than one hour are a quarter of the fare, and half of it from two hours. Bicycles travel free outside rush "
    "hours on regional trains and need a reservation on long-distance trains. Dogs travel at half fare unless "
    "they fit in a basket. Passengers in wheelchairs can book help up to one day before travelling."
)


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)  # steady state
    burst: list[float] = field(default_factory=list)  # the first request of each client, all at once
    second: list[float] = field(default_factory=list)  # steady state: seconds to the second piece of text

    def add(self, other: Run) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.ttft += other.ttft
        self.burst += other.burst
        self.second += other.second


@dataclass
class Result:
    c1: Run = field(default_factory=Run)
    c8: Run = field(default_factory=Run)
    sampled: Run = field(default_factory=Run)  # c=8, temperature 1, top_p 0.95, no seed (the OpenAI default)
    reuse: list[float] = field(default_factory=list)
    miss: list[float] = field(default_factory=list)
    chat: list[float] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)  # the question asked -> the answer
    mismatches: list[str] = field(default_factory=list)
    checked: int = 0
    side_first: int = 0  # first tokens from the prefill process or interludes (warm-up included)


def prompt_of(engine: Engine, question: str, system: str | None = None) -> Prompt:
    if system is None:
        return engine.prepare(prompt=question, messages=None, raw=False)
    messages = [ChatMessage("system", system), ChatMessage("user", question)]
    return engine.prepare(prompt=None, messages=messages, raw=False)


async def one(engine: Engine, prompt: Prompt, max_tokens: int, sampled: bool = False) -> tuple[str, int, float, float]:
    """Text, completion tokens, seconds to the first piece and to the second (to the end if there is none). Greedy
    unless ``sampled`` (temperature 1, top_p 0.95, no seed: the OpenAI default)."""
    started = time.perf_counter()
    first: float | None = None
    second: float | None = None
    pieces: list[str] = []
    tokens = 0
    params = SamplingParams(max_tokens, temperature=1.0, top_p=0.95) if sampled else SamplingParams(max_tokens)
    async for item in engine.stream(prompt, params):
        if isinstance(item, Piece):
            if first is not None and second is None:
                second = time.perf_counter()
            first = first or time.perf_counter()
            pieces.append(item.text)
        elif isinstance(item, Finished):
            tokens = item.usage.completion_tokens
    ended = time.perf_counter()
    return "".join(pieces), tokens, (first or ended) - started, (second or ended) - started


async def clients(
    engine: Engine, asks: Sequence[tuple[str, int]], c: int, sampled: bool = False
) -> tuple[Run, dict[str, str]]:
    """``c`` clients share ``asks`` (question, max_tokens): each sends its next one when its last one has ended."""
    run = Run()
    texts: dict[str, str] = {}
    queue = list(asks)

    async def client() -> None:
        first = True
        while queue:
            ask, max_tokens = queue.pop(0)
            text, tokens, ttft, second = await one(engine, prompt_of(engine, ask), max_tokens, sampled)
            run.tokens += tokens
            (run.burst if first and c > 1 else run.ttft).append(ttft)
            if not first or c == 1:
                run.second.append(second)
            texts[ask] = text
            first = False

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    run.seconds = time.perf_counter() - began
    return run, texts


def asks(label: str, count: int, tokens: int) -> list[tuple[str, int]]:
    """``count`` new questions, each marked ``label`` and its number, asking for 1/2 to 11/8 of ``tokens`` (the mean
    is ``tokens``), so that at c=8 requests end, and new ones start, at different steps."""
    return [(f"{label}{i}: {QUESTIONS[i % len(QUESTIONS)]}", tokens * (4 + i % 8) // 8) for i in range(count)]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


VARIANTS = ("int8rows", "dense", "plain", "repeat", "masked", "noprefill", "nointerludes", "unfused")
VARIANTS += ("degrade", "int8mode")
"""The variants ``load`` knows (see the module's docstring)."""


def parse(spec: str) -> tuple[str, str, set[str]]:
    """``batched:float32:dense+repeat`` → ``("batched", "float32", {"dense", "repeat"})``."""
    kind, dtype, variant = [*spec.split(":"), "", ""][:3]
    return kind, dtype, set(variant.split("+")) - {""}


def load(spec: str, args: argparse.Namespace) -> Engine:
    kind, dtype, variants = parse(spec)
    if variants - set(VARIANTS):
        raise SystemExit(f"unknown variant in {spec!r} (known: {', '.join(VARIANTS)}, joined by +)")
    settings = Settings(
        engine=kind,
        dtype=dtype or "float32",
        gguf_kernel=not variants & {"dense", "plain"},
        gguf_activations="int8" if "int8rows" in variants else "fp32",
        packed_weights="plain" not in variants,
        grouped_attention="repeat" not in variants,
        paged_attention="masked" not in variants,
        prefill_process="noprefill" not in variants,
        prefill_between_layers="nointerludes" not in variants,
        fused_layers="unfused" not in variants,
        degrade="int8" if variants & {"degrade", "int8mode"} else "off",
        threads=args.threads,
        kernel_helpers=args.kernel_helpers,
        max_concurrency=args.concurrency,
        log_level="warning",
    )
    engine: BatchedEngine | SingleEngine = BatchedEngine(settings) if kind == "batched" else SingleEngine(settings)
    engine.load(StageClock())
    if "int8mode" in variants:
        engine.set_mode("int8")
    return engine


async def bench(args: argparse.Namespace) -> None:
    specs = args.engines.split(",")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  (cpus: {os.cpu_count()})")
    engines = {spec: load(spec, args) for spec in specs}
    for engine in engines.values():  # the batched engines' prefill processes load beside them
        while isinstance(engine, BatchedEngine) and engine.stats().prefill == "loading":
            await asyncio.sleep(0.1)
    results = {spec: Result() for spec in specs}
    # Warm every engine with the c=8 scenario itself, then start each round with the next engine: what a first run
    # pays (oneDNN builds a primitive the first time a kernel meets a row count, and that cache is the process's)
    # would otherwise fall on whichever engine meets a row count first.
    for engine in engines.values():
        await clients(engine, asks("Warm-up ", 16, args.tokens), args.concurrency)
    for round_ in range(args.rounds):
        # Each round starts with the next engine, so that whatever the first one pays falls on each in turn.
        for spec in specs[round_ % len(specs) :] + specs[: round_ % len(specs)]:
            engine, result = engines[spec], results[spec]
            for c, run, count in ((1, result.c1, len(QUESTIONS)), (args.concurrency, result.c8, 3 * args.concurrency)):
                # A new conversation each time: only the chat template's default system prompt is shared (as it
                # is by every chat request), not a whole prompt seen before.
                got, texts = await clients(engine, asks(f"Request {round_}.{c}.", count, args.tokens), c)
                run.add(got)
                result.texts.update(texts)
            # Sampled requests at c=8 (their texts are draws: not compared), lengths varying as above: with one
            # length for all, the first eight would end together and the next eight arrive as a second burst.
            sampled = asks(f"Sampled {round_}.", 16, args.tokens)
            result.sampled.add((await clients(engine, sampled, args.concurrency, sampled=True))[0])
            # Prefix reuse, at c=1. The system prompt is seen once first; a miss puts a new marker in front of
            # the same system prompt, so nothing is shared. A single engine never reuses: both are misses there.
            # Two tokens each, not one: the library registers a prompt's blocks for reuse only if the request is
            # still running after its first step.
            await one(engine, prompt_of(engine, CHAT, SYSTEM), 2)
            for i, question in enumerate(QUESTIONS):
                result.reuse.append((await one(engine, prompt_of(engine, question, SYSTEM), 2))[2])
                fresh = f"[session {round_}-{i}-{time.monotonic_ns()}] {SYSTEM}"
                result.miss.append((await one(engine, prompt_of(engine, question, fresh), 2))[2])
                result.chat.append((await one(engine, prompt_of(engine, CHAT), 2))[2])
        print(f"round {round_ + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.2f}", flush=True)
    # Greedy check: every engine's text against the single engine's with the same variants if one ran, else
    # single:<dtype>'s (single:<dtype>:int8rows' for int8 rows: they answer differently) for the same prompt.
    for spec, result in results.items():
        _, dtype, variants = parse(spec)
        same = results.get(f"single:{dtype}:{'+'.join(sorted(variants))}")
        # It answers differently: only its own single engine compares (the int8 mode answers as int8 rows do).
        others = {"int8rows" if v == "int8mode" else v for v in variants & {"int8rows", "int8mode"}}
        reference = same or results.get(f"single:{dtype}:{'+'.join(sorted(others))}" if others else f"single:{dtype}")
        if reference is None or reference is result:
            continue
        for ask, text in result.texts.items():
            result.checked += 1
            want = reference.texts.get(ask)
            if text != want:
                result.mismatches.append(f"{spec} {ask!r}: {text!r} != {want!r}")
    for spec, engine in engines.items():
        if isinstance(engine, BatchedEngine):
            stats = engine.stats()
            results[spec].side_first = stats.side_first_tokens + stats.interlude_first_tokens
    report(results, args)
    for engine in engines.values():
        await engine.close()


def report(results: dict[str, Result], args: argparse.Namespace) -> None:
    c = args.concurrency
    print()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{args.rounds} rounds; per round {len(QUESTIONS)} requests at c=1, {3 * c} at c={c}; "
        f"max_tokens {args.tokens // 2}..{args.tokens * 11 // 8} (mean {args.tokens}); threads={args.threads}; "
        f"kernel helpers={args.kernel_helpers}"
    )
    print()
    print(
        f"| engine | c=1 tok/s | c=1 TTFT p50 / p99 ms | c={c} tok/s | c={c} TTFT p50 / p99 ms | c={c} burst "
        f"TTFT p50 / p99 ms | c={c}/c=1 tok/s | c={c} TTFT p99 / c=1 p50 (burst) |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def ms(values: list[float]) -> str:
        return f"{pct(values, 0.5) * 1000:.0f} / {pct(values, 0.99) * 1000:.0f}"

    for spec, r in results.items():
        rate1, rate8 = r.c1.tokens / r.c1.seconds, r.c8.tokens / r.c8.seconds
        p50 = pct(r.c1.ttft, 0.5)
        print(
            f"| {spec} | {rate1:.1f} | {ms(r.c1.ttft)} | {rate8:.1f} | {ms(r.c8.ttft)} | {ms(r.c8.burst)} "
            f"| {rate8 / rate1:.2f}x | {pct(r.c8.ttft, 0.99) / p50:.2f}x ({pct(r.c8.burst, 0.99) / p50:.2f}x) |"
        )
    print()
    print(
        f"| engine | c=1 / c={c} (steady) time to the 2nd piece p50 / p99 ms "
        "| first tokens from the prefill process or interludes |"
    )
    print("|---|---|---|")
    for spec, r in results.items():
        print(f"| {spec} | {ms(r.c1.second)} / {ms(r.c8.second)} | {r.side_first} |")
    print()
    print(f"| engine | sampled at c={c}: tok/s | TTFT p50 / p99 ms (steady) |")
    print("|---|---|---|")
    for spec, r in results.items():
        print(f"| {spec} | {r.sampled.tokens / r.sampled.seconds:.1f} | {ms(r.sampled.ttft)} |")
    print()
    print("| engine | long system prompt: reuse / miss TTFT p50 ms | reuse/miss | chat prompt again: p50 ms |")
    print("|---|---|---|---|")
    for spec, r in results.items():
        reuse, miss, chat = (statistics.median(x) * 1000 for x in (r.reuse, r.miss, r.chat))
        print(f"| {spec} | {reuse:.0f} / {miss:.0f} | {reuse / miss:.2f} | {chat:.0f} |")
    print()
    for spec, r in results.items():
        if r.checked or r.mismatches:
            verdict = "same greedy text" if not r.mismatches else "DIFFERENT greedy text"
            print(f"{spec}: {verdict} as the single engine in {r.checked - len(r.mismatches)}/{r.checked} requests")
            for line in r.mismatches[:5]:
                print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--engines",
        default="single:float32,batched:float32",
        help=f"kind:dtype[:variant[+variant]] ({', '.join(VARIANTS)}), comma-separated",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="mean max_tokens of the requests")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--kernel-helpers",
        type=int,
        default=-1,
        help="the block kernel's helper threads (TTFT_KERNEL_HELPERS; -1: the default). They are the process's: the "
        "first engine that starts them shares them with every engine of the run, so compare helpers across runs",
    )
    args = parser.parse_args()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
