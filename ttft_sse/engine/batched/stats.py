"""What the batched engine tells of its loop: :class:`BatchStats`, for tests, the benchmark and metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ttft_sse.engine.kernels import kernel


@dataclass(frozen=True)
class BatchStats:
    """A snapshot of the batching loop. Counters only grow."""

    running: bool  # the loop's thread is alive
    requests: int  # requests the library holds now (prefilling, decoding, or waiting to be scheduled)
    streams: int  # requests whose client is still reading
    steps: int  # forward passes that produced at least one token
    prompt_tokens: int  # prompt tokens scheduled, shared or computed
    prefix_hits: int  # prompts that reused shared blocks
    prefix_hit_tokens: int  # prompt tokens served from shared blocks instead of computed
    kv_tokens_in_use: int  # KV capacity held by live requests
    kv_tokens_cached: int  # KV capacity held only for reuse (evicted when the cache runs short)
    kv_tokens_capacity: int
    prefill: str = "off"  # the prefill process (engine/first/process.py): off, loading, ready, failed or stopped
    interludes: str = "off"  # interludes (engine/first/interlude.py): off, ready, failed or stopped
    side_first_tokens: int = 0  # first tokens the prefill process gave before the batch did
    interlude_first_tokens: int = 0  # first tokens interludes gave (engine/first/interlude.py)
    rows_sat_out: int = 0  # lower-lane rows left out of a step for the high lane's (engine/library/turns.py)
    kernel: kernel.HelperCounts | None = None  # the block kernel's helper threads (None without them)


def kv_tokens(cache: Any) -> tuple[int, int]:
    """The library's paged ``cache`` (or None): its tokens held by requests (and pins), and those cached only."""
    in_use = cached = 0
    for allocator in list(getattr(cache, "cache_allocators", {}).values()):
        page = allocator.tokens_per_page
        in_use += sum(len(blocks) for blocks in list(allocator.block_table.values())) * page
        cached += len(allocator.ledger.cached_blocks) * page
    return in_use, cached
