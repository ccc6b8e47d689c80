"""The check of transformers' internals the batched engine hooks into, and the fallback when one is missing."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, prompt_of
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.batched import engine as batched
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.library.hooks import INTERNALS, missing_internals
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock


def test_the_installed_transformers_has_every_internal_the_engine_uses() -> None:
    """pyproject.toml pins the tested versions; this fails on an install outside them that lacks one."""
    assert missing_internals() == []


def test_a_missing_module_or_attribute_is_named() -> None:
    internals = {
        "transformers.generation.continuous_batching.scheduler": ("FIFOScheduler.schedule_batch", "FIFOScheduler.gone"),
        "transformers.generation.no_such_module": ("Anything",),
        "transformers": ("NoSuchConfig.attribute",),
    }
    assert missing_internals(internals) == [
        "transformers.generation.continuous_batching.scheduler.FIFOScheduler.gone",
        "transformers.generation.no_such_module",
        "transformers.NoSuchConfig.attribute",
    ]
    assert set(INTERNALS) >= {"transformers.generation.continuous_batching.continuous_api"}
    # The scheduler's instance state (the requests it holds), looked for on one built without a cache.
    assert missing_internals({}, state=("active_requests", "max_requests_per_batch", "gone")) == [
        "transformers.generation.continuous_batching.scheduler.FIFOScheduler().gone"
    ]


async def test_without_the_internals_every_request_runs_on_the_library_s_generate(
    settings: Settings, reference: SingleEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another transformers version: one log line naming what is missing, no batching loop, and the single engine's
    answer for every request (its public ``generate``), rather than a crash or a wrong answer."""
    missing = ["transformers.generation.continuous_batching.scheduler.FIFOScheduler._schedule_request"]
    monkeypatch.setattr(batched, "missing_internals", lambda: missing)
    engine = BatchedEngine(settings)
    with capture_logs() as logs:
        engine.load(StageClock())
    try:
        (off,) = [entry for entry in logs if entry["event"] == "batching_off"]
        assert off["missing"] == missing and off["log_level"] == "warning"
        assert engine.info.beside_batch.startswith("none: one generate per request (transformers ")
        assert not engine.stats().running
        params = SamplingParams(max_tokens=12)
        answers = await asyncio.gather(
            *(collect(engine.stream(prompt_of(engine, q), params)) for q in ("What is 2+2?", "Name a colour."))
        )
        expected = [
            await collect(reference.stream(prompt_of(reference, q), params)) for q in ("What is 2+2?", "Name a colour.")
        ]
        assert [text for text, _ in answers] == [text for text, _ in expected]
        assert engine.stats().steps == 0  # nothing went through a batching loop
    finally:
        await engine.close()
