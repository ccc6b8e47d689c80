"""The path every generating surface shares: validate → tokenize → admit → stream → time → log.

``Generations.open`` does everything that can fail with a status code (not ready, shutting down, bad prompt,
no room) before a response header is sent: ``prepare`` (readiness, tokenizer, length) then ``admit`` (a gate
ticket in the caller's lane). Overflow jobs call the two apart: prepared at submission, so a bad prompt is a 400
at once, and admitted in the jobs lane when a runner takes them.

``Run.events`` then yields ``Queued`` (while waiting for a slot), ``Piece`` items and one ``Finished`` whose
timings hold the request's whole story: queue wait, prefill, time to first token, total. ``Run.progress_events``
yields the same and, between ``Queued`` and the first ``Piece``, ``Progress`` while a long prompt is computed (at most
one every :data:`PROGRESS_SECONDS`), for the surfaces that show it (``/stream``, resumable streams). On shutdown it
raises ``ShuttingDown`` instead: at once for a request still queued, and at the end of the drain grace for one still
generating (see ``ttft_sse.runtime.Runtime.drain``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial

import anyio
import structlog

from ttft_sse.admission import isolation
from ttft_sse.admission.auth import Caller
from ttft_sse.admission.gate import Gate, Lane, Ticket
from ttft_sse.admission.targets import Degrader, Targets
from ttft_sse.engine.base import Engine, Finished, Piece, Progress, Prompt, SamplingParams
from ttft_sse.errors import EngineError, NotReady, Overloaded, PromptTooLong
from ttft_sse.lifecycle import Lifecycle
from ttft_sse.metrics import Metrics, Outcome, outcome_of
from ttft_sse.schemas import GenerationRequest

log = structlog.get_logger("ttft_sse.generation")

PROGRESS_SECONDS = 0.25
"""The least time between two ``Progress`` events of one run: a page shows progress, a few updates a second."""


@dataclass(frozen=True)
class Queued:
    position: int


Event = Queued | Piece | Finished


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request, not yet admitted: what ``Generations.admit`` (or a job) takes."""

    prompt: Prompt
    params: SamplingParams


