"""Decoder layers in C against transformers' layers, for each family the C layers compute.

    python benchmarks/families.py                              # hidden 512, 8 layers, Q8_0, 3 rounds
    python benchmarks/families.py --families gemma3 --hidden 1024 --layers 12
    python benchmarks/families.py --concurrency 4          # the batched engine, 4 requests at once
    python benchmarks/families.py --kind F16 --against transformers   # an F16 file, against transformers alone

For each family a random-weight model is written as a GGUF (tests/support/tinymodels.py: Q8_0 linear layers, a
character vocabulary) into a temporary directory, and the single engine loads it twice: with the decoder layers in C
(the default) and with transformers' layers around the same block kernel (``TTFT_FUSED_LAYERS=false``). Each round
runs the same greedy requests one after another on each engine in turn (the first engine of a round alternates), and
the figure is generated tokens over the time from each call to its last piece, summed. With ``--concurrency N`` the
engines are batched ones, given each request N times at once: tokens over the time to the last piece of each group.
It prints each family's tokens/s both ways, their ratio, the decoder label of each engine (what ``/readyz`` says),
and whether the two gave the same greedy text. ``--kind`` writes the linear layers in another GGUF type (Q4_0 ...
Q6_K, F16, BF16, F32); ``--against transformers`` makes the second engine transformers' fp32 layers alone
(``TTFT_GGUF_KERNEL=false``: no block kernel either).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import tinymodels
from ttft_sse.engine.base import Engine, Finished, Piece, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

PROMPTS = (
    "tell me a story about a dragon who could fly",
    "what is the capital of france?",
    "write a short answer: why is it so?",
    "hello world, how are you?",
)


async def one(engine: Engine, prompt: str, tokens: int) -> tuple[int, str]:
    pieces: list[str] = []
    generated = 0
    request = engine.prepare(prompt=prompt, messages=None, raw=False)
    async for item in engine.stream(request, SamplingParams(tokens)):
        if isinstance(item, Piece):
            pieces.append(item.text)
        elif isinstance(item, Finished):
            generated = item.usage.completion_tokens
    return generated, "".join(pieces)


async def run(engine: Engine, tokens: int, concurrency: int = 1) -> tuple[int, float, list[str]]:
    generated, seconds, texts = 0, 0.0, []
    for prompt in PROMPTS:
        start = time.perf_counter()
        done = await asyncio.gather(*(one(engine, prompt, tokens) for _ in range(concurrency)))
        seconds += time.perf_counter() - start
        generated += sum(n for n, _ in done)
        texts += [text for _, text in done]
    return generated, seconds, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen2,qwen3,gemma3")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1, help="above 1: the batched engine, N at a time")
    parser.add_argument("--kind", default="Q8_0", help="the GGUF type of the decoder layers' linear layers")
    parser.add_argument("--against", choices=("unfused", "transformers"), default="unfused")
    args = parser.parse_args()
    print(f"cpu: {_cpu()}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for family in args.families.split(","):
            path = tinymodels.build_gguf(family, root, hidden=args.hidden, layers=args.layers, kind=args.kind)
            engines: dict[str, Engine] = {}
            kind = BatchedEngine if args.concurrency > 1 else SingleEngine
            for name, fused in (("fused", True), ("unfused", False)):
                settings = Settings(
                    model=str(path), cache_dir=root / "cache", threads=1, fused_layers=fused, prefill_process=False
                )
                if not fused and args.against == "transformers":
                    settings = settings.replace(gguf_kernel=False)
                engines[name] = kind(settings)
                engines[name].load(StageClock())
            asyncio.run(run(engines["fused"], 8))  # warm both
            asyncio.run(run(engines["unfused"], 8))
            totals = {name: [0, 0.0] for name in engines}
            texts: dict[str, list[str]] = {}
            for round_ in range(args.rounds):
                order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
                for name in order:
                    generated, seconds, texts[name] = asyncio.run(run(engines[name], args.tokens, args.concurrency))
                    totals[name][0] += generated
                    totals[name][1] += seconds
            speed = {name: generated / seconds for name, (generated, seconds) in totals.items()}
            same = texts["fused"] == texts["unfused"]
            for engine in engines.values():
                if isinstance(engine, BatchedEngine):
                    asyncio.run(engine.close())
            print(
                f"{family} ({args.kind}, hidden {args.hidden}, {args.layers} layers, c={args.concurrency}): "
                f"fused {speed['fused']:.1f} tokens/s "
                f"[{engines['fused'].info.decoder}], unfused {speed['unfused']:.1f} tokens/s "
                f"[{engines['unfused'].info.decoder}], {speed['fused'] / speed['unfused']:.2f}x; "
                f"same greedy text: {same}"
            )


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
