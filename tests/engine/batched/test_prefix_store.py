"""The prefix store with the real bundled model (engine/batched/prefix_store.py): the blocks one engine writes are
found by the next engine's requests as if computed, and answer exactly as a fresh computation does; salts and the
bound in bytes are kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, prompt_of
from tests.support.texts import SYSTEM
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.batched.engine import BLOCK_TOKENS, BatchedEngine
from ttft_sse.engine.batched.prefix_store import PrefixStore
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

QUESTION = "Which train should I take to reach the coast before noon?"


@pytest.fixture
def stored_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "prefixes.safetensors"
    monkeypatch.setattr(PrefixStore, "path", lambda self, info: path)
    return path


def loaded(settings: Settings) -> BatchedEngine:
    engine = BatchedEngine(settings)
    engine.load(StageClock())
    return engine


def events(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "prefix_store"]


def whole(tokens: int) -> int:
    """The prompt tokens a request finds in whole blocks at most (it computes its last token itself)."""
    return (tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.mark.parametrize("kv_dtype", ["fp32", "f16"])
async def test_the_next_engine_finds_the_stored_blocks_and_answers_as_a_fresh_computation(
    settings: Settings, stored_at: Path, kv_dtype: str
) -> None:
    """In both KV dtypes: an f16 cache's blocks are written and read back as the cache holds them (2 bytes a value),
    so a restored prompt answers as the f16 cache's own fresh computation does."""
    store = settings.replace(prefix_store_mb=64, kv_dtype=kv_dtype)
    first = loaded(store)
    try:
        prompt = prompt_of(first, QUESTION, SYSTEM)
        salted = prompt_of(first, "Can I take my bicycle?", "Tenant B. " + SYSTEM)
        cold_text, cold = await collect(first.stream(prompt, SamplingParams(16)))
        await first.prefill(salted, cache_salt="tenant-b")
        with capture_logs() as logs:
            await first.store_prefixes()
    finally:
        await first.close()
    (written,) = events(logs)
    assert written["outcome"] == "written" and stored_at.is_file()
    assert written["prefixes"] >= 2 and 0 < written["bytes"] < stored_at.stat().st_size
    value_bytes = 2 if kv_dtype == "f16" else 4  # 30 layers x keys and values x 3 heads x 64 a token
    assert written["bytes"] == written["tokens"] * 30 * 2 * 3 * 64 * value_bytes

    second = loaded(store)
    try:
        with capture_logs() as logs:
            await second.restore_prefixes()
        (restored,) = events(logs)
        assert restored["outcome"] == "restored" and restored["restored_prefixes"] >= 2
        assert second.cached(prompt) == whole(prompt.n_tokens)
        assert second.cached(salted, "tenant-b") == whole(salted.n_tokens)
        assert second.cached(salted) < 16  # without its salt: the chat template's first blocks only
        text, finished = await collect(second.stream(prompt, SamplingParams(16)))
    finally:
        await second.close()
    assert cold.usage.cached_tokens < whole(prompt.n_tokens) // 2
    assert finished.usage.cached_tokens == whole(prompt.n_tokens)
    assert text == cold_text and finished.finish_reason == cold.finish_reason


async def test_the_bound_in_bytes_keeps_the_pinned_prompt_first(settings: Settings, stored_at: Path) -> None:
    """1 MiB holds 5 of the bundled model's blocks (4 tokens x 30 layers x 2 x 3 heads x 64 x 4 bytes each): the
    warm prompt's first five, not the later request's."""
    store = settings.replace(prefix_store_mb=1)
    first = loaded(store)
    try:
        warm = prompt_of(first, "Hello there, who are you?", "You are a warm prompt.")
        other = prompt_of(first, QUESTION, SYSTEM)
        assert await first.warm(warm) == warm.n_tokens
        await collect(first.stream(other, SamplingParams(2)))
        with capture_logs() as logs:
            await first.store_prefixes()
    finally:
        await first.close()
    (written,) = events(logs)
    assert written["tokens"] == 5 * BLOCK_TOKENS and written["bytes"] <= 2**20

    second = loaded(store)
    try:
        await second.restore_prefixes()
        assert second.cached(warm) == 5 * BLOCK_TOKENS
    finally:
        await second.close()