class Generations:
    """Opens runs: checks the ``lifecycle``, prepares the prompt on the ``engine``, takes a ``gate`` ticket, and
    records each request on ``metrics``."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        engine: Engine,
        gate: Gate,
        metrics: Metrics,
        *,
        default_max_tokens: int,
        max_prompt_tokens: int = 0,
        targets: Targets | None = None,
        degrader: Degrader | None = None,
        prefix_isolation: str = isolation.SHARED,
    ) -> None:
        self._lifecycle = lifecycle
        self._isolation = prefix_isolation  # TTFT_PREFIX_ISOLATION: whose requests share prefix-cache blocks
        self._engine = engine
        self._gate = gate
        self._metrics = metrics
        self._default_max_tokens = default_max_tokens
        self._max_prompt_tokens = max_prompt_tokens  # 0: the model's context is the only bound
        self._targets = targets  # first-token targets by lane (TTFT_SLA_MS), if any
        self._degrader = degrader  # the switch to the engine's faster mode (TTFT_DEGRADE), if any

    async def open(
        self,
        request: GenerationRequest,
        *,
        caller: Caller,
        arrival: float,
        endpoint: str,
        check_ready: bool = True,
        record: bool = True,
    ) -> Run:
        """Everything that can be refused with a status code, before a response starts: ``prepare``, then
        ``admit`` in ``caller``'s lane (a slot, a queue place, or ``Overloaded``).

        ``endpoint`` labels the request's metrics; ``record=False`` keeps it out of them (the warm-up).
        """
        try:
            if self._targets is not None and caller.lane is not Lane.JOBS and record and self._lifecycle.ready:
                # Refused before the prompt is tokenized, where the prediction already says so: under a burst a
                # refusal then comes within milliseconds, and costs the requests admitted no CPU. Checked again,
                # with the prompt's own max_tokens, once it is prepared.
                self._targets.check(caller.lane, request.max_tokens or self._default_max_tokens, arrival=False)
            prepared = await self.prepare(request, check_ready=check_ready)
            return self.admit(prepared, caller=caller, arrival=arrival, endpoint=endpoint, record=record)
        except Exception as exc:
            if record:
                self._metrics.observe_refused(endpoint, exc)
            raise

    async def prepare(self, request: GenerationRequest, *, check_ready: bool = True) -> Prepared:
        """Everything that can refuse a request as the client's fault: readiness, template, tokenizer, length."""
        lifecycle = self._lifecycle
        if lifecycle.state == "stopping":
            raise lifecycle.refusal()
        if check_ready and not lifecycle.ready:
            raise NotReady(lifecycle.not_ready_reason(), retry_after=5)
        engine = self._engine
        prompt = await anyio.to_thread.run_sync(
            partial(
                engine.prepare,
                prompt=request.prompt,
                messages=request.messages,
                raw=request.raw,
                parse_special=request.raw and request.parse_special,
            )
        )
        cap = self._max_prompt_tokens
        if cap and prompt.n_tokens > cap:
            raise PromptTooLong(
                f"the prompt is {prompt.n_tokens} tokens; this server takes at most {cap} prompt tokens a request "
                "(TTFT_MAX_PROMPT_TOKENS): shorten it",
                param="messages" if request.prompt is None else "prompt",
                code="prompt_too_long",
            )
        params = request.sampling(
            prompt_tokens=prompt.n_tokens,
            context_length=engine.info.context_length,
            default_max_tokens=self._default_max_tokens,
        )
        return Prepared(prompt, params)

    def admit(self, prepared: Prepared, *, caller: Caller, arrival: float, endpoint: str, record: bool = True) -> Run:
        """Take a gate ticket in ``caller``'s lane. Job-lane tickets are patient (no deadline, no queue place).

        With first-token targets, a request whose first token is predicted past its lane's target is refused here
        (``Overloaded``), before it takes a slot or a queue place; one queued is refused once it has waited as long as
        its target allows."""
        wait = late = None
        max_tokens = prepared.params.max_tokens
        if self._targets is not None and caller.lane is not Lane.JOBS and record:
            self._targets.check(caller.lane, max_tokens)
            wait, late = self._targets.queue_limit(caller.lane)
        ticket = self._gate.reserve(
            caller.lane, patient=caller.lane is Lane.JOBS, wait=wait, late=late, max_tokens=max_tokens
        )
        salt = isolation.cache_salt(self._isolation, caller.key_id, prepared.params.cache_salt)
        return Run(
            self._lifecycle,
            self._engine,
            self._metrics,
            self._targets,
            self._degrader,
            prepared.prompt,
            replace(prepared.params, cache_salt=salt),
            ticket,
            caller=caller,
            arrival=arrival,
            endpoint=endpoint,
            record=record,
        )


