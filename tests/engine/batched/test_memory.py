"""The paged cache's memory: zeroed lazily, faulted in at idle priority, and the batched engine's cache so made."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from tests.support.engines import collect, prompt_of
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.batched import memory
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

PAGE = os.sysconf("SC_PAGE_SIZE")
BIG = 64 << 20  # bytes


def resident(tensor: Any) -> int:
    """The bytes of ``tensor``'s memory in RAM, counted page by page (mincore)."""
    start = tensor.data_ptr() // PAGE * PAGE
    pages = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - start + PAGE - 1) // PAGE
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), flags) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in flags) * PAGE


def test_lazily_zeroed_memory_reads_as_zeros_and_is_resident_only_where_written() -> None:
    zeros = memory.lazy_zeros(256 << 20, torch)
    assert zeros.dtype == torch.uint8 and zeros.shape == (256 << 20,) and zeros.data_ptr() % PAGE == 0
    assert resident(zeros) == 0  # nothing of it in memory yet
    zeros[: 32 << 20].fill_(7)
    assert 32 << 20 <= resident(zeros) <= 36 << 20  # the pages written (whole ones; huge where the kernel gave them)
    assert int(zeros[32 << 20 :].count_nonzero()) == 0  # the rest reads as zeros


def test_populate_faults_every_page_in_and_changes_nothing_it_holds() -> None:
    cache = memory.lazy_zeros(BIG + 12345, torch)
    cache[:5000].fill_(9)
    with capture_logs() as logs:
        memory.populate(cache, lambda: False, threading.Event())
    assert resident(cache) >= cache.numel() - 2 * PAGE  # all but the partial pages at its two ends
    assert int(cache[:5000].sum()) == 9 * 5000 and int(cache[5000:].count_nonzero()) == 0
    # (other tests' engines, idle by now, may populate their caches meanwhile: their lines are captured too)
    assert ("kv_cache_populated", round(cache.numel() / 2**20)) in [(e["event"], e.get("mib")) for e in logs]


def test_populate_stops_between_chunks_when_asked() -> None:
    cache, stop = memory.lazy_zeros(BIG, torch), threading.Event()
    stop.set()
    with capture_logs() as logs:
        memory.populate(cache, lambda: False, stop)
    assert resident(cache) == 0
    assert [e for e in logs if e["log_level"] != "debug" and e.get("mib") == 0] == []  # stopping is no news


def test_populate_waits_while_the_engine_is_busy() -> None:
    cache, looks = memory.lazy_zeros(BIG, torch), []

    def busy() -> bool:
        looks.append(resident(cache))
        return len(looks) <= 3  # busy at the first three looks

    memory.populate(cache, busy, threading.Event())
    assert looks[:4] == [looks[0]] * 4 and looks[0] <= PAGE  # nothing populated while busy
    assert resident(cache) >= cache.numel() - 2 * PAGE


@pytest.mark.parametrize("made", ["lazily", "lazily, populated", "by transformers"])
async def test_the_batched_engines_paged_cache(settings: Settings, made: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paged cache of 32,768 tokens (1.5 GB for the bundled model) after a short answer: almost none of it in
    memory when zeroed lazily and not populated; all of it once populated in the background, the answer the same;
    all of it at once with transformers' own allocation (torch.zeros), which writes every page at the first step."""
    if made != "lazily, populated":
        monkeypatch.setattr(memory, "populate", lambda cache, busy, stop: None)
    if made == "by transformers":
        monkeypatch.setattr(memory, "lazy_zeros", lambda size, torch: torch.zeros(size, dtype=torch.uint8))
    engine = BatchedEngine(settings.replace(kv_cache_tokens=32768))
    engine.load(StageClock())
    try:
        text, _ = await collect(engine.stream(prompt_of(engine, "What is 2+2?"), SamplingParams(max_tokens=8)))
        cache = engine._manager.batch_processor.cache.cache_tensor
        assert cache.numel() > 1 << 30
        if made == "lazily":
            assert resident(cache) < 16 << 20  # the pages of the answer's few blocks
            return
        for _ in range(300):  # populating 1.5 GB takes about 2 s of an idle core here
            if resident(cache) >= cache.numel() - 2 * PAGE:
                break
            time.sleep(0.05)
        assert resident(cache) >= cache.numel() - 2 * PAGE
        again, _ = await collect(engine.stream(prompt_of(engine, "What is 2+2?"), SamplingParams(max_tokens=8)))
        assert again == text
    finally:
        await engine.close()
