"""The check of transformers' internals the batched engine hooks into, and the fallback when one is missing."""

from __future__ import annotations

import asyncio
import ctypes
import os
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from tests.support.engines import collect, prompt_of
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.batched import engine as batched
from ttft_sse.engine.batched import hooks
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.batched.hooks import INTERNALS, lazy_zeros, missing_internals
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


def resident(tensor: Any) -> int:
    """The bytes of ``tensor``'s memory in RAM, counted page by page (mincore)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    pages = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - start + page - 1) // page
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), flags) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in flags) * page


def test_lazily_zeroed_memory_reads_as_zeros_and_is_resident_only_where_written() -> None:
    zeros = lazy_zeros(256 << 20, torch)
    assert zeros.dtype == torch.uint8 and zeros.shape == (256 << 20,) and zeros.data_ptr() % hooks.ALIGN == 0
    assert resident(zeros) <= 4096  # nothing of it in memory yet (but the page its allocator's header shares)
    zeros[: 32 << 20].fill_(7)
    assert 32 << 20 <= resident(zeros) <= (32 << 20) + 2 * 4096  # the pages written (it starts mid-page)
    assert int(zeros[32 << 20 :].count_nonzero()) == 0  # the rest reads as zeros


@pytest.mark.parametrize("lazily", [True, False])
async def test_the_batched_engines_paged_cache_is_resident_only_where_used(
    settings: Settings, lazily: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged cache of 32,768 tokens (1.5 GB for the bundled model) after a short answer: almost none of it in
    memory, where transformers' own allocation (torch.zeros) writes all of it at the first request."""
    if not lazily:
        monkeypatch.setattr(batched, "zero_cache_lazily", lambda manager: None)
    engine = BatchedEngine(settings.replace(kv_cache_tokens=32768))
    engine.load(StageClock())
    try:
        text, _ = await collect(engine.stream(prompt_of(engine, "What is 2+2?"), SamplingParams(max_tokens=8)))
        assert text
        cache = engine._manager.batch_processor.cache.cache_tensor
        assert cache.numel() > 1 << 30
        held = resident(cache)
        if lazily:
            assert held < 16 << 20  # the pages of the answer's few blocks
        else:
            assert held >= cache.numel() - (1 << 20)
    finally:
        await engine.close()
