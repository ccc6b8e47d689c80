"""A server whose KV cache is in f16 (``TTFT_KV_DTYPE=f16``) with the real bundled model: greedy answers through
``/complete``, the f16 engine's, and ``/readyz`` saying the cache's dtype and its halved bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.support.engines import collect, prompt_of
from tests.support.servers import running
from ttft_sse.app import create_app
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

ASKS = [("What is the capital of France?", 16), ("Name three colors.", 24), ("Why is the sky blue?", 32)]


@pytest.fixture(scope="module")
def f16_server(settings: Settings) -> Iterator[str]:
    with running(create_app(settings.replace(kv_dtype="f16"))) as base:
        yield base


def test_readyz_reports_an_f16_cache_at_half_the_fp32_bytes(f16_server: str) -> None:
    memory = httpx.get(f"{f16_server}/readyz", timeout=30).json()["memory"]
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, keys and values at 2 bytes (4 in fp32: test_assembly.py)
    assert (memory["kv_cache_tokens"], memory["kv_cache_dtype"]) == (8192, "float16")
    assert memory["kv_cache_bytes"] == 8192 * 30 * 2 * 3 * 64 * 2


def test_complete_gives_the_f16_engines_greedy_answers(f16_server: str, settings: Settings) -> None:
    reference = SingleEngine(settings.replace(kv_dtype="f16"))
    reference.load(StageClock())

    async def wanted(prompt: str, max_tokens: int) -> str:
        text, _ = await collect(reference.stream(prompt_of(reference, prompt), SamplingParams(max_tokens)))
        return text

    with httpx.Client(timeout=120) as client:
        for prompt, max_tokens in ASKS:
            got = client.post(f"{f16_server}/complete", json={"prompt": prompt, "max_tokens": max_tokens})
            assert got.status_code == 200
            assert got.json()["text"] == asyncio.run(wanted(prompt, max_tokens)) != ""
