"""Start-up stage clock: how long each stage of a cold start took, in the order they ran."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageClock:
    """Times named stages. ``with clock.stage("model"): ...``; ``clock.as_dict()`` gives ``{"model_ms": …}``.

    A stage that runs twice accumulates. The total runs from the clock's creation to the last stage's end, so
    time spent between stages (waiting for a thread, say) is counted in ``total_ms`` too.
    """

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._ended = self._started
        self._stages: dict[str, float] = {}
        self.current: str | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.current = name
        start = time.perf_counter()
        try:
            yield
        finally:
            self._ended = time.perf_counter()
            self._stages[name] = self._stages.get(name, 0.0) + (self._ended - start)
            self.current = None

    def seconds(self) -> dict[str, float]:
        return dict(self._stages)

    def as_dict(self) -> dict[str, float]:
        out = {f"{name}_ms": round(sec * 1000, 1) for name, sec in self._stages.items()}
        out["total_ms"] = round((self._ended - self._started) * 1000, 1)
        return out
