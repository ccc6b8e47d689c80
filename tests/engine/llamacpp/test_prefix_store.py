"""The llama.cpp engine's prefix store with the real bundled model (engine/llamacpp/prefix_store.py): what the free
sequences hold when one engine stores is found by the next engine's requests as ``cached_tokens``, with exactly the
answer a fresh computation gives; salts are kept; the bound in bytes keeps the prefills' prompts first; a corrupt
file and another server's file are ignored with a log line, the engine starting cold."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, llama_cpp_or_skip
from ttft_sse.engine.base import ChatMessage, Finished, Prompt, SamplingParams
from ttft_sse.engine.llamacpp.engine import LlamaCppEngine
from ttft_sse.engine.llamacpp.prefix_store import PrefixStore
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

SYSTEM = (
    "You are the help desk of a ferry company. You answer questions about crossings, cabins, cars, bicycles and pets, "
    "briefly and only with facts you know; otherwise you point the traveller to the harbour office."
)
QUESTION = "Can I bring my bicycle on the night ferry?"
WARM = (
    "The harbour office opens at seven in the morning and closes at noon on weekdays; it stays closed all day on "
    "Sundays."
)
LATER = "Bicycles ride free on every crossing of the night ferry, and dogs on a lead may travel on the open deck too."


def loaded(settings: Settings) -> LlamaCppEngine:
    engine = LlamaCppEngine(settings)
    engine.load(StageClock())
    return engine


def events(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "prefix_store"]


def chat(engine: LlamaCppEngine, system: str, question: str | None = None) -> Prompt:
    messages = [ChatMessage("system", system)] + ([ChatMessage("user", question)] if question else [])
    return engine.prepare(prompt=None, messages=messages, raw=False)


@dataclass(frozen=True)
class Written:
    """The file a first engine wrote on close, and what it answered cold."""

    data: bytes
    log: dict[str, Any]
    prompt: Prompt  # a request's, answered cold
    text: str
    finished: Finished
    salted: Prompt  # a prefill's, under the salt "tenant-b": the start of ``extended``
    extended: Prompt  # answered cold, under a salt of its own
    extended_text: str
    extended_finished: Finished


@pytest.fixture
def stored_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "prefixes.safetensors"
    monkeypatch.setattr(PrefixStore, "path", lambda self, info: path)
    return path


@pytest.fixture(scope="module")
def store(settings: Settings) -> Settings:
    llama_cpp_or_skip()
    return settings.replace(prefix_store_mb=64, max_concurrency=4)


@pytest.fixture(scope="module")
def written(store: Settings, tmp_path_factory: pytest.TempPathFactory) -> Written:
    """A first engine answers a request cold and computes a salted prefill, then stores its prefixes."""
    path = tmp_path_factory.mktemp("llama-prefix-store") / "prefixes.safetensors"

    async def first_engine() -> Written:
        first = loaded(store)
        try:
            prompt = chat(first, SYSTEM, QUESTION)
            typed = [ChatMessage("system", "Tenant B. " + SYSTEM), ChatMessage("user", QUESTION[:-12])]
            salted = first.prepare_prefix(prompt=None, messages=typed, raw=False)
            extended = chat(first, "Tenant B. " + SYSTEM, QUESTION)
            assert extended.token_ids[: salted.n_tokens] == salted.token_ids
            text, finished = await collect(first.stream(prompt, SamplingParams(max_tokens=24)))
            extended_answer = await collect(first.stream(extended, SamplingParams(max_tokens=24, cache_salt="fresh")))
            assert await first.prefill(salted, cache_salt="tenant-b") == salted.n_tokens
            with capture_logs() as logs:
                await first.store_prefixes()
        finally:
            await first.close()
        (log,) = events(logs)
        return Written(path.read_bytes(), log, prompt, text, finished, salted, extended, *extended_answer)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PrefixStore, "path", lambda self, info: path)
        return asyncio.run(first_engine())


async def test_close_writes_the_free_sequences_and_the_next_engine_answers_as_a_fresh_computation(
    written: Written, stored_at: Path, store: Settings
) -> None:
    assert written.log["outcome"] == "written"
    assert written.log["prefixes"] == 3 and 0 < written.log["bytes"] < len(written.data)
    # Each request's prompt and every generated token but the last; the prefill's prompt.
    answered = written.finished.usage.completion_tokens + written.extended_finished.usage.completion_tokens
    expected = written.prompt.n_tokens + written.extended.n_tokens + answered - 2 + written.salted.n_tokens
    assert written.log["tokens"] == expected
    assert written.finished.usage.cached_tokens == written.extended_finished.usage.cached_tokens == 0
    stored_at.write_bytes(written.data)
    second = loaded(store)
    try:
        with capture_logs() as logs:
            await second.restore_prefixes()
        (restored,) = events(logs)
        assert restored["outcome"] == "restored" and restored["restored_prefixes"] == 3
        assert restored["restored_tokens"] == written.log["tokens"]
        assert second.cached(written.prompt) == written.prompt.n_tokens
        assert second.cached(written.extended, "tenant-b") == written.salted.n_tokens
        assert second.cached(written.extended) < 8  # without its salt: the chat template's opening only
        text, finished = await collect(second.stream(written.prompt, SamplingParams(max_tokens=24)))
        # The prefill's prompt, and the rest of the request computed after it.
        params = SamplingParams(max_tokens=24, cache_salt="tenant-b")
        extended_text, extended = await collect(second.stream(written.extended, params))
    finally:
        await second.close()
    assert finished.usage.cached_tokens == written.prompt.n_tokens - 1  # its last token is computed, for its logits
    assert text == written.text and finished.finish_reason == written.finished.finish_reason
    assert finished.usage.completion_tokens == written.finished.usage.completion_tokens
    assert extended.usage.cached_tokens == written.salted.n_tokens
    assert extended_text == written.extended_text and extended.usage == replace(
        written.extended_finished.usage, cached_tokens=written.salted.n_tokens
    )


async def restored_from(settings: Settings, stored_at: Path, data: bytes, prompt: Prompt) -> dict[str, Any]:
    """A fresh engine's restore from a file of ``data``: its one prefix_store log line; it finds nothing of
    ``prompt`` cached."""
    stored_at.write_bytes(data)
    engine = loaded(settings)
    try:
        with capture_logs() as logs:
            await engine.restore_prefixes()
        assert engine.cached(prompt) == 0
    finally:
        await engine.close()
    (logged,) = events(logs)
    return logged


async def test_a_corrupt_file_is_ignored_with_a_log_line_and_the_engine_starts_cold(
    written: Written, stored_at: Path, store: Settings
) -> None:
    data = bytearray(written.data)
    data[-100] ^= 0x01  # one bit of the last prefix's keys and values
    ignored = await restored_from(store, stored_at, bytes(data), written.prompt)
    assert ignored["outcome"] == "ignored" and ignored["what"] == "corrupt" and ignored["log_level"] == "warning"
    assert "does not match its sha256" in ignored["reason"]


async def test_another_servers_file_is_ignored_as_foreign_naming_what_differs(
    written: Written, stored_at: Path, store: Settings
) -> None:
    """Two sequences, not four: llama.cpp's state of a sequence lists every sequence's cells, and another count's
    is not this context's."""
    ignored = await restored_from(store.replace(max_concurrency=2), stored_at, written.data, written.prompt)
    assert ignored["outcome"] == "ignored" and ignored["what"] == "foreign"
    assert "its sequences is 4, this server's 2" in ignored["reason"]


