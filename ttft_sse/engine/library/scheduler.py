"""The batching loop's scheduler: the library's FIFO scheduler, counting what prefix sharing saves (in all and per
request), running the interludes (engine/first/interlude.py) between two steps over the cache read in place
(engine/library/in_place.py), switching the engine's mode between two steps (engine/modes.py), running prefills as
background work, giving urgent requests (the high lane's) the step's rows first, and telling a long prompt's progress.

**Urgent requests**: where they wait beside others, a step computes their prompts alone; where they and the others
want more rows than a step has (``max_requests_per_batch``), lower-lane decoding requests sit the step out, in turn
and each within its patience (engine/library/turns.py).

**Prefills** (``POST /prefill``, :meth:`BatchedEngine.prefill`) are requests of the library like any, marked in
:attr:`PrefixCounters.prefills`, which only ever get what real requests leave: a step holds them back (out of the
library's view for its choice, their blocks kept) while a real request waits in the library's queue, while their
``hold`` says a request waits for a slot at the gate, and where the rows a step takes are all the real requests'.
Beside a real prompt being computed, they come after it: the step's budget goes to the real one first. A step
computes at most :data:`PREFILL_STEP_TOKENS` of their prompts (beside decoding streams, the chunked-prefill bound),
so that a request that comes while a prefill computes waits for one short step at most.

A real request that arrives while a prefill computes its prompt (the user pressed Enter before the prefill ended)
**takes it over** (:meth:`CountingScheduler._take_over`): where the request's prompt holds every whole block the
prefill computes, the prefill leaves the library before the step is chosen, its blocks computed so far stay cached,
the request's prefix match finds them in that very step, and the request computes the rest at a request's pace, where
it would otherwise wait for the prefill to end at a prefill's. The prefill's caller is told how far it got
(``PrefixCounters.taken_over``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ttft_sse.engine.base import NORMAL, Progress
from ttft_sse.engine.library import internals
from ttft_sse.engine.library.paged_cache import BLOCK_TOKENS
from ttft_sse.engine.library.turns import Turns
from ttft_sse.engine.library.uses import PrefixUses
from ttft_sse.engine.modes import Modes

CHUNK_CONTEXT = 1024
"""Prompt tokens already computed up to which a chunk of prefill is ``TTFT_PREFILL_CHUNK_TOKENS`` rows; past it the
chunk shrinks in proportion, since each of its rows attends to every earlier key (see :func:`chunk_rows`)."""
MIN_CHUNK = 16
"""The fewest prompt rows a chunk computes: below it, a step's fixed cost would make a long prompt's prefill crawl."""
PREFILL_STEP_TOKENS = 128
"""The most prompt tokens of prefills a step computes while no stream decodes: a request that arrives meanwhile waits
for at most such a step (a few tens of ms on a small model), where a prompt's whole budget would be a second."""
PROGRESS_SECONDS = 0.25
"""The least time between two ``Progress`` of one request (the event loop sends at most a few a second)."""


