"""Which lower-lane generations sit out a step of the batch, so that the high lane's requests have its rows.

The batch computes at most ``max_requests_per_batch`` rows a step (the engine's rows: ``TTFT_MAX_CONCURRENCY`` and
``TTFT_HIGH_EXTRA_SLOTS``), and the gate admits the high lane up to that many generations of its own whatever the
other lanes hold (ttft_sse/admission/gate.py). Where urgent requests (the high lane's, running or waiting to start) and
the others' together want more rows than a step has, the scheduler (engine/library/scheduler.py) leaves lower-lane
*decoding* requests out of the step: their first token went out already, so a step left out costs them one token's
gap, and their answer is the same (each row is computed from its own inputs; a request left out keeps its KV blocks
and its next input token, and goes on from it at the next step it is in).

Where urgent prompts wait to start, the others' prompts are held back a step (engine/library/scheduler.py), each
once (:meth:`Turns.held`): under a steady stream of high arrivals, urgent prompts wait in most steps.

In turn: those that ran most recently sit out first, so that where ``k`` of ``n`` sit out each step, each sits out
about ``k`` steps in ``n``. Bounded: a request that has gone :data:`DUE_SHARE` of its patience without a step (its
lane's first-token target, ``SamplingParams.patience``; :data:`PATIENCE_SECONDS` for a lane without one) is not left
out again until it has run, so that no token of it waits longer than its patience; where that leaves too few rows, the
urgent requests waiting to start wait a step. A lower-lane prompt, being computed or starting in the step, keeps its
row (its first token has not gone out: it counts among ``others``), and an urgent request is never left out.

Plain Python over request ids and times: the scheduler hands it what it reads of the library's state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PATIENCE_SECONDS = 1.0
"""How long a lower-lane generation whose lane has no first-token target may go without a step, at most."""
STALE = 64
"""Times kept of requests that have left, past which they are dropped (a request can leave between a step's look at
it and its note)."""
DUE_SHARE = 0.5
"""The share of its patience after which a request left out runs in the next step: with that step's own time, its
token gap stays within its patience."""


@dataclass
class Turns:
    """The lower lanes' turns at the batch's rows. Written and read in the batching thread only (the engine adds and
    drops ``patience`` from the event loop, one dict operation at a time)."""

    patience: dict[str, float] = field(default_factory=dict)  # request id → seconds it may go without a step
    last_ran: dict[str, float] = field(default_factory=dict)  # request id → when a step last computed it
    sat_out: int = 0  # rows left out of steps, in all (each request once a step it sat out)
    _held_once: set[str] = field(default_factory=set)  # lower-lane prompts held back a step already

    def sit_out(self, rows: int, urgent: int, decoding: Sequence[str], others: int, now: float) -> list[str]:
        """The ids of ``decoding`` (the lower lanes' decoding requests, in the library's order) to leave out of the
        coming step of ``rows`` rows, where ``urgent`` rows go to the high lane's requests (running and waiting to
        start) and ``others`` to requests that are not left out (lower-lane prompts, computing or starting): as many
        as it takes for them all to fit, those that ran most recently first, none that is due (see the module)."""
        over = urgent + others + len(decoding) - rows
        if over <= 0:
            return []
        ready = [i for i in decoding if not self._due(i, now)]
        # Stable: among those that ran in the same step, the library's order (the oldest first).
        ready.sort(key=lambda i: self.last_ran.get(i, -math.inf), reverse=True)
        chosen = ready[:over]
        self.sat_out += len(chosen)
        return chosen

    def add(self, request_id: str, patience: float) -> None:
        """A lower-lane request comes to the engine: once its answer has begun, it may go ``patience`` seconds
        without a step."""
        self.patience[request_id] = patience

    def held(self, waiting: Iterable[str]) -> list[str]:
        """Of ``waiting`` (lower-lane requests whose prompt has not started), those that may wait a step for urgent
        prompts: those not held back before."""
        held = [i for i in waiting if i not in self._held_once]
        self._held_once.update(held)
        return held

    def ran(self, ids: Iterable[str], now: float) -> None:
        """The requests a step computes, as it is scheduled (of them, those that may sit out: with a patience)."""
        patience, last_ran = self.patience, self.last_ran
        for request_id in ids:
            if request_id in patience:
                last_ran[request_id] = now
        if len(last_ran) > len(patience) + STALE:  # one that left as it ran (forget, in another thread)
            for request_id in [i for i in last_ran if i not in patience]:
                last_ran.pop(request_id, None)
        if len(self._held_once) > len(patience) + STALE:
            self._held_once.intersection_update(patience)

    def forget(self, request_id: str) -> None:
        """A request has left the engine."""
        self.patience.pop(request_id, None)
        self.last_ran.pop(request_id, None)
        self._held_once.discard(request_id)

    def _due(self, request_id: str, now: float) -> bool:
        waited = now - self.last_ran.get(request_id, now)
        return waited >= DUE_SHARE * self.patience.get(request_id, PATIENCE_SECONDS)
