"""First-token targets per lane (``TTFT_SLA_MS``): refuse at once what would miss its target, and degrade to the
engine's faster mode (``TTFT_DEGRADE``) while a lane misses it.

* **Prediction at admission** (:meth:`Targets.check`): a newcomer that would wait for a slot gets its first token
  once a slot frees for it, plus the time from admission to a first token (the 90th percentile of the last
  :data:`WINDOW_SECONDS`). When the slot frees is played out, not averaged (:meth:`Targets.predict`): each running
  generation ends after the tokens it is expected still to make (its ``max_tokens`` times the share of their
  ``max_tokens`` that recent answers made, less what it has made) at the pace of a stream (its own once it has made
  a few tokens, else the recent answers' median seconds a token); the requests queued ahead of the newcomer, the
  ones admitted in the same instant included, take the slots as they free, each for its own expected time. The
  better lanes' arrivals over the last :data:`RATE_SECONDS` stretch that wait by the share of the slots they take.
  A burst is thus judged by the work already admitted, not by a history it does not have. When the predicted first
  token passes the lane's target the request is refused at once with a 503 that names the target, with
  ``Retry-After`` the predicted time until a slot is free for it; overflow jobs (``POST /jobs``) are the way to run
  it later. A newcomer with a slot free for it is admitted whatever the engine's pace. Until a first token has been
  measured (the warm-up's counts) nothing is refused. Every admitted request with a target is counted ``met`` or
  ``missed`` (``ttft_sse_first_token_targets_total``); one refused after it was admitted, because it waited as long
  as its target allows (the safety net: :meth:`Targets.queue_limit`), is counted in
  ``ttft_sse_late_refusals_total``: how often the prediction let in what it should have refused.
* **Degradation** (:class:`Degrader`): when a lane's first-token p99 over the last :data:`WINDOW_SECONDS` passes its
  target (from :data:`MIN_SAMPLES` first tokens), the engine switches to its faster mode for new steps; it switches
  back once, for :data:`RECOVER_SECONDS`, no lane's first tokens since the switch have passed :data:`MARGIN` of its
  target (hysteresis: a mode holds at least that long, so it does not flap). One log line and one count a switch.

The high lane's first tokens are kept within its target by the engine's rows, which it may fill with its own work
whatever the other lanes hold (the gate counts only its generations against them; the batched engine leaves
lower-lane generations out of steps in turn to give it their rows: engine/library/turns.py), by slots the gate may keep
for it (``TTFT_HIGH_RESERVED_SLOTS``) and by its place at the head of the queue: the batched engine takes a newcomer
into its next step, and computes its first token between two layers of the step in flight, so a row of the batch is
what a high request needs. For the high lane, the prediction plays out its own generations only.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from ttft_sse.admission.gate import KEY_LANES, Gate, Lane
from ttft_sse.errors import Overloaded

log = structlog.get_logger("ttft_sse.targets")

WINDOW_SECONDS = 30.0  # first tokens the p99 and the admission-to-first-token estimate are taken over
RATE_SECONDS = 10.0  # admissions the better lanes' arrival rates are counted over
MIN_SAMPLES = 10  # first tokens of a lane, in the window, before its p99 can switch the engine to its faster mode
RECOVER_SECONDS = 10.0  # how long first tokens must stay under MARGIN of their targets before switching back
MARGIN = 0.7  # of a lane's target, what its first tokens must stay under to switch back
ANSWERS = 32  # recent answers whose pace (seconds a token) and length (share of max_tokens) the prediction uses
OWN_PACE_TOKENS = 4  # tokens a running generation makes before its own pace is trusted over the recent answers'
NORMAL, FASTER = "normal", "int8"


def parse_targets(spec: str | None) -> dict[Lane, float]:
    """``"high:200,normal:1000,low:5000"`` → seconds by lane. Raises ValueError with a sentence naming the fault."""
    if not spec:
        return {}
    targets: dict[Lane, float] = {}
    for item in (part.strip() for part in spec.split(",")):
        label, sep, value = item.partition(":")
        lane = KEY_LANES.get(label.strip())
        if not sep or lane is None:
            raise ValueError(f"sla_ms takes lane:milliseconds pairs (lanes high, normal, low), got {item!r}")
        if lane in targets:
            raise ValueError(f"sla_ms names the {lane.label} lane twice")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"sla_ms's {lane.label} target must be a number of milliseconds, got {value!r}") from None
        if not (math.isfinite(milliseconds) and milliseconds > 0):
            raise ValueError(f"sla_ms's {lane.label} target must be more than 0 ms, got {value!r}")
        targets[lane] = milliseconds / 1000
    return targets


@dataclass(frozen=True)
class FirstToken:
    at: float  # when it was given (the monotonic clock of :class:`Targets`)
    lane: Lane
    seconds: float  # from the request's arrival
    engine_seconds: float | None  # from its admission (a slot); None for a request refused while it waited


class FirstTokens:
    """The first tokens of the last :data:`WINDOW_SECONDS`, oldest first."""

    def __init__(self) -> None:
        self._recent: deque[FirstToken] = deque()

    def add(self, token: FirstToken) -> None:
        self._recent.append(token)

    def since(self, start: float, lane: Lane | None = None) -> list[FirstToken]:
        return [t for t in self._recent if t.at >= start and (lane is None or t.lane is lane)]

    def trim(self, now: float) -> None:
        """Forget what is older than the window."""
        while self._recent and self._recent[0].at < now - WINDOW_SECONDS:
            self._recent.popleft()


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile by nearest rank: one of the values, never between two (a refused request's first token is
    ``inf``, and counts as slower than any)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Targets:
    """The lanes' first-token targets, the first tokens given, and the prediction made at admission."""

    def __init__(self, targets: dict[Lane, float], gate: Gate, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = targets
        self._gate = gate
        self._clock = clock
        self.recent = FirstTokens()
        self._arrivals: deque[tuple[float, Lane]] = deque()  # (when, lane) of requests let through check()
        self._paces: deque[float] = deque(maxlen=ANSWERS)  # seconds a token of a stream / sqrt(rows running)
        self._shares: deque[float] = deque(maxlen=ANSWERS)  # tokens made / max_tokens
        self._warm: float | None = None  # the warm-up's admission → first token, until traffic measures one

    def now(self) -> float:
        return self._clock()

    def engine_seconds(self) -> float | None:
        """The 90th percentile of admission → first token over the window (the warm-up's until traffic has made
        one); None before any first token."""
        self.recent.trim(self.now())
        seen = [t.engine_seconds for t in self.recent.since(-math.inf) if t.engine_seconds is not None]
        return quantile(seen, 0.9) if seen else self._warm

    def warmed(self, first_token_seconds: float, tokens: int, max_tokens: int, generating_seconds: float) -> None:
        """The warm-up's figures: its admission → first token (used until traffic measures one; never counted
        against a target) and its answer (:meth:`answered`)."""
        self._warm = first_token_seconds
        self.answered(tokens, max_tokens, generating_seconds)

    def answered(self, tokens: int, max_tokens: int, generating_seconds: float) -> None:
        """A finished answer of ``tokens`` (of ``max_tokens`` at most) that took ``generating_seconds`` from its
        first token to its end, while the generations running now ran beside it: the pace and the length the
        prediction expects of running generations."""
        if tokens >= 2:
            self._paces.append(generating_seconds / (tokens - 1) / math.sqrt(max(1, self._rows())))
        if max_tokens > 0:
            self._shares.append(min(1.0, tokens / max_tokens))

    def pace(self, rows: int = 1) -> float | None:
        """Seconds a token of a stream while ``rows`` generations run: the median of the last :data:`ANSWERS`
        answers', taken to grow with the square root of the rows (on the bundled model on 2 cores a stream's pace
        doubles from 1 to 12 rows: the root errs on the slow side, so that a burst after a calm spell, whose
        answers were made by few rows, is judged by a pace no faster than it will get); None before any answer."""
        if not self._paces:
            return None
        return statistics.median(self._paces) * math.sqrt(max(1, rows))

    def predict(self, lane: Lane, max_tokens: int = 0) -> float | None:
        """Seconds from now to the first token of a newcomer in ``lane`` that asks for ``max_tokens``; None while
        nothing has been measured. :meth:`slot_wait`, stretched, plus admission → first token.

        The stretch: the better lanes' newcomers are admitted before it while it waits; where they arrive at ``r`` a
        second and hold a slot ``h`` seconds each, they take ``r * h`` of its lane's ``n`` slots, so the queue ahead
        drains at ``1 - r * h / n`` of the pace (never, when they take all of it)."""
        engine = self.engine_seconds()
        wait = self.slot_wait(lane, max_tokens)
        if engine is None or wait is None:
            return None
        if wait == 0:
            return engine
        pace = self.pace(self._rows())
        hold = self._gate.service_seconds(lane) or (0.0 if pace is None else self._hold(max_tokens, engine, pace))
        taken = self._rate_above(lane) * hold / self._gate.usable(lane)
        return math.inf if taken >= 1 else wait / (1 - taken) + engine

    def slot_wait(self, lane: Lane, max_tokens: int = 0) -> float | None:
        """Seconds until a slot is free for a newcomer in ``lane``: 0 when one is now; else played out (see the
        module) where an answer's pace has been measured, else the gate's estimate by median hold times
        (:meth:`~ttft_sse.admission.gate.Gate.slot_wait`); None where neither is known."""
        gate = self._gate
        ahead = gate.ahead(lane)
        if not ahead and gate.counted(lane) < gate.usable(lane):
            return 0.0
        engine, pace = self.engine_seconds(), self.pace(self._rows())
        if engine is None or pace is None:
            return gate.slot_wait(lane)
        now = time.perf_counter()
        share = statistics.median(self._shares) if self._shares else 1.0
        ends: list[float] = []
        for ticket in gate.holders_for(lane):  # the high lane's own, for the high lane: the others sit out for it
            expected = max(1.0, share * ticket.max_tokens)
            if ticket.first_at is None:  # its first token is still to come
                since = now - (ticket.admitted_at or ticket.created)
                ends.append(max(0.0, engine - since) + (expected - 1) * pace)
                continue
            own = (now - ticket.first_at) / ticket.tokens if ticket.tokens >= OWN_PACE_TOKENS else pace
            ends.append(max(1.0, expected - ticket.tokens) * own)
        heapq.heapify(ends)
        waiting = [(t.lane, self._hold(t.max_tokens, engine, pace, share)) for t in ahead]
        running, clock = len(ends), 0.0
        for queued_lane, hold in waiting:
            while running >= gate.usable(queued_lane) and ends:
                clock, running = heapq.heappop(ends), running - 1
            heapq.heappush(ends, clock + hold)
            running += 1
        while running >= gate.usable(lane) and ends:
            clock, running = heapq.heappop(ends), running - 1
        return clock

    def _hold(self, max_tokens: int, engine: float, pace: float, share: float | None = None) -> float:
        """Expected seconds a request asking for ``max_tokens`` holds a slot: its first token, then the rest."""
        if share is None:
            share = statistics.median(self._shares) if self._shares else 1.0
        return engine + max(0.0, share * max_tokens - 1) * pace

    def _rows(self) -> int:
        """The rows a step of the engine computes now: the generations running, at most the engine's rows (past
        them, lower-lane generations sit steps out)."""
        return min(self._gate.running, self._gate.usable(Lane.HIGH))

    def _rate_above(self, lane: Lane) -> float:
        now = self.now()
        while self._arrivals and self._arrivals[0][0] < now - RATE_SECONDS:
            self._arrivals.popleft()
        return sum(other < lane for _, other in self._arrivals) / RATE_SECONDS

    def check(self, lane: Lane, max_tokens: int = 0, *, arrival: bool = True) -> None:
        """Refuse (``Overloaded``) a newcomer in ``lane`` that would wait for a slot and whose first token is then
        predicted past the lane's target. With a slot free for it, it is admitted: waiting is what refusing at once
        spares a client, and where the engine alone is slower than a target, the degrader is the remedy.
        ``arrival=False``: a look before the request is prepared, not counted among the lanes' arrivals."""
        target = self.targets.get(lane)
        if target is not None and (wait := self.slot_wait(lane, max_tokens)):
            predicted = self.predict(lane, max_tokens)
            if predicted is not None and predicted > target:
                raise self._refusal(lane, target, predicted, wait)
        if arrival:
            self._arrivals.append((self.now(), lane))

    def queue_limit(self, lane: Lane) -> tuple[float | None, Callable[[], Overloaded] | None]:
        """How long a queued request of ``lane`` may wait for a slot before its first token can no longer meet the
        target (the target less admission → first token), and the refusal it then gets; (None, None) without a
        target. The prediction errs; this bounds how long an admitted request is kept waiting."""
        target = self.targets.get(lane)
        if target is None:
            return None, None
        waited = max(0.0, target - (self.engine_seconds() or 0.0))
        return waited, lambda: self._refusal(lane, target, None)

    def _refusal(self, lane: Lane, target: float, predicted: float | None, wait: float | None = None) -> Overloaded:
        """The 503 for ``lane``: at admission, with the ``predicted`` first token and ``wait`` (seconds until a slot
        is free for it: the Retry-After); or after a wait, without."""
        if predicted is None:
            when = "can no longer come in time after this wait"
        elif math.isfinite(predicted):
            when = f"would come in about {predicted * 1000:.0f} ms"
        else:
            when = "cannot come in time (the better lanes take every slot)"
        room = wait if wait is not None and predicted is not None and math.isfinite(predicted) else None
        return Overloaded(
            f"the first token {when}, past the {lane.label} lane's target of {target * 1000:.0f} ms "
            "(TTFT_SLA_MS); retry later, or POST the same body to /jobs to run it when there is room",
            retry_after=min(60.0, max(1.0, room)) if room is not None else self._gate.retry_after(lane),
            code="first_token_target",
        )

    def missed(self, lane: Lane) -> None:
        """A request of ``lane`` refused after waiting for a slot: a first token it never got, which the degrader
        counts as slower than any (the prediction let it in; the engine's pace kept it out)."""
        self.recent.add(FirstToken(self.now(), lane, math.inf, None))

    def observe(self, lane: Lane, seconds: float, engine_seconds: float) -> bool | None:
        """Record a first token; returns whether it met its lane's target (None for a lane without one)."""
        self.recent.add(FirstToken(self.now(), lane, seconds, engine_seconds))
        target = self.targets.get(lane)
        return None if target is None else seconds <= target


class Switchable(Protocol):
    """What degradation needs of an engine: its current mode, and a switch that takes effect for new steps."""

    @property
    def mode(self) -> str: ...

    def set_mode(self, mode: str) -> None: ...


class Degrader:
    """Switches ``engine`` to its faster mode while a lane's first-token p99 is over its target (see the module)."""

    def __init__(self, targets: Targets, engine: Switchable, *, faster: str = FASTER) -> None:
        self._targets = targets
        self._engine = engine
        self._faster = faster
        self.degraded = False
        self.switches = 0
        self._since = targets.now()  # when the current mode began

    def evaluate(self) -> None:
        """Switch if the first tokens say so; called at each first token and once a second."""
        targets, now = self._targets, self._targets.now()
        targets.recent.trim(now)
        if not self.degraded:
            # Only first tokens made since the last switch: those of the other mode say nothing of this one.
            start = max(now - WINDOW_SECONDS, self._since)
            for lane, target in targets.targets.items():
                seen = [t.seconds for t in targets.recent.since(start, lane)]
                if len(seen) >= MIN_SAMPLES and (p99 := quantile(seen, 0.99)) > target:
                    worst = "a refused request's" if math.isinf(p99) else f"{p99 * 1000:.0f} ms"
                    self._switch(
                        True,
                        f"the {lane.label} lane's first-token p99 is {worst}, over its {target * 1000:.0f} ms target",
                    )
                    return
            return
        if now - self._since < RECOVER_SECONDS:
            return
        recent = now - RECOVER_SECONDS
        for lane, target in targets.targets.items():
            if any(t.seconds > MARGIN * target for t in targets.recent.since(max(recent, self._since), lane)):
                return
        self._switch(False, f"first tokens stayed under {MARGIN:.0%} of their targets for {RECOVER_SECONDS:g} s")

    def _switch(self, degraded: bool, reason: str) -> None:
        self._engine.set_mode(self._faster if degraded else NORMAL)
        self.degraded = degraded
        self.switches += 1
        self._since = self._targets.now()
        log.warning("degraded" if degraded else "recovered", mode=self._engine.mode, reason=reason)
