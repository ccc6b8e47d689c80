"""The one façade over transformers' private parts (engine/library/internals.py): every name the engines use checked
at load, the fallback when one is missing, and nothing of the library replaced for the process."""

from __future__ import annotations

import asyncio
import functools
import importlib
from typing import Any

import pytest
import torch
import transformers
from structlog.testing import capture_logs

from tests.support.engines import collect, prompt_of
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.library import grouped, internals
from ttft_sse.engine.library.internals import CB, INTERNALS, missing
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock


def test_the_installed_transformers_has_every_internal_the_engine_uses() -> None:
    """pyproject.toml pins the tested versions; this fails on an install outside them that lacks one."""
    assert missing() == []


def test_a_missing_module_or_attribute_is_named() -> None:
    names = {
        "transformers.generation.continuous_batching.scheduler": ("FIFOScheduler.schedule_batch", "FIFOScheduler.gone"),
        "transformers.generation.no_such_module": ("Anything",),
        "transformers": ("NoSuchConfig.attribute",),
    }
    assert missing(names) == [
        "transformers.generation.continuous_batching.scheduler.FIFOScheduler.gone",
        "transformers.generation.no_such_module",
        "transformers.NoSuchConfig.attribute",
    ]
    assert set(INTERNALS) >= {"transformers.generation.continuous_batching.continuous_api"}


def test_a_missing_scheduler_attribute_or_constructor_argument_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's instance attributes the prefill set-aside and the urgent hold-back rearrange, and the keyword
    arguments the engine's batch processor is built with, are checked at load like the names of modules."""
    monkeypatch.setattr(internals, "SCHEDULER_STATE", (*internals.SCHEDULER_STATE, "waiting_requests_by_lane"))
    arguments = dict(internals.ARGUMENTS)
    arguments[(f"{CB}.scheduler", "FIFOScheduler")] += ("priority",)
    monkeypatch.setattr(internals, "ARGUMENTS", arguments)
    assert missing() == [
        f"{CB}.scheduler.FIFOScheduler(priority=)",
        f"{CB}.scheduler.FIFOScheduler().waiting_requests_by_lane",
    ]


@pytest.mark.parametrize("where", ["modules", "manager"])
async def test_without_the_internals_every_request_runs_on_the_library_s_generate(
    settings: Settings, reference: SingleEngine, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Another transformers version: one log line naming what is missing, no batching loop, and the single engine's
    answer for every request (its public ``generate``), rather than a crash or a wrong answer. What the manager holds
    is checked once it is made; the rest before."""
    if where == "modules":
        gone = ["transformers.generation.continuous_batching.scheduler.FIFOScheduler._schedule_request"]
        monkeypatch.setattr(internals, "missing", lambda: gone)
    else:
        gone = ["ContinuousBatchingManager().distributed_helper"]
        monkeypatch.setattr(internals, "missing_on", lambda manager: gone)
    engine = BatchedEngine(settings)
    with capture_logs() as logs:
        engine.load(StageClock())
    try:
        (off,) = [entry for entry in logs if entry["event"] == "batching_off"]
        assert off["missing"] == gone and off["log_level"] == "warning"
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


async def test_the_batched_engine_replaces_nothing_of_the_library_for_the_process(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the engine's batch processor is built, the library's modules keep their names (the paged cache's
    ``torch``, the manager's ``PagedAttentionCache``); its scheduler table and ``sdpa`` stay the library's; and the
    engine's cache, zeroed lazily, in place and counted by its own scheduler, is what answers."""
    cache_module = importlib.import_module(f"{CB}.cache")
    api = importlib.import_module(f"{CB}.continuous_api")
    schedulers = importlib.import_module(f"{CB}.scheduler")
    names_before = set(schedulers.SCHEDULER_MAPPING)
    library_sdpa = transformers.AttentionInterface()["sdpa"]
    seen: list[tuple[bool, bool]] = []
    construct = cache_module.PagedAttentionCache.__init__

    @functools.wraps(construct)  # its signature: the load checks the arguments it is built with
    def spied(self: Any, *args: Any, **kwargs: Any) -> None:  # the library's constructor, in the batching thread
        seen.append((cache_module.torch is torch, api.PagedAttentionCache is cache_module.PagedAttentionCache))
        construct(self, *args, **kwargs)

    monkeypatch.setattr(cache_module.PagedAttentionCache, "__init__", spied)
    engine = BatchedEngine(settings)
    engine.load(StageClock())
    try:
        text, _ = await collect(engine.stream(prompt_of(engine, "What is 2+2?"), SamplingParams(max_tokens=4)))
        assert text
        assert seen == [(True, True)]
        assert set(schedulers.SCHEDULER_MAPPING) == names_before
        assert transformers.AttentionInterface()["sdpa"] is library_sdpa is not grouped.grouped_sdpa
        cache = engine._manager.batch_processor.cache
        assert isinstance(cache, cache_module.PagedAttentionCache) and cache.in_place is not None
        assert engine.stats().prompt_tokens > 0  # the engine's scheduler counted the prompt
    finally:
        await engine.close()