class Run:
    """One admitted (or queued) generation. Iterate :meth:`events` once; closing it early cancels generation."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        engine: Engine,
        metrics: Metrics,
        targets: Targets | None,
        degrader: Degrader | None,
        prompt: Prompt,
        params: SamplingParams,
        ticket: Ticket,
        *,
        caller: Caller,
        arrival: float,
        endpoint: str,
        record: bool = True,
    ) -> None:
        self._lifecycle = lifecycle
        self._engine = engine
        self._targets = targets
        self._degrader = degrader
        self.caller = caller
        self.prompt = prompt
        # The high lane's requests are urgent; the others may sit out a batch step for them, each for at most its
        # lane's first-token target (a lane without one: the engine's default).
        patience = targets.targets.get(caller.lane) if targets is not None else None
        self.params = replace(params, urgent=caller.lane is Lane.HIGH, patience=patience)
        self._ticket = ticket
        self._arrival = arrival
        self._endpoint = endpoint
        self._record = record  # False: the warm-up, which the targets learn a pace from but count nothing of
        self._metrics = metrics.request(endpoint, arrival=arrival, record=record)

    def close(self) -> None:
        """Give back the gate ticket. ``events`` does this itself; call it where ``events`` may never start."""
        self._ticket.release()
        self._metrics.observe_ended("cancelled")  # a no-op once ``events`` has counted the request

    def _waited_too_long(self, exc: Overloaded) -> None:
        """A queued request refused at its lane's first-token deadline: a miss, for the targets and the degrader."""
        if self._targets is not None and exc.code == "first_token_target" and self._record:
            self._targets.missed(self.caller.lane)
            self._metrics.observe_target(self.caller.lane.label, False)
            self._metrics.observe_late_refusal(self.caller.lane.label)
            if self._degrader is not None:
                self._degrader.evaluate()

    def _first_token(self, at: float) -> None:
        """Record the first token against the lane's target, and let the degrader look at the first tokens."""
        if self._targets is not None and self._record:
            admitted = self._ticket.admitted_at or self._ticket.created
            met = self._targets.observe(self.caller.lane, at - self._arrival, at - admitted)
            if met is not None:
                self._metrics.observe_target(self.caller.lane.label, met)
        if self._degrader is not None:
            self._degrader.evaluate()

    def _answered(self, finished: Finished, first_at: float, now: float) -> None:
        """Tell the targets an answer's pace and length (the warm-up's also its first token's time)."""
        if self._targets is None:
            return
        tokens, generating = finished.usage.completion_tokens, now - first_at
        if self._record:
            self._targets.answered(tokens, self.params.max_tokens, generating)
        else:
            admitted = self._ticket.admitted_at or self._ticket.created
            self._targets.warmed(first_at - admitted, tokens, self.params.max_tokens, generating)

    async def events(self) -> AsyncGenerator[Event, None]:
        async with aclosing(self._events(progress=False)) as events:
            async for event in events:
                assert not isinstance(event, Progress)
                yield event

    async def progress_events(self) -> AsyncGenerator[Event | Progress, None]:
        async with aclosing(self._events(progress=True)) as events:
            async for event in events:
                yield event

    async def _events(self, *, progress: bool) -> AsyncGenerator[Event | Progress, None]:
        outcome: Outcome = "cancelled"
        failure: BaseException | None = None
        first_at: float | None = None
        finished: Finished | None = None
        metrics = self._metrics
        told = 0.0  # when the last Progress was yielded
        try:
            try:
                async for position in self._ticket.wait():
                    yield Queued(position)
            except Overloaded as exc:
                self._waited_too_long(exc)
                raise
            queue_s = self._ticket.waited
            metrics.observe_admitted(queue_s)
            if self._lifecycle.cutting:
                raise self._lifecycle.cut()
            async with aclosing(self._engine.stream(self.prompt, self.params)) as items:
                async for item in items:
                    now = time.perf_counter()
                    if isinstance(item, Progress):
                        if progress and first_at is None and now - told >= PROGRESS_SECONDS:
                            told = now
                            yield item
                        continue
                    if isinstance(item, Finished):
                        timings = {
                            "queue_ms": round(queue_s * 1000, 1),
                            **item.timings,
                            "ttft_ms": round(((first_at or now) - self._arrival) * 1000, 1),
                            "total_ms": round((now - self._arrival) * 1000, 1),
                        }
                        finished = replace(item, timings=timings)
                        if first_at is None:  # no text at all: the end is the first thing the client gets
                            self._first_token(now)
                        self._answered(finished, first_at or now, now)
                        metrics.observe_finished(finished, now)
                        outcome = "ok"
                        yield finished
                        return
                    if first_at is None:
                        first_at = now
                        self._first_token(now)
                    self._ticket.produced(1, now)
                    metrics.observe_piece(now)
                    yield item
            # The engine ended without a Finished: something cancelled it from outside. The only thing that does
            # is the drain deadline (``engine.close()``); say so to the client rather than just stopping.
            lifecycle = self._lifecycle
            raise lifecycle.cut() if lifecycle.cutting else EngineError("generation ended without a result")
        except BaseException as exc:
            if finished is None:  # closed after its Finished was handed over: that generation still finished
                outcome, failure = outcome_of(exc), exc
            raise
        finally:
            self._ticket.release()
            metrics.observe_ended(outcome, failure)
            fields: dict[str, object] = {
                "endpoint": self._endpoint,
                "outcome": outcome,
                "lane": self.caller.lane.label,
                "key_id": self.caller.key_id,
                "prompt_tokens": self.prompt.n_tokens,
                "max_tokens": self.params.max_tokens,
            }
            if finished is not None:
                fields.update(
                    finish_reason=finished.finish_reason,
                    completion_tokens=finished.usage.completion_tokens,
                    cached_tokens=finished.usage.cached_tokens,
                    **finished.timings,
                )
            elif first_at is not None:
                fields["ttft_ms"] = round((first_at - self._arrival) * 1000, 1)
            log.info("generation", **fields)
