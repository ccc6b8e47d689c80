"""The transformers engine: one ``model.generate`` per request, in a worker thread, streamed piece by piece.

A generation takes the engine's mode (:meth:`SingleEngine.set_mode`) at its start and keeps it to its end: a switch
applies to the generations that start after it. Each runs in a thread of its own, so one in int8 rows and one in fp32
rows may run side by side (engine/kernels/kernel.py's ``ROWS`` is the thread's), and each ``Finished.degraded`` says its
own generation's mode.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import structlog

from ttft_sse.engine import sampling
from ttft_sse.engine.base import (
    INT8,
    NORMAL,
    Finished,
    Hold,
    ModelInfo,
    Piece,
    Prompt,
    SamplingParams,
    check_mode,
)
from ttft_sse.engine.kernels import kernel
from ttft_sse.engine.library import half_cache
from ttft_sse.engine.loaded import CacheJanitor, LoadedModel, OnLoadedModel
from ttft_sse.engine.text import TokenText
from ttft_sse.engine.threads import Emit, Workers
from ttft_sse.errors import EngineError
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

log = structlog.get_logger("ttft_sse.engine")

Item = Piece | Finished


class SingleEngine(OnLoadedModel):
    """Engine over a transformers causal LM (:class:`~ttft_sse.engine.loaded.LoadedModel`): its own, or one it shares
    with the batched engine. Torch and transformers are imported at load, not before."""

    def __init__(self, settings: Settings, loaded: LoadedModel | None = None) -> None:
        self._loaded = loaded if loaded is not None else LoadedModel(settings)
        self._workers: Workers[Item] = Workers(name="ttft-gen")
        self._mode = NORMAL

    @property
    def info(self) -> ModelInfo:
        return self._loaded.info

    @property
    def active(self) -> int:
        return self._workers.active

    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        """Generations that start from now on run in ``mode`` (one of ``info.modes``); running ones keep theirs."""
        check_mode(mode, self.info.modes)
        self._mode = mode  # one reference swapped: a generation's thread reads it whole, once

    @property
    def janitor(self) -> CacheJanitor:
        """The loaded model's: counts generations and empties the CUDA allocator's cache every N (a no-op counter off
        CUDA)."""
        return self._loaded.janitor

    @property
    def model(self) -> Any:
        return self._loaded.model

    @property
    def tokenizer(self) -> Any:
        return self._loaded.tokenizer

    def load(self, clock: StageClock) -> None:
        self._loaded.load(clock)

    # -- requests ----------------------------------------------------------------------------------------------

    def cached(self, prompt: Prompt, cache_salt: str = "") -> int:
        """None: each ``generate`` computes its whole prompt (this engine keeps no prefix cache)."""
        return 0

    async def prefill(self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None) -> int:
        """Nothing: there is no prefix cache to compute into."""
        return 0

    async def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Item, None]:
        def produce(emit: Emit[Item], cancelled: Any) -> None:
            try:
                self._generate(prompt, params, emit, cancelled)
            finally:
                # Here, after _generate's frame (and its tensors) is gone and after Finished was emitted: the
                # client has its answer before the cache is emptied. Cancelled and failed generations count too.
                self._loaded.janitor.generation_ended()

        try:
            async with aclosing(self._workers.stream(produce)) as items:
                async for item in items:
                    yield item
        except EngineError:
            raise
        except Exception as exc:
            log.error("generation_failed", error=str(exc), error_type=type(exc).__name__)
            raise EngineError(f"generation failed: {type(exc).__name__}") from exc

    async def close(self) -> None:
        await self._workers.cancel_all()

    # -- the worker thread -------------------------------------------------------------------------------------

    def _generate(self, prompt: Prompt, params: SamplingParams, emit: Emit[Item], cancelled: Any) -> None:
        loaded = self._loaded
        torch, model, tokenizer, eos = loaded.torch, loaded.model, loaded.tokenizer, loaded.eos
        import transformers

        device = model.device
        input_ids = torch.tensor([prompt.token_ids], dtype=torch.long, device=device)
        streamer = _PieceStreamer(tokenizer, params.stop, eos, emit, cancelled)
        config = transformers.GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=False,  # sampling, when asked for, is done by _SeededSampler below
            eos_token_id=sorted(eos) or None,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else None,
        )
        processors = transformers.LogitsProcessorList()
        if not params.greedy:
            processors.append(_seeded_sampler(torch, params, device))
        criteria = transformers.StoppingCriteriaList([_cancel_criterion(torch, cancelled)])
        started = time.perf_counter()
        streamer.started = started
        mode = self._mode  # the whole generation's, its prompt's pass included
        # A KV cache in f16 where the model's are (TTFT_KV_DTYPE): the keys and values the batched engine's hold.
        cache = {"cache": half_cache.dense(model)} if half_cache.in_f16(model) else {}
        with torch.inference_mode(), kernel.int8_rows(mode == INT8):
            model.generate(
                **cache,
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=criteria,
                streamer=streamer,
            )
        text = streamer.text
        if cancelled.is_set() and not text.stopped:
            # Nobody is listening any more; say how far it got, for the logs.
            log.info("generation_cancelled", completion_tokens=text.count, max_tokens=params.max_tokens)
            return
        ended = time.perf_counter()
        emit(text.finished(params.max_tokens, prompt.n_tokens, started, streamer.first_token_at, ended, mode != NORMAL))


class _PieceStreamer:
    """The streamer handed to ``generate``: transformers' streamer contract (``put`` / ``end``).

    Deliberate divergence from ``TextIteratorStreamer``: no blocking ``queue.Queue`` (items go to the event loop
    through the bridge's ``emit``), and no holding text back to a word boundary (see ``IncrementalDecoder``).
    It also stops the generation at a stop sequence by setting the cancel flag, which the stopping criterion
    reads right after this ``put``: generation ends within the same step.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], eos: frozenset[int], emit: Emit[Item], cancelled: Any):
        self.text = TokenText(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stops, eos)
        self._emit = emit
        self._cancelled = cancelled
        self._prompt_seen = False
        self._index = 0
        self.started = 0.0
        self.first_token_at: float | None = None

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() first hands us the prompt itself
            self._prompt_seen = True
            return
        if self.text.stopped:
            return
        for token in value.reshape(-1).tolist():
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self._send(self.text.push(token))
            if self.text.stopped:
                self._cancelled.set()
                return

    def end(self) -> None:
        if self.text.stopped or self._cancelled.is_set():
            return
        self._send(self.text.finish())

    def _send(self, text: str) -> None:
        if text:
            self._emit(Piece(index=self._index, text=text))
            self._index += 1


def _cancel_criterion(torch: Any, cancelled: Any) -> Any:
    import transformers

    class CancelCriterion(transformers.StoppingCriteria):  # type: ignore[misc]
        """Ends generation at the next step once the request is cancelled (client gone, stop sequence)."""

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            done = cancelled.is_set()
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return CancelCriterion()


def _seeded_sampler(torch: Any, params: SamplingParams, device: Any) -> Any:
    """Temperature / top-p sampling with a per-request ``torch.Generator``.

    ``generate(do_sample=True)`` draws from torch's global RNG, which every concurrent request shares, so a
    ``seed`` would not reproduce anything under load. This processor samples with the request's own generator
    and leaves only the drawn token finite; greedy selection then picks it.
    """
    import transformers

    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()

    class SeededSampler(transformers.LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            choice = sampling.draw(scores, params.temperature, params.top_p, generator)
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(-1, choice, 0.0)

    return SeededSampler()
