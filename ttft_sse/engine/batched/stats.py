"""What the batched engine tells of its loop: :class:`BatchStats`, for tests, the benchmark and metrics."""

from __future__ import annotations

from dataclasses import dataclass

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
