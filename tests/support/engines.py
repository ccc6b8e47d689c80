"""Driving a loaded engine in tests: a prompt made as the server makes it, a stream collected, an engine left idle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from ttft_sse.engine.base import ChatMessage, Finished, Piece, Progress, Prompt
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.single import SingleEngine


async def collect(items: AsyncGenerator[Progress | Piece | Finished, None]) -> tuple[str, Finished]:
    """A generation's text and its one ``Finished``; ``Progress`` items (a long prompt's) are passed over."""
    pieces: list[Piece] = []
    finished: list[Finished] = []
    async with aclosing(items) as stream:
        async for item in stream:
            if isinstance(item, Piece):
                pieces.append(item)
            elif isinstance(item, Finished):
                finished.append(item)
    assert [p.index for p in pieces] == list(range(len(pieces)))
    assert all(p.text for p in pieces)
    assert len(finished) == 1
    return "".join(p.text for p in pieces), finished[0]


def prompt_of(engine: BatchedEngine | SingleEngine, text: str, system: str | None = None) -> Prompt:
    if system is None:
        return engine.prepare(prompt=text, messages=None, raw=False)
    messages = [ChatMessage("system", system), ChatMessage("user", text)]
    return engine.prepare(prompt=None, messages=messages, raw=False)


async def eventually_idle(engine: BatchedEngine) -> None:
    for _ in range(200):
        if engine.stats().requests == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the batch still holds {engine.stats().requests} requests")


def llama_cpp_or_skip() -> None:
    """The llama.cpp engine's binding (the ``llamacpp`` extra): skipped without it, a failure under CI (the Makefile
    installs it)."""
    from tests.support.processes import missing
    from ttft_sse.engine.llamacpp import library

    if library.installed() != library.VERSION:
        missing(f"{library.DISTRIBUTION}=={library.VERSION} (pip install -e '.[llamacpp]')")
