"""The llama.cpp engine: a GGUF model run by llama.cpp, with our continuous batching, text and sampling on top.

One loop thread (:class:`~ttft_sse.engine.threads.Loop`) owns llama.cpp's context. Each turn it takes the commands
posted since the last (new requests, cancellations), admits what fits (engine/llamacpp/schedule.py), and runs one
``llama_decode`` over a row for every decoding stream and the next rows of the prompts being computed; then it picks
one token for every row that asked for logits and hands the step's tokens to the event loop in one crossing
(:class:`~ttft_sse.engine.threads.Mailboxes`). A sequence ends in the loop, at an end-of-sequence token or at its
``max_tokens``; a stream closed early (client gone, stop sequence) posts a cancellation, which the loop applies
before its next step: it gets no further token.

Prefix reuse (``TTFT_PREFIX_CACHE``, as llama-server's ``cache_prompt``): a sequence's KV cells outlive its request,
and a request takes the free sequence whose cells hold the longest prefix of its prompt for its cache salt
(engine/llamacpp/schedule.py); the loop frees that sequence's cells past the prefix, and only the rest is computed.
The prefix is the request's ``cached_tokens``. Off, or where llama.cpp cannot free part of a sequence's cells, a
request's cells are freed when it ends.

Prefills (``POST /prefill``, :meth:`LlamaCppEngine.prefill`) use that reuse: a prefill is a sequence of the loop that
computes a prompt's KV into a free sequence and leaves it there, as background work the schedule gives only what real
requests leave (engine/llamacpp/schedule.py); the request that follows takes that sequence and computes the rest.

Prefixes that survive a restart (``TTFT_PREFIX_STORE_MB``, :meth:`LlamaCppEngine.store_prefixes` on drain and
:meth:`LlamaCppEngine.restore_prefixes` at start): the free sequences' cells written to the cache directory and read
back into free sequences (engine/llamacpp/prefix_store.py), in the loop's thread between two steps.

Shared with the other engines, so that a request means the same on each: the prompt (engine/prompts.py, with the
tokenizer transformers builds from the file's metadata, so the same token ids), the text and stop sequences
(engine/text.py), and sampling (engine/sampling.py, over llama.cpp's logits, with the request's own generator: a
``seed`` reproduces its answer). A greedy token is the row's argmax (numpy's: the first index on a tie, as torch's).

llama.cpp computes a step's rows together, and only some of its kernels give a row the same bits whatever else the
step holds: docs/engine.md ("The llama.cpp engine") says what is promised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import structlog

from ttft_sse.engine import prompts, sampling
from ttft_sse.engine.base import NORMAL, Finished, Hold, ModelInfo, Piece, Prompt, SamplingParams
from ttft_sse.engine.base import check_mode as _check_mode
from ttft_sse.engine.llamacpp import library
from ttft_sse.engine.llamacpp.commands import Cancel, Command, Delivery, Prefill, Prefilled, Submit, Visit, visit
from ttft_sse.engine.llamacpp.prefix_store import PrefixStore
from ttft_sse.engine.llamacpp.schedule import Plan, Schedule, salt_hash
from ttft_sse.engine.llamacpp.schedule import Sequence as Running
from ttft_sse.engine.loading import budget, sources
from ttft_sse.engine.text import TokenText
from ttft_sse.engine.threads import Commands, Loop, Mailboxes
from ttft_sse.errors import EngineError, StartupError
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

log = structlog.get_logger("ttft_sse.engine")

Item = Piece | Finished
T = TypeVar("T")
HOLD_POLL_SECONDS = 0.02
"""How often the loop asks again, while only held prefills are left to compute, whether they are held still."""


@dataclass(frozen=True)
class LlamaStats:
    """The loop's state, for tests and the benchmark. Counters only grow."""

    running: bool  # the loop's thread is alive
    sequences: int  # requests and prefills holding a sequence id
    waiting: int  # requests waiting for a sequence id
    prefills: int  # prefills computing or waiting for a sequence id
    steps: int  # decodes run
    cells: int  # KV cells of each sequence


