"""How often an f16 KV cache (``TTFT_KV_DTYPE=f16``) changes a greedy answer: the single engine with its KV cache in
fp32 and in f16, one after the other in one process, on the same chat questions, each answer compared token for token.

    python benchmarks/kv_dtype_answers.py                          # the bundled model, 48 and 128 tokens
    python benchmarks/kv_dtype_answers.py --model FILE.gguf --tokens 64 --activations int8

Prints, for each length, how many answers are the same, and for the others the token where they part and both
texts. The batched engine gives each request the single engine's text for the same cache dtype (a test), so these
are the server's answers too.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttft_sse.engine.base import Finished, Piece, SamplingParams
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

QUESTIONS = Path(__file__).with_name("chat-questions.txt")


async def answer(engine: SingleEngine, question: str, tokens: int) -> list[str]:
    """The greedy answer's pieces of text, one a token."""
    prompt = engine.prepare(prompt=question, messages=None, raw=False)
    pieces: list[str] = []
    async for item in engine.stream(prompt, SamplingParams(max_tokens=tokens)):
        if isinstance(item, Piece):
            pieces.append(item.text)
        assert isinstance(item, Piece | Finished)
    return pieces


async def main(args: argparse.Namespace) -> None:
    questions = [q for q in QUESTIONS.read_text().splitlines() if q.strip()]
    answers: dict[str, dict[int, list[list[str]]]] = {}
    for dtype in ("fp32", "f16"):
        settings = Settings(
            model=args.model, kv_dtype=dtype, gguf_activations=args.activations, threads=1, log_level="warning"
        )
        engine = SingleEngine(settings)
        engine.load(StageClock())
        answers[dtype] = {n: [await answer(engine, q, n) for q in questions] for n in args.tokens}
        await engine.close()
    print(f"model {args.model}, rows {args.activations}, {len(questions)} questions ({QUESTIONS.name}), greedy")
    for n in args.tokens:
        pairs = list(zip(answers["fp32"][n], answers["f16"][n], strict=True))
        same = sum(a == b for a, b in pairs)
        print(f"\n{n} tokens: {same} of {len(pairs)} answers the same with an f16 KV cache")
        for question, (a, b) in zip(questions, pairs, strict=True):
            if a != b:
                at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                print(f"- {question!r}: parts at piece {at}\n    fp32: {''.join(a)!r}\n    f16:  {''.join(b)!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[48, 128])
    parser.add_argument("--activations", default="fp32", choices=("fp32", "int8", "auto"))
    asyncio.run(main(parser.parse_args()))
