"""What the llama.cpp engine's event-loop side posts to its loop thread (engine/llamacpp/engine.py), and what the
loop hands back: commands, taken between two steps, and deliveries to a request's or a prefill's inbox."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ttft_sse.engine.base import Hold, SamplingParams
from ttft_sse.engine.llamacpp import library
from ttft_sse.engine.llamacpp.schedule import Schedule
from ttft_sse.errors import EngineError


@dataclass(frozen=True)
class Prefilled:
    """To a prefill's inbox: it ended, having computed ``tokens`` of its prompt's KV."""

    tokens: int


# (token, last, cached prompt tokens), a prefill's end, or why the request failed
Delivery = tuple[int, bool, int] | Prefilled | EngineError


@dataclass
class Submit:
    key: str
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Prefill:
    key: str
    prompt: tuple[int, ...]
    salt: str
    owner: str
    hold: Hold
    keep: float | None = None  # seconds its prompt is kept once done; None: TTFT_PREFILL_KEEP_SECONDS


@dataclass(frozen=True)
class Cancel:
    key: str


@dataclass(frozen=True)
class Visit:
    """Work for the loop's thread between two steps (the prefix store's copies): ``work(runner, schedule)``, whose
    result or exception goes to ``done``."""

    work: Callable[[library.Runner, Schedule], Any]
    done: concurrent.futures.Future[Any]


Command = Submit | Prefill | Cancel | Visit


def visit(command: Visit, runner: library.Runner, schedule: Schedule) -> None:
    """Run a visit's work and hand its result (or what it raised) to the waiting event loop."""
    if not command.done.set_running_or_notify_cancel():
        return  # its caller gave up waiting
    try:
        command.done.set_result(command.work(runner, schedule))
    except Exception as exc:
        command.done.set_exception(exc)