class LlamaCppEngine(prompts.TokenizedPrompts):
    """Engine over llama.cpp (llama-cpp-python's low-level API). Serves GGUF models only."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._info: ModelInfo | None = None
        self._runner: library.Runner | None = None
        self._tokenizer: Any = None
        self._eos: frozenset[int] = frozenset()
        self._mailboxes: Mailboxes[str, Delivery] = Mailboxes(alive=self._alive, dead=self._dead)
        self._loop: Loop[Command] = Loop(name="ttft-llama", body=self._run, on_failure=self._failed)
        self._ids = itertools.count(1)
        self._closed = False
        self._schedule: Schedule | None = None
        self._steps = 0
        self._warm = 0  # sequences that keep a warm prompt for good
        self._reuse = settings.prefix_cache  # off for good once llama.cpp cannot free part of a sequence
        self._prefix_store = PrefixStore(settings)
        self.batch_log: list[tuple[str, ...]] = []
        """The request ids that received a token, step by step (the most recent 512 steps)."""

    # -- the interface -----------------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("LlamaCppEngine.info is read before load(); await the lifespan's readiness first")
        return self._info

    @property
    def active(self) -> int:
        return self._mailboxes.count

    @property
    def mode(self) -> str:
        return NORMAL

    def set_mode(self, mode: str) -> None:
        _check_mode(mode, self.info.modes)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def runner(self) -> library.Runner:
        if self._runner is None:
            raise RuntimeError("LlamaCppEngine.runner is read before load()")
        return self._runner

    def load(self, clock: StageClock) -> None:
        settings = self._settings
        with clock.stage("imports"):
            import transformers

            library.binding()
        source = sources.resolve(settings.model)
        if source.kind != "gguf":
            raise StartupError(
                f"TTFT_ENGINE=llamacpp serves GGUF files, and {settings.model!r} is a {source.kind} model: "
                "use TTFT_ENGINE=batched"
            )
        # The tokenizer and config that transformers builds from the file's metadata, as the other engines': no
        # tensor of the file is read but by llama.cpp.
        location = sources.materialize(source, settings.cache_dir, clock)
        config = transformers.AutoConfig.from_pretrained(location)
        plan = budget.settle(budget.for_llama_cpp(settings, source.location, config))
        with clock.stage("tokenizer"):
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(location)
            self._eos = _eos(transformers, location, self._tokenizer)
        threads = settings.torch_threads
        shape = library.Shape(
            cells=plan.kv_tokens,
            # Not the high lane's extra rows: llama.cpp splits its KV cells evenly between sequences, so each more
            # would shorten every request's context; a high request past them waits here for a sequence.
            sequences=settings.max_concurrency,
            batch_tokens=max(min(settings.batch_tokens, library.ROWS_PER_STEP), settings.max_concurrency),
            threads=threads,
        )
        with clock.stage("model"):
            self._runner = runner = library.open_runner(source.location, shape)
        self._info = ModelInfo(
            name=source.name,
            source=source.location,
            device="cpu",
            dtype=runner.description.rsplit(" ", 1)[-1] if runner.description else "gguf",
            context_length=min(runner.trained_context or runner.cells_per_sequence, runner.cells_per_sequence),
            threads=threads,
            weights=f"llama.cpp: {runner.description}",
            engine="llamacpp",
            weights_bytes=plan.weights,
            kv_cache_tokens=plan.kv_tokens,
            kv_cache_bytes=plan.kv_cache,
            kv_cache_dtype=plan.kv_dtype,
            load_peak_rss_bytes=budget.peak_resident_bytes(),
        )
        log.info("llamacpp_loaded", model=source.name, description=runner.description, **vars(shape))
        self._loop.start()

    def cached(self, prompt: Prompt, cache_salt: str = "") -> int:
        """The longest prefix of ``prompt`` a free sequence's cells hold for ``cache_salt`` (a request would compute
        all but that, less its last token)."""
        schedule = self._schedule
        if schedule is None or not schedule.reuse:
            return 0
        return schedule.cached(prompt.token_ids, salt_hash(cache_salt))

    async def prefill(self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None) -> int:
        """Compute ``prompt``'s KV into a free sequence as background work, all but what a free sequence holds already,
        and leave it there for the request that follows (engine/llamacpp/schedule.py: kept for it
        ``TTFT_PREFILL_KEEP_SECONDS``, then evicted like any prefix); a newer prefill of ``owner`` ends this one. It
        computes nothing while ``hold()`` is true. The tokens it computed; nothing without prefix reuse."""
        return await self._prefill(prompt, cache_salt=cache_salt, owner=owner, hold=hold)

    async def warm(self, prompt: Prompt) -> int:
        """A warm prompt (``TTFT_WARM_PROMPTS``): computed as a prefill and kept for good in its sequence, which then
        goes only to a request that starts with all of it, unless no other sequence is free. At most a quarter of the
        sequences (one at least) keep warm prompts: past that, it is computed as a prefill and 0 returned. The
        tokens kept."""
        if not self._reuse or self._warm >= max(1, self._settings.max_concurrency // 4):
            await self._prefill(prompt)
            return 0
        self._warm += 1
        await self._prefill(prompt, owner=f"\x00warm-{self._warm}", keep=math.inf)
        return prompt.n_tokens

    async def _prefill(
        self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None, keep: float | None = None
    ) -> int:
        if not self._reuse or not prompt.n_tokens:
            return 0
        self._running()
        key = f"llama-prefill-{next(self._ids)}"
        inbox = self._mailboxes.open(key)
        ended = False
        try:
            self._loop.post(Prefill(key, prompt.token_ids, cache_salt, owner, hold, keep))
            async for delivery in inbox:
                ended = True
                if isinstance(delivery, EngineError):
                    raise delivery
                if isinstance(delivery, Prefilled):
                    return delivery.tokens
            return 0  # close() ended every inbox
        finally:
            inbox.close()
            if not ended:
                self._loop.post(Cancel(key))  # cancelled: it leaves before the loop's next step

    def _running(self) -> None:
        """Raise if the engine is closed; start the loop again if it stopped (the error was logged then)."""
        if self._closed or self._runner is None:
            raise EngineError("the engine is not running: it was closed, or never loaded")
        if not self._loop.alive:
            log.warning("llamacpp_loop_restarted", reason="the loop had stopped (see the error logged before)")
            self._loop.start()

    async def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Item, None]:
        self._running()
        key = f"llama-{next(self._ids)}"
        tokenizer = self._tokenizer
        text = TokenText(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), params.stop, self._eos)
        inbox = self._mailboxes.open(key)
        started = time.perf_counter()
        first_at: float | None = None
        index = 0
        cached = 0
        ended = False
        try:
            self._loop.post(Submit(key, prompt.token_ids, params))
            async for delivery in inbox:
                if isinstance(delivery, EngineError):
                    ended = True
                    raise delivery
                if isinstance(delivery, Prefilled):
                    continue  # never sent to a request
                token, ended, cached = delivery
                if first_at is None:
                    first_at = time.perf_counter()
                piece = text.push(token)
                if piece:
                    yield Piece(index=index, text=piece)
                    index += 1
                if text.stopped or ended:
                    break
            else:
                return  # close() ended every inbox: no Finished (the generation layer tells the client why)
            tail = text.finish()
            if tail:
                yield Piece(index=index, text=tail)
            yield text.finished(
                params.max_tokens, prompt.n_tokens, started, first_at, time.perf_counter(), False, cached
            )
        finally:
            inbox.close()
            if not ended:
                self._loop.post(Cancel(key))  # its sequence leaves before the loop's next step

    async def store_prefixes(self) -> None:
        """The free sequences' prefixes to the cache directory (engine/llamacpp/prefix_store.py); nothing without
        prefix reuse, or once the loop has stopped (its cells are gone)."""
        if self._reuse and not self._closed and self._runner is not None and self._loop.alive:
            await self._prefix_store.store(self._in_loop, self._runner, self.info)

    async def restore_prefixes(self) -> None:
        """The prefixes of the last drain back into free sequences (engine/llamacpp/prefix_store.py)."""
        if self._reuse and not self._closed:
            self._running()
            await self._prefix_store.restore(self._in_loop, self.runner, self.info)

    async def _in_loop(self, work: Callable[[library.Runner, Schedule], T]) -> T:
        """``work(runner, schedule)`` in the loop's thread between two steps, and its result; an EngineError where
        the loop stops first."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._loop.post(Visit(work, done))
        waiting = asyncio.wrap_future(done)
        while True:
            finished, _ = await asyncio.wait({waiting}, timeout=self._mailboxes.poll_seconds)
            if finished:
                return waiting.result()
            if not self._loop.alive:
                waiting.cancel()
                raise self._dead()

    async def close(self) -> None:
        """End every generation (without a ``Finished``), stop the loop and free llama.cpp's model."""
        self._closed = True
        self._mailboxes.end_all()
        await self._loop.stop()
        if self._runner is not None and not self._loop.alive:
            self._runner.close()

    def state(self) -> LlamaStats:
        schedule = self._schedule
        return LlamaStats(
            running=self._loop.alive,
            sequences=len(schedule.running) if schedule else 0,
            waiting=len(schedule.waiting) if schedule else 0,
            prefills=_prefills(schedule) if schedule else 0,
            steps=self._steps,
            cells=self.runner.cells_per_sequence,
        )

    # -- the loop's thread -------------------------------------------------------------------------------------

    def _run(self, commands: Commands[Command]) -> None:
        runner = self.runner
        runner.clear()  # a loop started after a failure finds the cells of the requests it failed
        settings = self._settings
        self._schedule = schedule = Schedule(
            sequences=runner.shape.sequences,
            cells=runner.cells_per_sequence,
            batch_tokens=runner.shape.batch_tokens,
            chunk=settings.prefill_chunk_tokens,
            reuse=self._reuse,
            keep_seconds=settings.prefill_keep_seconds,
        )
        draws: dict[str, tuple[SamplingParams, Any]] = {}  # key → (params, torch generator or None)
        holds: dict[str, Callable[[], bool]] = {}  # prefill's key → its hold()
        paused = False  # only held prefills are left: ask them again in a while
        while not commands.stopping:
            idle = schedule.empty
            for command in commands.take(wait=idle or paused, timeout=None if idle else HOLD_POLL_SECONDS):
                if isinstance(command, Cancel):
                    self._leave(schedule, command.key, draws)
                elif isinstance(command, Prefill):
                    self._add_prefill(schedule, command, holds)
                elif isinstance(command, Visit):
                    visit(command, runner, schedule)
                else:
                    self._add(schedule, command, draws)
            self._answer_ended(schedule, holds)
            held = any(hold() for hold in holds.values())
            self._take(schedule, schedule.admit(held))
            plan = schedule.plan(held)
            paused = not plan
            if plan:
                self._step(schedule, plan, draws)
            self._answer_ended(schedule, holds)

    def _answer_ended(self, schedule: Schedule, holds: dict[str, Callable[[], bool]]) -> None:
        """Each prefill that ended is answered the tokens it computed; its hold is asked no more."""
        ended = schedule.take_ended()
        for prefill in ended:
            holds.pop(prefill.key, None)
        self._mailboxes.deliver((prefill.key, Prefilled(prefill.rows)) for prefill in ended)

    def _add(self, schedule: Schedule, command: Submit, draws: dict[str, tuple[SamplingParams, Any]]) -> None:
        salt = salt_hash(command.params.cache_salt)
        sequence = Running(command.key, command.prompt, command.params.max_tokens, salt)
        if not schedule.fits(sequence):
            self._mailboxes.deliver([(command.key, EngineError("the request does not fit a sequence's KV cells"))])
            return
        draws[command.key] = (command.params, _generator(command.params))
        schedule.add(sequence)

    def _add_prefill(self, schedule: Schedule, command: Prefill, holds: dict[str, Callable[[], bool]]) -> None:
        salt = salt_hash(command.salt)
        sequence = Running(
            command.key, command.prompt, 0, salt, background=True, owner=command.owner, keep=command.keep
        )
        if not schedule.reuse or not schedule.fits(sequence):
            self._mailboxes.deliver([(command.key, Prefilled(0))])  # nothing to keep it in
            return
        if command.hold is not None:
            holds[command.key] = command.hold
        schedule.add(sequence)

    def _step(self, schedule: Schedule, plan: Plan, draws: dict[str, tuple[SamplingParams, Any]]) -> None:
        """Run ``plan``'s decode, pick a token for each row that asked for logits and hand them over; the sequences
        that ended (a request's last token, a prefill's prompt computed) leave."""
        runner = self.runner
        runner.decode(plan.rows)
        self._steps += 1
        deliveries: list[tuple[str, Delivery]] = []
        for row, sequence in plan.outputs:
            params, generator = draws[sequence.key]
            token = _pick(runner.logits(row), params, generator)
            sequence.generated.append(token)
            last = token in self._eos or len(sequence.generated) >= sequence.max_tokens
            if last:
                self._leave(schedule, sequence.key, draws)
            deliveries.append((sequence.key, (token, last, sequence.cached)))
        for prefill in plan.prefilled:
            self._leave(schedule, prefill.key, draws)
        self.batch_log.append(tuple(key for key, _ in deliveries))
        del self.batch_log[:-512]
        self._mailboxes.deliver(deliveries)

    def _take(self, schedule: Schedule, admitted: list[Running]) -> None:
        """Free the cells of each admitted sequence's id past the prefix it reuses (all of them where it reuses
        none). Where llama.cpp cannot, reuse ends for good: the admitted compute their whole prompts, and every free
        id's cells are freed."""
        if not schedule.reuse or all(self.runner.keep(s.seq, s.cached) for s in admitted):
            return
        log.warning(
            "llamacpp_prefix_reuse_off",
            reason="llama.cpp cannot free part of a sequence's KV cells for this model: every prompt is computed whole",
        )
        self._reuse = False
        held = {s.seq for s in schedule.running.values() if not s.background} - {s.seq for s in admitted}
        for seq in range(len(schedule.kept)):
            if seq not in held:
                self.runner.forget(seq)
        schedule.end_reuse(admitted)

    def _leave(self, schedule: Schedule, key: str, draws: dict[str, tuple[SamplingParams, Any]]) -> None:
        draws.pop(key, None)
        sequence = schedule.remove(key)
        if sequence is not None and not schedule.reuse:
            self.runner.forget(sequence.seq)

    def _failed(self, exc: BaseException) -> None:
        log.error("llamacpp_loop_failed", error=str(exc), error_type=type(exc).__name__)
        self._mailboxes.fail_all(EngineError(f"generation failed: {type(exc).__name__}"))

    def _alive(self) -> bool:
        return self._loop.alive

    def _dead(self) -> BaseException:
        return EngineError("generation failed: the llama.cpp loop stopped")


def _pick(logits: np.ndarray, params: SamplingParams, generator: Any) -> int:
    """The row's token: its argmax for a greedy request, else a draw by engine/sampling.py's rule."""
    if params.greedy:
        return int(np.argmax(logits))
    import torch

    row = torch.from_numpy(np.array(logits, dtype=np.float32))
    return int(sampling.draw(row[None], params.temperature, params.top_p, generator).item())


def _generator(params: SamplingParams) -> Any:
    """The request's own torch generator (seeded with its ``seed``), for a sampled request; None for a greedy one."""
    if params.greedy:
        return None
    import torch

    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def _eos(transformers: Any, location: str, tokenizer: Any) -> frozenset[int]:
    """The end-of-sequence ids, as the transformers engines take them: the generation config's, else the
    tokenizer's."""
    try:
        eos = transformers.GenerationConfig.from_pretrained(location).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def _prefills(schedule: Schedule) -> int:
    """The prefills computing or waiting, read from another thread than the loop's (copied at once, in C: a dict
    the loop changes meanwhile is never iterated in Python)."""
    return len(schedule.prefills) + sum(s.background for s in list(schedule.running.values()))
