"""`ttft-sse bench --typing-cps` against a real server over the scripted engine: the typist's prefills reach
``/prefill`` before its request, in the page's order, and the record counts them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from tests.support.servers import fake_app, running
from ttft_sse.bench import load
from ttft_sse.bench.client import Target
from ttft_sse.bench.prompts import Prompt
from ttft_sse.bench.protocol import Lengths
from ttft_sse.engine.fake import FakeEngine


class _Arrivals:
    """Notes each POST's path as it arrives, in order."""

    def __init__(self, app: ASGIApp, *, seen: list[tuple[str, Any]]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.seen.append(scope["path"])
        await self.app(scope, receive, send)


def test_a_typed_request_prefills_the_conversation_as_it_is_typed_then_is_sent() -> None:
    seen: list[Any] = []
    app = fake_app(FakeEngine())
    app.add_middleware(_Arrivals, seen=seen)
    prompt = Prompt(
        "typed", ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a warm colour"})
    )
    with running(app) as base:
        plan = load.Plan(
            targets=(Target(base, "native", "fake"),),
            modes=("stream",),
            concurrency=(1,),
            prompts=(prompt,),
            max_tokens=Lengths(4, 4),
            requests=2,
            typing_cps=40.0,  # 175 ms between the last prefill and the request: they arrive in order
        )
        (run,) = asyncio.run(load.run(plan, epoch=time.perf_counter()))
    # Each request: the system prompt, "Name", "Name a", "Name a warm" (not the last word), then the request.
    assert seen == ["/prefill"] * 4 + ["/stream"] + ["/prefill"] * 4 + ["/stream"]
    assert [(r.outcome, r.prefills, r.prefills_failed) for r in run.records] == [("ok", 4, 0)] * 2
    assert all(r.ttft_ms is not None for r in run.records)