async def test_a_missing_file_is_ignored_with_a_log_line(stored_at: Path, store: Settings) -> None:
    engine = loaded(store)
    try:
        with capture_logs() as logs:
            await engine.restore_prefixes()
    finally:
        await engine.close()
    (ignored,) = events(logs)
    assert ignored["outcome"] == "ignored" and ignored["what"] == "missing" and ignored["log_level"] == "info"


async def test_the_bound_in_bytes_keeps_the_prefills_prompt_before_a_later_request(
    stored_at: Path, store: Settings
) -> None:
    """1 MiB holds about 45 of the bundled model's tokens (30 layers x 2 x 3 heads x 64 x 2 bytes each, f16): the
    prefill's prompt, not the request that came after it as well."""
    bounded = store.replace(prefix_store_mb=1)
    first = loaded(bounded)
    try:
        warm = first.prepare(prompt=WARM, messages=None, raw=True)
        later = first.prepare(prompt=LATER, messages=None, raw=True)
        assert warm.n_tokens + later.n_tokens > 45 and warm.n_tokens < 40  # one fits 1 MiB, both do not
        assert await first.prefill(warm) == warm.n_tokens
        await collect(first.stream(later, SamplingParams(max_tokens=2)))
        with capture_logs() as logs:
            await first.store_prefixes()
    finally:
        await first.close()
    (written,) = events(logs)
    assert written["outcome"] == "written" and written["prefixes"] == 1
    assert written["tokens"] == warm.n_tokens and written["bytes"] <= 2**20

    second = loaded(bounded)
    try:
        await second.restore_prefixes()
        assert second.cached(warm) == warm.n_tokens
        assert second.cached(later) < 3
    finally:
        await second.close()
