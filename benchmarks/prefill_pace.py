"""A prompt computed as a prefill against the same length sent as a request: docs/performance.md's "The first token
while the user types".

    python benchmarks/prefill_pace.py

loads the batched engine in this process (the bundled model, ``ttft-sse serve``'s defaults) and computes, four times,
a new 1,930-token conversation as a request (``max_tokens`` 1) and another as a prefill (``Engine.prefill``), taking
turns at going first, with the prefills' steps at most 128 prompt tokens (the default) and then 512. Each line gives
both times and the load average.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from typing_prompts import system_prompt

from ttft_sse.engine.base import ChatMessage, Prompt, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.library import scheduler
from ttft_sse.engine.loading.sources import bundled_gguf, model_dir
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock


async def main() -> None:
    settings = Settings.from_env()
    tokenizer = Tokenizer.from_file(str(model_dir(bundled_gguf(), settings.cache_dir) / "tokenizer.json"))
    engine = BatchedEngine(settings)
    engine.load(StageClock())
    made = iter(range(900, 1000))

    def conversation() -> Prompt:
        system = ChatMessage("system", system_prompt(next(made), tokenizer, 1900))
        return engine.prepare(prompt=None, messages=[system, ChatMessage("user", "Hi")], raw=False)

    async def request() -> float:
        prompt, started = conversation(), time.perf_counter()
        async for _ in engine.stream(prompt, SamplingParams(max_tokens=1)):
            pass
        return time.perf_counter() - started

    async def prefill() -> float:
        prompt, started = conversation(), time.perf_counter()
        await engine.prefill(prompt)
        return time.perf_counter() - started

    await request()  # the first step's one-off costs
    for cap in (128, 512, 128, 512):
        scheduler.PREFILL_STEP_TOKENS = cap
        if cap == 128:
            as_request, as_prefill = await request(), await prefill()
        else:
            as_prefill, as_request = await prefill(), await request()
        print(f"steps of {cap}: request {as_request:.2f} s, prefill {as_prefill:.2f} s; load {os.getloadavg()[0]:.1f}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
