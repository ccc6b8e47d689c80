"""A scripted engine that ships beside the real one, for transport, framing and failure tests.

It goes through the same thread bridge and the same text framing (stop sequences) as the transformers engine,
so only the model is fake. Tokens are whitespace-separated words, each word's id a checksum of it.

Its prefix cache is scripted too: every prompt it has computed (streamed or prefilled) is kept, apart by cache salt,
and a prompt's cached tokens are the most it shares with one of them (short of its last token). With
``prompt_delay``, a prompt's uncached tokens take that many seconds each, computed :data:`STEP_TOKENS` a step: a
known cost a step, with ``Progress`` after each step of a prompt that takes more than one.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from ttft_sse.engine.base import (
    INT8,
    NORMAL,
    ChatMessage,
    Finished,
    FinishReason,
    Hold,
    ModelInfo,
    Piece,
    Progress,
    Prompt,
    SamplingParams,
    Usage,
    check_mode,
)
from ttft_sse.engine.text import StopMatcher
from ttft_sse.engine.threads import Emit, Workers
from ttft_sse.errors import EngineError, PromptTooLong
from ttft_sse.stages import StageClock

Item = Progress | Piece | Finished

STEP_TOKENS = 8
"""Prompt tokens a scripted step computes (with ``prompt_delay``)."""


class FakeEngine:
    """Emits ``pieces`` one by one (then stops, as if at end-of-sequence).

    * ``delay``: seconds between pieces;
    * ``fail_after``: raise ``RuntimeError`` in the worker thread after that many pieces;
    * ``hold_after``: after that many pieces, wait until ``release`` is set (or the request is cancelled);
    * ``context_length``: prompts of that many words or more are refused;
    * ``modes``: what :meth:`set_mode` takes (``("normal", "int8")`` scripts the CPU engine's degraded mode). A
      generation reads the mode at its start (its prompt's pass) and before each piece (a step), so a switch takes
      effect at its next piece; its ``Finished.degraded`` is True where any of those reads was not ``"normal"``;
    * ``int8_delay``: seconds between pieces computed in ``"int8"`` (default ``delay``): the faster mode;
    * ``prompt_delay``: seconds a prompt token not in its prefix cache takes to compute (streams and prefills).

    ``prefills`` lists each prefill's end: ``("done" | "cancelled", tokens computed)``; ``prefill_steps`` counts the
    steps prefills computed.
    """

    def __init__(
        self,
        pieces: Sequence[str] = ("Hello", ",", " world", "!"),
        *,
        delay: float = 0.0,
        fail_after: int | None = None,
        hold_after: int | None = None,
        context_length: int = 64,
        load_seconds: float = 0.0,
        hold_load: bool = False,
        modes: Sequence[str] = (NORMAL,),
        int8_delay: float | None = None,
        prompt_delay: float = 0.0,
    ) -> None:
        if not modes or modes[0] != NORMAL:
            raise ValueError(f"modes must start with {NORMAL!r}, got {tuple(modes)!r}")
        self.pieces = list(pieces)
        self.delay = delay
        self.fail_after = fail_after
        self.hold_after = hold_after
        self.release = threading.Event()
        self.load_seconds = load_seconds
        self.hold_load = hold_load
        self.loaded = threading.Event()  # with ``hold_load``: the load ends when this is set
        self.generated: list[int] = []  # completion tokens of every generation, cancelled ones included
        self.int8_delay = delay if int8_delay is None else int8_delay
        self.prompt_delay = prompt_delay
        self.prefills: list[tuple[str, int]] = []
        self.prefill_steps = 0
        self._kept: set[tuple[str, tuple[int, ...]]] = set()  # (cache salt, token ids) of every prompt computed
        self._mode = NORMAL
        self._workers: Workers[Item] = Workers(name="ttft-fake")
        self._info = ModelInfo(
            name="fake",
            source="fake",
            device="cpu",
            dtype="none",
            context_length=context_length,
            threads=1,
            modes=tuple(modes),
            engine="fake",
        )

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def active(self) -> int:
        return self._workers.active

    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        check_mode(mode, self._info.modes)
        self._mode = mode  # one reference swapped: generation threads read it whole

    def load(self, clock: StageClock) -> None:
        with clock.stage("model"):
            time.sleep(self.load_seconds)
            if self.hold_load:
                self.loaded.wait()

    def prepare(
        self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool, parse_special: bool = False
    ) -> Prompt:
        text = prompt if prompt is not None else "\n".join(f"{m.role}: {m.content}" for m in messages or ())
        words = text.split()
        if len(words) >= self._info.context_length:
            raise PromptTooLong(
                f"the prompt is {len(words)} tokens; the model's context is {self._info.context_length} tokens",
                param="prompt" if prompt is not None else "messages",
                code="context_length_exceeded",
            )
        return Prompt(text=text, token_ids=tuple(zlib.crc32(word.encode()) & 0xFFFF for word in words))

    def prepare_prefix(self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool) -> Prompt:
        whole = self.prepare(prompt=prompt, messages=messages, raw=raw)
        # The last word may still grow (and the prompt's last token is the request's own).
        return Prompt(text=whole.text, token_ids=whole.token_ids[:-1])

    def cached(self, prompt: Prompt, cache_salt: str = "") -> int:
        ids = prompt.token_ids
        best = 0
        for salt, kept in list(self._kept):
            if salt == cache_salt:
                best = max(best, _shared(ids, kept))
        return min(best, max(len(ids) - 1, 0))

    async def prefill(self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None) -> int:
        computed = self.cached(prompt, cache_salt)
        done = computed
        try:
            while computed < prompt.n_tokens:
                while hold is not None and hold():
                    await asyncio.sleep(0.005)
                step = min(STEP_TOKENS, prompt.n_tokens - computed)
                await asyncio.sleep(self.prompt_delay * step)
                computed += step
                self.prefill_steps += 1
        except asyncio.CancelledError:
            self.prefills.append(("cancelled", computed - done))
            raise
        self._kept.add((cache_salt, prompt.token_ids))
        self.prefills.append(("done", computed - done))
        return computed - done

    async def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Item, None]:
        def produce(emit: Emit[Item], cancelled: threading.Event) -> None:
            stops = StopMatcher(params.stop)
            count, index = 0, 0
            reason: FinishReason = "stop"
            degraded = self._mode != NORMAL  # the prompt's pass
            cached = self.cached(prompt, params.cache_salt)
            try:
                computed = cached
                while self.prompt_delay and computed < prompt.n_tokens:
                    if cancelled.is_set():
                        return
                    step = min(STEP_TOKENS, prompt.n_tokens - computed)
                    time.sleep(self.prompt_delay * step)
                    computed += step
                    if prompt.n_tokens - cached > STEP_TOKENS:  # more than one step
                        emit(Progress(prompt.n_tokens, computed))
                self._kept.add((params.cache_salt, prompt.token_ids))
                for piece in self.pieces:
                    if cancelled.is_set():
                        return
                    if count == params.max_tokens:
                        reason = "length"
                        break
                    if self.fail_after is not None and count == self.fail_after:
                        raise RuntimeError("scripted engine failure")
                    if self.hold_after is not None and count == self.hold_after:
                        while not (self.release.wait(0.01) or cancelled.is_set()):
                            pass
                        if cancelled.is_set():
                            return
                    mode = self._mode  # this piece's step
                    degraded = degraded or mode != NORMAL
                    delay = self.int8_delay if mode == INT8 else self.delay
                    if delay:
                        time.sleep(delay)
                    count += 1
                    text = stops.feed(piece)
                    if text:
                        emit(Piece(index, text))
                        index += 1
                    if stops.matched:
                        break
                if not stops.matched and (tail := stops.flush()):
                    emit(Piece(index, tail))
                usage = Usage(prompt_tokens=prompt.n_tokens, completion_tokens=count, cached_tokens=cached)
                emit(Finished(reason, usage, {"prefill_ms": 0.0, "decode_ms": 0.0}, degraded=degraded))
            finally:
                self.generated.append(count)

        try:
            async with aclosing(self._workers.stream(produce)) as items:
                async for item in items:
                    yield item
        except RuntimeError as exc:
            raise EngineError(f"generation failed: {exc}") from exc

    async def close(self) -> None:
        await self._workers.cancel_all()


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