def chunk_rows(chunk: int, position: int) -> int:
    """Prompt rows a step computes beside decoding streams, for a prompt with ``position`` tokens computed already:
    ``chunk`` up to :data:`CHUNK_CONTEXT`, then ``chunk * CHUNK_CONTEXT / position`` (at least :data:`MIN_CHUNK`),
    so that a chunk's attention, rows times keys, stays about the same however long the prompt grows."""
    if position <= CHUNK_CONTEXT:
        return chunk
    return max(min(chunk, MIN_CHUNK), chunk * CHUNK_CONTEXT // position)


@dataclass
class PrefixCounters:
    """Written by the loop's scheduler, read by :meth:`BatchedEngine.stats`. They outlive a restarted loop."""

    prompt_tokens: int = 0
    hits: int = 0
    hit_tokens: int = 0
    prefill_chunk: int = 0  # prompt tokens a step computes beside decoding streams (0: the whole token budget)
    modes: Modes | None = None  # where the engine has more than one mode: switched here, between two steps
    urgent: set[str] = field(default_factory=set)  # ids of requests prefilled before the others waiting (high lane)
    turns: Turns = field(default_factory=Turns)  # which lower-lane rows sit out a step for urgent ones (turns.py)
    hit_by_request: dict[str, int] = field(default_factory=dict)  # request id → its prompt tokens served from blocks
    seeds: dict[str, int] = field(default_factory=dict)  # request id → its cache salt's seed (engine/library/salts.py)
    prefills: dict[str, Callable[[], bool]] = field(default_factory=dict)  # prefill request id → its hold()
    chores: deque[Callable[[Any], None]] = field(default_factory=deque)  # run on the cache between two steps
    progress: Callable[[str, Progress], None] | None = None  # a long prompt's progress, to its request's inbox
    uses: PrefixUses = field(default_factory=PrefixUses)  # prompts seen and prefixes hit (the prefix store's)
    taken_over: Callable[[str, int], None] | None = None  # a prefill's id, its tokens in the cache: a request took it
    _told: dict[str, float] = field(default_factory=dict)  # request id → when its progress was last told


def scheduler_class(counters: PrefixCounters) -> type:
    """The library's FIFO scheduler, counting into ``counters``: the class the engine's batch processor is built with
    (engine/library/internals.py's ``build_processors``), one per engine, so that the counts reach the engine that
    asked. The cache it is given is the engine's (engine/library/paged_cache.py): where it reads in place, its
    ``in_place`` runs the interludes between two steps."""
    parts = internals.batching()
    request_status = parts.status

    class CountingScheduler(parts.fifo_scheduler):  # type: ignore[misc, name-defined]
        """FIFO (decoding requests first, then new ones in arrival order), counting what prefix sharing saved."""

        def __init__(self, cache: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(cache, *args, **kwargs)
            # The engine's cache (engine/library/paged_cache.py), where it reads in place. The state this class
            # rearranges (the active and waiting requests, the waiting queue's order) is the library's instance
            # attributes, checked at load (engine/library/internals.py's SCHEDULER_STATE).
            self._in_place: Any = getattr(cache, "in_place", None)

        def schedule_batch(self, token_budget: int, cache_budget: int) -> Any:
            # The coming step's mode, before anything of it is computed (the interlude below, the prefix matches, the
            # forward pass): the step in flight has ended, and the next is not begun.
            modes = counters.modes
            mode = modes.step() if modes is not None else None
            while counters.chores:  # pins and unpins of prefills' blocks (BatchedEngine.prefill)
                counters.chores.popleft()(self.cache)
            self._take_over()
            decoding = sum(state.status == request_status.DECODING for state in self.active_requests.values())
            # A newcomer that came after the last layer of the step just done (its output layer, sampling, this
            # preparation: the interludes' checks come before each layer) gets its first token from an interlude
            # here, between two steps, rather than in the coming step beside the streams' rows: its prompt is then
            # a prefix hit below. Only while streams decode: an idle batch's burst is the coming step's.
            in_place = self._in_place
            if decoding and in_place is not None and in_place.between is not None:
                in_place.between(in_place)
            if decoding and counters.prefill_chunk:
                token_budget = self._chunked(token_budget, decoding)
            aside = self._set_prefills_aside()
            if aside is not None and self._prefills_only():
                token_budget = min(token_budget, PREFILL_STEP_TOKENS)
            elif aside is not None:
                self._prefills_last()
            now = time.monotonic()
            later = self._hold_back_all_but_urgent()
            sitting = self._sit_out(now)
            try:
                scheduled = super().schedule_batch(token_budget, cache_budget)
            finally:
                if later:
                    # The library's step rebuilds the deque without those it scheduled: extend what it holds now.
                    self.waiting_requests_order.extend(i for i in later if i in self.waiting_requests)
                self.active_requests.update(sitting)
                if aside:
                    self._put_prefills_back(aside)
            if scheduled[0]:
                counters.turns.ran((future.state.request_id for future in scheduled[0]), now)
            if modes is not None and mode is not None and scheduled[0]:
                modes.saw((future.state.request_id for future in scheduled[0]), mode)
            if scheduled[0] and counters.progress is not None:
                self._tell_progress(scheduled[0])
            return scheduled

        def _set_prefills_aside(self) -> tuple[dict[str, Any], dict[str, Any], list[str]] | None:
            """Take the prefills out of the library's view for this step where a real request should have the step
            instead (module docstring); return them, to be put back after it, or None where no prefill is held.
            A prefill held keeps its blocks; the step's choice just does not see it."""
            prefills = counters.prefills
            if not prefills:
                return None
            real_waiting = any(i not in prefills for i in self.waiting_requests)
            real_active = sum(i not in prefills for i in self.active_requests)
            held = (
                real_waiting
                or real_active >= self.max_requests_per_batch
                or any(hold() for hold in list(prefills.values()))
            )
            if not held:
                return {}, {}, []
            active = {i: s for i, s in self.active_requests.items() if i in prefills}
            waiting = {i: s for i, s in self.waiting_requests.items() if i in prefills}
            order = [i for i in self.waiting_requests_order if i in prefills]
            for i in active:
                del self.active_requests[i]
            for i in waiting:
                del self.waiting_requests[i]
            if order:
                kept = [i for i in self.waiting_requests_order if i not in prefills]
                self.waiting_requests_order.clear()
                self.waiting_requests_order.extend(kept)
            return active, waiting, order

        def _take_over(self) -> None:
            """Each prefill whose whole blocks a real request waiting for its first step starts with (the same salt)
            leaves the library; its complete blocks stay cached, its caller is told (module docstring)."""
            prefills = counters.prefills
            if not prefills or counters.taken_over is None:
                return
            pending = request_status.PENDING
            real = [s for i, s in self.waiting_requests.items() if i not in prefills and s.status == pending]
            for request_id in list(prefills) if real else ():
                state = self.active_requests.get(request_id) or self.waiting_requests.get(request_id)
                if state is None:
                    continue
                ids, seed = state.initial_tokens, counters.seeds.get(request_id)
                blocks = (len(ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
                if blocks and any(
                    counters.seeds.get(r.request_id) == seed and r.initial_tokens[:blocks] == ids[:blocks] for r in real
                ):
                    self.active_requests.pop(request_id, None)
                    self.waiting_requests.pop(request_id, None)
                    if request_id in self.waiting_requests_order:
                        self.waiting_requests_order.remove(request_id)
                    self.cache.free_blocks(request_id)  # its whole blocks hashed: cached, as a cancelled request's
                    counters.taken_over(request_id, state.position_offset)

        def _prefills_last(self) -> None:
            """The prefills after the real requests in the order the step takes its active requests in."""
            for request_id in [i for i in self.active_requests if i in counters.prefills]:
                self.active_requests[request_id] = self.active_requests.pop(request_id)

        def _prefills_only(self) -> bool:
            """Every request the step may choose is a prefill (and there is one)."""
            ids = [*self.active_requests, *self.waiting_requests]
            return bool(ids) and all(i in counters.prefills for i in ids)

        def _put_prefills_back(self, aside: tuple[dict[str, Any], dict[str, Any], list[str]]) -> None:
            active, waiting, order = aside
            self.active_requests.update(active)
            self.waiting_requests.update(waiting)
            self.waiting_requests_order.extend(order)

        def _tell_progress(self, futures: Any) -> None:
            """A ``Progress`` for each real request whose prompt this step computes a part of, short of its end:
            the tokens in the cache before the step (at most one every :data:`PROGRESS_SECONDS`)."""
            now = time.monotonic()
            told = counters._told
            for future in futures:
                state = future.state
                if state.status != request_status.PREFILLING or state.request_id in counters.prefills:
                    continue
                if now - told.get(state.request_id, 0.0) < PROGRESS_SECONDS:
                    continue
                told[state.request_id] = now
                total = len(state.initial_tokens)
                before = total - len(state.remaining_prefill_tokens) - len(state.tokens_to_process)
                assert counters.progress is not None
                counters.progress(state.request_id, Progress(total, max(before, 0)))

        def _hold_back_all_but_urgent(self) -> list[str]:
            """Where urgent requests (the high lane's) wait beside others, leave the others out of this step's
            choice and return their ids, in order, to be put back after it: the urgent prompts are computed in a step
            of their own (one step sooner than beside a burst of others' prompts), the others in the next. Each
            once (engine/library/turns.py): held back before, it starts beside them, after them."""
            if not counters.urgent:
                return []
            order: deque[str] = self.waiting_requests_order
            if not any(i in counters.urgent for i in order):
                return []
            later = counters.turns.held(i for i in order if i not in counters.urgent)
            if later:
                held = set(later)
                urgent = [i for i in order if i in counters.urgent]
                due = [i for i in order if i not in counters.urgent and i not in held]
                order.clear()
                order.extend(urgent + due)
            return later

        def _sit_out(self, now: float) -> dict[str, Any]:
            """Where urgent requests (running, or waiting to start) and the others want more rows than the step has,
            take lower-lane decoding requests out of the library's view for this step, in turn
            (engine/library/turns.py); return them, to be put back after it. A request taken out keeps its blocks
            and its next input token: the library's step neither computes nor frees it. The lower lanes' prompts, in
            the step or waiting to start in it (none waits beside urgent ones: held back), keep their rows: their
            first token has not gone out."""
            urgent = counters.urgent
            if not urgent:
                return {}
            active = self.active_requests
            running = sum(i in urgent for i in active)
            wanted = running + sum(i in urgent for i in self.waiting_requests)
            if not wanted:
                return {}
            decoding = [i for i, s in active.items() if i not in urgent and s.status == request_status.DECODING]
            starting = sum(i not in urgent for i in self.waiting_requests_order)
            others = len(active) - running - len(decoding) + starting
            out = counters.turns.sit_out(self.max_requests_per_batch, wanted, decoding, others, now)
            return {i: active.pop(i) for i in out}

        def _chunked(self, token_budget: int, decoding: int) -> int:
            """Chunked prefill: beside streams that decode, a prompt longer than a step's budget (a document to
            summarise) is computed a chunk a step to its end, so that it cannot hold their next token for the time of
            a long pass; it takes more steps, each as short as a decode step plus the chunk. A prompt that fits one
            step's budget (a chat message, a system prompt) is computed in one step, as alone."""
            prompts = [s for s in self.active_requests.values() if s.status == request_status.PREFILLING]
            prompts += list(self.waiting_requests.values())
            if not any(len(s.initial_tokens) > token_budget - decoding for s in prompts):
                return token_budget
            deepest = max((s.position_offset for s in prompts), default=0)
            return min(token_budget, decoding + chunk_rows(counters.prefill_chunk, deepest))

        def _infer_request_tokens(self, state: Any, removed: set[str]) -> Any:
            # A prefix match moves a pending request to PREFILLING here, once.
            fresh = state.status == request_status.PENDING and not state.is_cpu_offloaded
            before = state.position_offset
            tokens = super()._infer_request_tokens(state, removed)
            if fresh and state.position_offset > before:
                counters.prompt_tokens += len(state.initial_tokens)
                counters.hits += 1
                counters.hit_tokens += state.position_offset - before
                counters.hit_by_request[state.request_id] = state.position_offset - before
                self._note_use(state, state.position_offset)
            return tokens

        def _schedule_request(self, state: Any, tokens: Any, budget: int, removed: set[str]) -> None:
            # A request without a prefix match is still PENDING when it is first scheduled.
            if state.status == request_status.PENDING:
                counters.prompt_tokens += len(state.initial_tokens)
                self._note_use(state, 0)
            super()._schedule_request(state, tokens, budget, removed)

        def _note_use(self, state: Any, hit: int) -> None:
            """The request's prompt, and the prefix of it found cached if any (engine/library/uses.py)."""
            seed, modes = counters.seeds.get(state.request_id), counters.modes
            mode = modes.current if modes is not None else NORMAL
            counters.uses.seen(state.initial_tokens, seed, mode)
            if hit:
                counters.uses.hit(state.initial_tokens[:hit], seed, mode)

    return CountingScheduler
