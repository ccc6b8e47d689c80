"""The batched engine: concurrent requests share the forward passes of transformers' continuous batching.

One long-lived loop (transformers' ``ContinuousBatchingManager``) runs a forward pass per step over every request it
holds, prompts and answers alike, each with its own paged KV cache; a newcomer joins the very next step. Complete KV
blocks are hashed, and a later prompt that starts with the same tokens shares them (its first token costs its new
tokens only); blocks no request holds stay for reuse until ``kv_cache_tokens`` runs short.

The library does the batching, the paged cache and the prefix sharing. Written here, because it lacks them:

* **routing** (:class:`~ttft_sse.engine.threads.Mailboxes`): each step's results go to the event loop in one
  ``call_soon_threadsafe``, those of requests that left dropped (the library's router keeps a cancelled request's
  callback for ever); results that can wait are posted as the next step's decoder layers run in C (batched/held.py);
* **stop sequences and text** (:class:`~ttft_sse.engine.text.TokenText`), as the single-request engine frames them;
* **a loop that died**: every waiting request checks that the loop is alive; the next request restarts it;
* **what the library's scheduler does not know** (engine/library/scheduler.py): prefix hits counted (in all and per
  request), prefills (``POST /prefill``, engine/batched/pins.py) run only in what real requests leave, isolation by
  cache salt (engine/library/salts.py), a long prompt's ``Progress``, and the high lane's rows
  (engine/library/turns.py: lower-lane answers sit steps out in turn, each within ``SamplingParams.patience``);
* **attention request by request, in place** (engine/kernels/attention.py, engine/library/in_place.py): each request's
  rows attend to its own keys, read in the paged cache where the library would gather every layer's keys;
* **first tokens beside the batch** (engine/first/): between two layers of the step in flight, or in a second process
  on the other core; whichever has it first gives it (:class:`Claims`), and the batch's step is made to pick that token
  (:func:`~ttft_sse.engine.library.selection.selection`), so the batch goes on from the token the client saw;
* **per-request token selection** (:func:`~ttft_sse.engine.library.selection.selection`): greedy rows take the step's
  argmax (engine/kernels/argmax.py on CPU); only sampled rows are cut and drawn, by engine/sampling.py.

Modes (``TTFT_DEGRADE=int8``, engine/modes.py): :meth:`BatchedEngine.set_mode` takes effect at the next step
the loop prepares; ``Finished.degraded`` says whether any of a request's tokens was computed in int8 rows.

Not batched, on purpose: a request with a ``seed`` (the library draws a batch from one generator) or too long for the
shared cache runs on :class:`~ttft_sse.engine.single.SingleEngine` over the same loaded model (engine/loaded.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import structlog

from ttft_sse.engine.base import (
    NORMAL,
    Finished,
    Hold,
    ModelInfo,
    Piece,
    Progress,
    Prompt,
    SamplingParams,
)
from ttft_sse.engine.batched import memory
from ttft_sse.engine.batched.held import Held
from ttft_sse.engine.batched.pins import Pins
from ttft_sse.engine.batched.prefix_store import PrefixStore
from ttft_sse.engine.batched.stats import BatchStats
from ttft_sse.engine.first.beside import start_beside
from ttft_sse.engine.first.claims import Arrivals, Claims, FirstToken
from ttft_sse.engine.first.interlude import Interlude
from ttft_sse.engine.first.process import PrefillProcess
from ttft_sse.engine.first.race import Race
from ttft_sse.engine.library import grouped, hooks, internals, salts
from ttft_sse.engine.library.in_place import StepHooks
from ttft_sse.engine.library.paged_cache import BLOCK_TOKENS
from ttft_sse.engine.library.scheduler import PrefixCounters
from ttft_sse.engine.library.turns import PATIENCE_SECONDS
from ttft_sse.engine.loaded import CacheJanitor, LoadedModel, OnLoadedModel
from ttft_sse.engine.modes import Modes
from ttft_sse.engine.single import SingleEngine
from ttft_sse.engine.text import TokenText
from ttft_sse.engine.threads import Idle, Mailboxes, Resident
from ttft_sse.errors import EngineError
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

log = structlog.get_logger("ttft_sse.engine")

Item = Progress | Piece | Finished

# How many recent steps ``batch_log`` keeps.
BATCH_LOG_STEPS = 512


class BatchedEngine(OnLoadedModel):
    """Engine over transformers' continuous batching, on a :class:`LoadedModel` it loads; its requests that are not
    batched run on a :class:`SingleEngine` over the same model."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._loaded = LoadedModel(settings)
        self._single = SingleEngine(settings, self._loaded)
        self._manager: Any = None
        self._populator = Idle(name="ttft-kv-populate")  # the paged cache's pages faulted in (memory.populate)
        self._loop: Resident | None = None
        self._mailboxes: Mailboxes[str, Any] = Mailboxes(alive=self._alive, dead=self._dead)
        self._ids = itertools.count(1)
        self._closed = False
        self._capacity = 0
        self._counters = PrefixCounters(prefill_chunk=settings.prefill_chunk_tokens)
        self._in_place = False  # the loop's cache reads in place (engine/library/in_place.py): set as the loop starts
        self.batch_log: deque[tuple[str, ...]] = deque(maxlen=BATCH_LOG_STEPS)
        """The request ids that received a token, step by step (the most recent ``BATCH_LOG_STEPS`` steps)."""
        self._steps = 0
        self._prefill: PrefillProcess | Interlude | None = None  # what races the batch for first tokens, if any
        self._claims = Claims()
        self._race: Race | None = None  # asks self._prefill for first tokens
        self._side_first = 0
        self._interlude_first = 0
        self._batching_off: str | None = None  # why requests run on the single engine, where they must
        self._modes = Modes((NORMAL,))  # the model's modes, once loaded
        self._held = Held(self._post)  # a step's outputs, posted as the next step's layers go into C
        self._counters.progress = self._progress
        self._interlude_held: dict[str, int] = {}  # request id → the tokens the cache held when an interlude ran it
        self._pins = Pins(self._counters, self._mailboxes, self._ids, settings.prefill_keep_seconds)
        self._prefix_store = PrefixStore(settings, self._counters, self._pins)

    @property
    def info(self) -> ModelInfo:
        if self._batching_off is not None:
            beside = f"none: one generate per request ({self._batching_off})"
        elif self.interludes is not None:
            beside = f"interludes {self.interludes.state}"
        elif self.prefill_process is not None:
            beside = f"prefill-process {self.prefill_process.state}"
        else:
            beside = "none"
        return dataclasses.replace(self._loaded.info, beside_batch=beside, engine="batched")

    @property
    def active(self) -> int:
        return self._single.active + self._mailboxes.count

    @property
    def mode(self) -> str:
        return self._modes.wanted

    def set_mode(self, mode: str) -> None:
        """New steps take ``mode``: the batch's from its next step, the single engine's from its next generation."""
        self._single.set_mode(mode)  # ValueError for a mode the model lacks
        self._modes.want(mode)

    @property
    def model(self) -> Any:
        return self._loaded.model

    @property
    def janitor(self) -> CacheJanitor:
        """The loaded model's: batched and unbatched generations count towards the same N."""
        return self._loaded.janitor

    @property
    def tokenizer(self) -> Any:
        return self._loaded.tokenizer

    @property
    def prefill_process(self) -> PrefillProcess | None:
        """The prefill process, if the engine started one (engine/first/process.py)."""
        return self._prefill if isinstance(self._prefill, PrefillProcess) else None

    @property
    def interludes(self) -> Interlude | None:
        """The interludes, if the engine runs them (engine/first/interlude.py)."""
        return self._prefill if isinstance(self._prefill, Interlude) else None

    # -- loading -----------------------------------------------------------------------------------------------

    def load(self, clock: StageClock) -> None:
        self._loaded.load(clock)
        self._modes = Modes(self.info.modes)
        self._counters.modes = self._modes if len(self._modes.modes) > 1 else None
        missing = internals.missing()
        if missing:
            self._off(missing)
            return
        hooks.keep_config_causal(self.model)
        self._prefill = start_beside(self._settings, self.model, self.info, self._counters.seeds)  # before the loop
        if self._prefill is not None:
            self._race = Race(self._prefill, self._claims, self._modes, self._mailboxes.deliver)
        with clock.stage("batching"):
            try:
                self._manager = self._create_manager(paged=grouped.paged(self.model))
            except hooks.Unbatched as exc:
                if self._prefill is not None:
                    self._prefill.stop()
                self._prefill = self._race = None
                self._off(exc.missing)
                return
            self._loop = Resident(
                name="ttft-batch",
                start=self._start_manager,
                stop=self._stop_manager,
                alive=lambda: bool(self._manager.is_running()),
            )
            self._loop.start()

    def _off(self, missing: list[str]) -> None:
        """Every request runs on the single engine (its capacity stays 0): slower, never wrong."""
        import transformers

        self._batching_off = f"transformers {transformers.__version__} lacks what the batching hooks use"
        log.warning("batching_off", reason=self._batching_off, missing=missing)

    def _create_manager(self, *, paged: bool) -> Any:
        import math

        import torch

        blocks = math.ceil((self.info.kv_cache_tokens or self._settings.kv_cache_tokens) / BLOCK_TOKENS)
        # Where the cache reads in place: a step's outputs posted as its layers go into C, the interludes between them.
        side = self._prefill if isinstance(self._prefill, Interlude) else None
        between, waiting = (side.serve, side.waiting) if side is not None else (None, None)
        steps = StepHooks(self._held.release, between, waiting) if paged else None
        manager = hooks.create_manager(
            self._loaded,
            self._settings,
            blocks=blocks,
            counters=self._counters,
            deliver=self._deliver,
            claims=self._claims,
            steps=steps,
            zeros=lambda size: memory.lazy_zeros(size, torch),
            made=self._made,
        )
        self._capacity = blocks * BLOCK_TOKENS  # 0 until then: every request goes to the single engine
        self._pins.attach(manager, self._capacity)
        return manager

    def _made(self, processor: Any) -> None:
        """The loop's thread, its batch processor built: whether its cache reads in place; on CPU, its pages faulted in
        at idle priority while no request runs (memory.populate)."""
        self._in_place = getattr(processor.cache, "in_place", None) is not None
        tensor = getattr(processor.cache, "cache_tensor", None)  # an instance attribute of the library's cache
        if tensor is not None and tensor.device.type == "cpu":
            self._populator.run(functools.partial(memory.populate, tensor, lambda: self._mailboxes.count > 0))

    def _start_manager(self) -> None:
        import torch

        # The loop runs in the inference mode of the thread that starts it.
        with torch.inference_mode():
            self._manager.start()

    def _stop_manager(self) -> None:
        # A hard stop: requests still in the loop are failed (nobody reads them any more: close() ended them).
        # The library's stop drops its batch processor, and with it the KV cache, before it returns; a helper thread
        # of the kernel may still be inside a chunk of the last step's attention, taken back from it, reading that
        # cache (helpers.c). So the processor is held until the helpers are out of their chunks.
        processor = getattr(self._manager, "batch_processor", None)
        try:
            self._manager.stop(block=True, timeout=30, hard_stop=True)
        finally:
            self._loaded.fence_kernel()
            del processor

    # -- requests ----------------------------------------------------------------------------------------------

    def cached(self, prompt: Prompt, cache_salt: str = "") -> int:
        return self._pins.cached(prompt, cache_salt)

    async def prefill(self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None) -> int:
        """Compute ``prompt`` into the prefix cache as background work and pin its blocks (engine/batched/pins.py).
        Nothing where prompts are not shared (no prefix cache, batching off, too long)."""
        if self._batching_off is not None or not self._settings.prefix_cache or not self._pins.fits(prompt):
            return 0
        await self._running()
        return await self._pins.prefill(prompt, cache_salt=cache_salt, owner=owner, hold=hold)

    async def warm(self, prompt: Prompt) -> int:
        """Compute ``prompt`` into the prefix cache and keep its blocks for good (``TTFT_WARM_PROMPTS``), within
        the warm prompts' share of the cache (engine/batched/pins.py); the tokens kept (0: not kept)."""
        if self._batching_off is not None or not self._settings.prefix_cache or not self._pins.fits(prompt):
            return 0
        await self._running()
        return prompt.n_tokens if await self._pins.warm(prompt) else 0

    async def store_prefixes(self) -> None:
        """The pinned and most used prefixes' KV to the cache directory (engine/batched/prefix_store.py)."""
        if self._batching_off is None and self._settings.prefix_cache and not self._closed:
            await self._prefix_store.store(self._manager, self.info)

    async def restore_prefixes(self) -> None:
        """The prefixes of the last drain back into the prefix cache (engine/batched/prefix_store.py)."""
        if self._batching_off is None and self._settings.prefix_cache and not self._closed:
            await self._running()
            await self._prefix_store.restore(self._manager, self.info)

    async def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Item, None]:
        # The last prompt token and every generated token but the last need a cache slot; keep one block of slack.
        fits = prompt.n_tokens + params.max_tokens <= self._capacity - BLOCK_TOKENS
        batched = fits and (params.greedy or params.seed is None)
        source = self._batched(prompt, params) if batched else self._single.stream(prompt, params)
        async with aclosing(source) as items:
            async for item in items:
                yield item

    async def _batched(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Item, None]:
        await self._running()
        request_id = f"ttft-{next(self._ids)}"
        tokenizer = self._loaded.tokenizer
        text = TokenText(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), params.stop, self._loaded.eos)
        inbox = self._mailboxes.open(request_id)
        arrivals = Arrivals(request_id)
        started = time.perf_counter()
        first_at: float | None = None
        index = 0
        in_library = False
        self._modes.open(request_id)
        try:
            self._submit(request_id, prompt, params)
            in_library = True
            async for output in inbox:
                if isinstance(output, Progress):
                    if first_at is None:
                        yield output
                    continue
                if isinstance(output, FirstToken):
                    self._count_first_beside()
                elif output.error is not None or output.is_finished():
                    in_library = False
                fresh, finished = arrivals.take(output)
                for token in fresh:
                    if first_at is None:
                        first_at = time.perf_counter()
                    piece = text.push(token)
                    if piece:
                        yield Piece(index=index, text=piece)
                        index += 1
                    if text.stopped:
                        break
                if text.stopped or finished:
                    break
            else:
                # The inbox ended without a result: close() is ending every generation. No Finished, as with
                # the single engine's cancel_all (the generation layer tells the client why).
                return
            tail = text.finish()
            if tail:
                yield Piece(index=index, text=tail)
            ended = time.perf_counter()
            degraded = self._modes.degraded(request_id)
            cached = self._counters.hit_by_request.get(request_id, 0)
            if request_id in self._interlude_held:  # the batch's hit holds the blocks the interlude computed too
                cached = min(cached, self._interlude_held[request_id])
            yield text.finished(params.max_tokens, prompt.n_tokens, started, first_at, ended, degraded, cached)
        finally:
            inbox.close()
            self._ended(request_id, in_library=in_library)
            if in_library and not text.stopped:
                log.info("generation_cancelled", completion_tokens=text.count, max_tokens=params.max_tokens)

    async def _running(self) -> None:
        """Raise if the engine is closed; restart the batching loop if it died (the error was logged then)."""
        if self._closed or self._loop is None:
            raise EngineError("the engine is not running: it was closed, or never loaded")
        if self._down():
            log.warning("batching_loop_restarted", reason="the loop had stopped (see the error logged before)")
            await self._loop.restart(self._down)

    def _submit(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Hand the request to the library (and, where first tokens are given beside the batch, race it there)."""
        # Only where the batch's steps attend request by request (a cache that reads in place): there its greedy
        # first token is the side's, bit for bit. Raced before the library has the request, so that no step picks
        # its first token before the race is open.
        seed = salts.seed_of(params.cache_salt)
        if seed is not None:
            self._counters.seeds[request_id] = seed
        # A salted request is not raced in the prefill process, whose prompts' KV is shared by everyone's.
        race = self._race is not None and self._race.open and self._in_place and self._mailboxes.count > 1
        if race and self._race is not None and (seed is None or isinstance(self._prefill, Interlude)):
            held = self._interlude_held

            def shared(tokens: int) -> None:
                held[request_id] = tokens

            self._race.start(request_id, prompt, params, seed=seed, shared=shared)
        if params.urgent:
            self._counters.urgent.add(request_id)
        else:
            self._counters.turns.add(request_id, params.patience or PATIENCE_SECONDS)
        added = self._manager.add_request(
            list(prompt.token_ids),
            request_id=request_id,
            max_new_tokens=params.max_tokens,
            streaming=True,
            eos_token_id=sorted(self._loaded.eos) or -1,
            temperature=float(params.temperature),
            top_p=float(params.top_p) if not params.greedy else 1.0,
        )
        if added is None:
            raise EngineError("generation failed: the batching loop is not accepting requests")

    def _count_first_beside(self) -> None:
        if isinstance(self._prefill, Interlude):
            self._interlude_first += 1
        else:
            self._side_first += 1

    def _ended(self, request_id: str, *, in_library: bool) -> None:
        """A batched generation has ended, or its client has left: settle its claims, and free its slot in the
        library if it still holds one (a stop sequence matched, or the client left: the library frees it at its
        next step; results of a step already in flight are dropped by the closed inbox)."""
        self._claims.close(request_id)
        self._modes.close(request_id)
        self._counters.urgent.discard(request_id)
        self._counters.turns.forget(request_id)
        self._counters.hit_by_request.pop(request_id, None)
        self._counters.seeds.pop(request_id, None)
        self._counters._told.pop(request_id, None)
        self._interlude_held.pop(request_id, None)
        if isinstance(self._prefill, Interlude):
            self._prefill.sweep()
        if self.janitor.count():
            # On CUDA, every N generations: empty the allocator's cache in a worker thread (it synchronises the
            # device), as the single engine does in its generation thread.
            emptying = asyncio.get_running_loop().run_in_executor(None, self.janitor.empty)
            emptying.add_done_callback(_log_failure)
        if in_library:
            self._manager.cancel_request(request_id)

    def _down(self) -> bool:
        """The loop has ended, or is ending after a failure (it refuses new requests then)."""
        if self._closed or self._loop is None:
            return False
        refusal = self._manager.background_thread_status.can_accept_new_requests()
        return not self._loop.alive or refusal is not None

    async def close(self) -> None:
        """End every generation (batched ones end without a ``Finished``), then stop the loop's thread."""
        self._closed = True
        self._populator.stop()
        self._mailboxes.end_all()
        if self._loop is not None and self._loop.alive:
            await self._loop.stop()
        if self._prefill is not None:
            await asyncio.to_thread(self._prefill.stop)  # the waits in flight end: the child is gone
        if self._race is not None:
            await self._race.ended()
        await self._single.close()

    # -- state -------------------------------------------------------------------------------------------------

    def stats(self) -> BatchStats:
        requests, in_use, cached = hooks.occupancy(self._manager)
        return BatchStats(
            running=self._loop is not None and self._loop.alive,
            requests=requests,
            streams=self._mailboxes.count,
            steps=self._steps,
            prompt_tokens=self._counters.prompt_tokens,
            prefix_hits=self._counters.hits,
            prefix_hit_tokens=self._counters.hit_tokens,
            kv_tokens_in_use=in_use,
            kv_tokens_cached=cached,
            kv_tokens_capacity=self._capacity,
            prefill=self.prefill_process.state if self.prefill_process is not None else "off",
            interludes=self.interludes.state if self.interludes is not None else "off",
            side_first_tokens=self._side_first,
            interlude_first_tokens=self._interlude_first,
            rows_sat_out=self._counters.turns.sat_out,
            kernel=self._loaded.kernel_counts(),
        )

    # -- called from the loop's thread -------------------------------------------------------------------------

    def _deliver(self, outputs: Sequence[Any]) -> None:
        if not outputs:
            return
        self._steps += 1
        if isinstance(self._prefill, Interlude):
            self._prefill.sweep()
        self.batch_log.append(tuple(output.request_id for output in outputs))
        self._held.deliver(outputs)

    def _progress(self, request_id: str, progress: Progress) -> None:
        self._mailboxes.deliver([(request_id, progress)])

    def _post(self, outputs: Sequence[Any]) -> None:
        self._mailboxes.deliver((output.request_id, output) for output in outputs)

    def _alive(self) -> bool:
        return self._loop is not None and self._loop.alive

    def _dead(self) -> BaseException:
        return EngineError("generation failed: the batching loop stopped")


def _log_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("cuda_cache_empty_failed", error=repr(future.exception()))
