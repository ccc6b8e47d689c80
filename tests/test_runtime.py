from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

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


class StoringEngine(FakeEngine):
    """A scripted engine with a prefix store (engine/base.py's ``StoresPrefixes``) that fails both ways, and what
    the runtime asked of it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def restore_prefixes(self) -> None:
        self.calls.append("restore")
        raise OSError("the cache directory went away")

    async def store_prefixes(self) -> None:
        self.calls.append("store")
        raise OSError("the disk is full")


async def test_a_prefix_store_that_fails_leaves_the_start_cold_and_the_drain_whole() -> None:
    engine = StoringEngine()
    runtime = Runtime(Settings(prefix_store_mb=16), engine)
    with capture_logs() as logs:
        await runtime.start()
        assert runtime.lifecycle.state == "ready" and "prefix_store_ms" in runtime.lifecycle.startup_report()
        await runtime.drain(1)
    assert engine.calls == ["restore", "store"]
    failed = [e for e in logs if e["event"] == "prefix_store"]
    assert [e["outcome"] for e in failed] == ["failed", "failed"]
    assert "the disk is full" in failed[1]["error"]
    assert [e["event"] for e in logs].count("drained") == 1


async def test_without_the_setting_the_engine_is_asked_nothing() -> None:
    engine = StoringEngine()
    runtime = Runtime(Settings(), engine)
    await runtime.start()
    await runtime.drain(1)
    assert engine.calls == []
