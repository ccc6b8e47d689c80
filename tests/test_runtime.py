from __future__ import annotations

import asyncio

from ttft_sse.engine.fake import FakeEngine
from ttft_sse.runtime import Runtime
from ttft_sse.settings import Settings


async def test_a_shutdown_during_the_load_is_not_a_failed_start() -> None:
    """SIGTERM while the model loads: the warm-up is refused like any request, and that is not a load failure
    (which would make the process exit 1 and a supervisor report a crash)."""
    runtime = Runtime(Settings(), FakeEngine(load_seconds=0.2))
    start = asyncio.create_task(runtime.start())
    await runtime.drain(5)
    await asyncio.wait_for(start, 5)
    assert runtime.lifecycle.state == "stopping"
    assert not runtime.lifecycle.failed.is_set() and runtime.lifecycle.error is None
