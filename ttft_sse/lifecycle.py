"""Where the process stands in its life: starting, ready, failed, stopping; and the errors that say so to clients.

One :class:`Lifecycle` per app, made by the runtime (ttft_sse/runtime.py) and handed to what must check it: the
generation path refuses newcomers while not ready or stopping, and cuts generations still running when the drain
grace is over (``cutting``). The start-up stage clock lives here too, so ``/readyz`` and ``/metrics`` can say which
stage a cold start is in and how long each took.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from ttft_sse.errors import ShuttingDown
from ttft_sse.stages import StageClock

State = Literal["starting", "ready", "failed", "stopping"]


class Lifecycle:
    """The app's state. ``failed`` is set once when the model cannot load (the CLI's shutdown trigger watches it)."""

    def __init__(self, *, drain_seconds: float) -> None:
        self.state: State = "starting"
        self.error: str | None = None
        self.failed = asyncio.Event()
        # Set once the server stops taking work (the drain, or the lifespan's end): what holds a connection open
        # between requests (a WebSocket waiting for its next prompt, api/chat.py) closes it instead.
        self.closing = asyncio.Event()
        self.cutting = False  # the drain grace is over: running generations are being cancelled
        self.clock = StageClock()
        self._drain_seconds = drain_seconds

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def fail(self, error: str) -> None:
        self.state = "failed"
        self.error = error
        self.failed.set()

    def stop_taking_work(self) -> None:
        """Refuse newcomers from now on: ``stopping`` (a ``failed`` state stays), and ``closing`` set."""
        if self.state != "failed":
            self.state = "stopping"
        self.closing.set()

    def not_ready_reason(self) -> str:
        if self.state == "starting":
            stage = self.clock.current or "starting"
            return f"the model is still loading (stage: {stage})"
        if self.state == "failed":
            return f"the model failed to load: {self.error}"
        return "the server is shutting down"

    def refusal(self) -> ShuttingDown:
        """The error for a request that arrives, or is still queued, once the drain has begun."""
        return ShuttingDown(
            "the server is shutting down and starts no new generations; nothing was generated, retry",
            retry_after=1,
            code="draining",
        )

    def cut(self) -> ShuttingDown:
        """The error that ends a generation still running when the drain grace is over."""
        return ShuttingDown(
            f"the server is shutting down: this generation was stopped when the {self._drain_seconds:g} s "
            "drain grace ran out; the text so far is incomplete, retry for a full answer",
            retry_after=1,
            code="drain_timeout",
        )

    def startup_report(self) -> dict[str, float]:
        return self.clock.as_dict()
