"""The paged cache's memory on CPU: zeroed lazily, and faulted in ahead of use at idle priority.

transformers allocates the whole paged cache (``kv_cache_tokens`` x layers x KV heads x head size x 2 x 4 bytes in fp32,
2 in f16: 1.9 GB for a Qwen3-0.6B shape at 8192 tokens in fp32) when the batching loop builds its first batch processor,
with ``torch.zeros``, which writes every page before the first answer: seconds of start-up where first writes of fresh
memory are slow (a virtual machine's: 1.1 ms a MB measured here). The engine has it take :func:`lazy_zeros` instead
(engine/library/paged_cache.py), and once the loop runs, :func:`populate` faults every page in at idle priority
(threads.Idle) while no request runs, so that neither the start nor a later long prompt waits for the pages it writes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("ttft_sse.engine")

MADV_POPULATE_WRITE = 23
"""madvise's advice (Linux 5.14) that faults pages in as if written, without changing what they hold."""
CHUNK = 4 << 20
"""Bytes :func:`populate` asks for at a time (about 5 ms each here): between chunks it checks its stop event and
whether the engine is busy."""
PAUSE = 0.05
"""Seconds the engine must have been idle before :func:`populate` goes on: a stream of requests one after another
(their gaps a few ms) leaves it waiting, and their first writes fault their pages in themselves."""


def lazy_zeros(size: int, torch: Any) -> Any:
    """``size`` zero bytes as a CPU tensor whose pages are not written until used: an anonymous private mapping of
    its own (page-aligned), whose pages the kernel zeroes at their first touch, whatever the process's allocator
    does (calloc hands out heap memory, written at once, where its mmap threshold is above the size: the suite once
    met one so). The tensor holds the mapping; it goes when the tensor does."""
    import numpy as np

    mapped = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # huge pages where the kernel gives them, as numpy asks for its large arrays
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8, count=size))


def populate(tensor: Any, busy: Callable[[], bool], stop: threading.Event) -> None:
    """Fault in every page of ``tensor``'s memory as if written, a :data:`CHUNK` at a time, until done or ``stop`` is
    set, while the engine has not been ``busy()`` since :data:`PAUSE` before (the warm-up's request included): its
    first writes of fresh memory would slow a request's own, at idle priority or not. What the pages hold does not
    change (``MADV_POPULATE_WRITE``), so the cache's writers may run meanwhile. Holds ``tensor`` until it returns,
    so that the memory it advises stays mapped. Logs ``kv_cache_populated``, or ``kv_cache_not_populated`` with the
    reason (a kernel before 5.14 refuses the advice: pages are then faulted in as the cache writes them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    first = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    started = time.perf_counter()
    settled = False  # the engine seen idle, then idle again PAUSE later, and not busy since
    for at in range(first, end, CHUNK):
        while not stop.is_set():
            if busy():
                settled = False
            elif settled:
                break
            else:
                settled = True  # if it is idle still at the next look
            stop.wait(PAUSE)
        if stop.is_set():  # the engine closing, or its loop restarted with another cache
            log.debug("kv_cache_not_populated", reason="stopped", mib=round((at - first) / 2**20))
            return
        if libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(min(CHUNK, end - at)), MADV_POPULATE_WRITE) != 0:
            log.info("kv_cache_not_populated", reason=os.strerror(ctypes.get_errno()), mib=round((at - first) / 2**20))
            return
    log.info("kv_cache_populated", mib=round((end - first) / 2**20), ms=round((time.perf_counter() - started) * 1e3))
