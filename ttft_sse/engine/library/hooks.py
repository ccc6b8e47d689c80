"""How the batched engine builds the library's continuous batching: the manager, its batch processor with the
engine's paged cache and scheduler, each step's outputs routed to the engine, tokens picked per request, the greedy
pick in C, and the model's forward kept causal for the other engines.

Every private part of the library used here comes from engine/library/internals.py, which checks them at load
(:func:`~internals.missing`, and :func:`~internals.missing_on` for the manager made here). What is set is set on this
engine's own objects (its manager, the batch processors and runners it builds, its model): nothing changes for
another engine or another model of the process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ttft_sse.engine.kernels import argmax
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.library import half_cache, internals, paged_cache
from ttft_sse.engine.library.in_place import StepHooks
from ttft_sse.engine.library.paged_cache import BLOCK_TOKENS
from ttft_sse.engine.library.scheduler import PrefixCounters, scheduler_class
from ttft_sse.settings import Settings

if TYPE_CHECKING:
    from ttft_sse.engine.library.selection import Claims  # imports torch and transformers: at load, not here


class Unbatched(RuntimeError):
    """The library's manager lacks state the engine builds its batch processor from (the names, in ``missing``)."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(", ".join(missing))
        self.missing = missing


def create_manager(
    loaded: Any,
    settings: Settings,
    *,
    blocks: int,
    counters: PrefixCounters,
    deliver: Callable[[Sequence[Any]], None],
    claims: Claims,
    steps: StepHooks | None,
    zeros: Callable[[int], Any],
    made: Callable[[Any], None],
) -> Any:
    """The library's continuous-batching manager for ``loaded``'s model (engine/loaded.py): a paged cache of
    ``blocks`` blocks of :data:`BLOCK_TOKENS` (the engine's class: engine/library/paged_cache.py), a scheduler counting
    into ``counters`` (engine/library/scheduler.py), each step's outputs to ``deliver`` (:func:`router`), tokens
    picked per request (engine/library/selection.py, with ``claims``). On CPU its cache takes its memory from
    ``zeros`` (zeroed lazily: engine/batched/memory.py), in f16 where the model's KV caches are
    (engine/library/half_cache.py), read in place with the engine's ``steps`` where they are given, and the greedy
    pick is C's where it builds. Each batch processor the loop builds is handed to ``made`` (in the loop's thread).
    Raises :class:`Unbatched` where the manager lacks what the batch processor is built from."""
    import torch
    import transformers

    model = loaded.model
    eos = sorted(loaded.eos)
    generation = transformers.GenerationConfig(
        do_sample=False,  # an argmax per row; sampled rows are drawn before it (engine/library/selection.py)
        eos_token_id=eos or -1,
        pad_token_id=loaded.tokenizer.pad_token_id,
    )
    batching = transformers.ContinuousBatchingConfig(
        page_size=BLOCK_TOKENS,
        num_blocks=blocks,
        max_batch_tokens=settings.batch_tokens,
        max_requests_per_batch=settings.engine_rows,
        allow_block_sharing=settings.prefix_cache,
    )
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    missing = internals.missing_on(manager)
    if missing:
        raise Unbatched(missing)
    manager.output_router = router(deliver)
    from ttft_sse.engine.library.selection import selection  # torch and transformers: imported at load

    manager.logit_processor = selection(claims)  # before the loop builds its batch processor from it
    on_cpu = model.device.type == "cpu"
    additions = paged_cache.Additions(
        half=on_cpu and half_cache.in_f16(model),
        zeros=zeros if on_cpu else None,
        steps=steps,
        seeds=counters.seeds,
        modes=counters.modes,
    )
    picker = argmax.build(settings.cache_dir / KERNEL_DIR) if on_cpu else None

    def built(processor: Any) -> None:
        if picker is not None:
            pick_greedy(processor.model_runner, picker, torch)
        made(processor)

    cache = paged_cache.cache_class(internals.batching().paged_cache, additions)
    internals.build_processors(manager, cache, scheduler_class(counters), built)
    return manager


def occupancy(manager: Any) -> tuple[int, int, int]:
    """What the library's loop holds now (any thread; reads only): requests (running and waiting), and the paged
    cache's tokens in requests' blocks and in cached blocks. Zeros before the loop built its batch processor."""
    processor = getattr(manager, "batch_processor", None) if manager is not None else None
    scheduler = getattr(processor, "scheduler", None)
    cache = getattr(processor, "cache", None)
    in_use = cached = 0
    if cache is not None:
        for allocator in list(cache.cache_allocators.values()):
            in_use += sum(len(blocks) for blocks in list(allocator.block_table.values())) * BLOCK_TOKENS
            cached += len(allocator.ledger.cached_blocks) * BLOCK_TOKENS
    requests = len(scheduler.active_requests) + len(scheduler.waiting_requests) if scheduler else 0
    return requests, in_use, cached


def pick_greedy(runner: Any, picker: argmax.Argmax, torch: Any) -> None:
    """Make the continuous-batching ``runner`` (the library's ``ModelRunner``, one batch processor's) pick its tokens
    with ``picker`` (engine/kernels/argmax.py) where it would call ``torch.argmax``: no sampling and no
    log-probabilities asked, and scores ``picker`` takes. Anything else goes to the library's own ``_sample``. Once a
    runner: a batch processor the manager resets keeps its runner."""
    library_sample = runner._sample
    if getattr(library_sample, "picks_greedy", False):
        return

    def sample(scores: Any, output_ids: Any) -> None:
        if runner.do_sample or runner.return_logprobs or scores.dim() != 3 or scores.size(0) != 1:
            library_sample(scores, output_ids)
            return
        rows = scores[0]  # [num_logits, vocab_size]
        if not picker.takes(rows, torch):
            library_sample(scores, output_ids)
            return
        tokens = picker.rows(rows, torch)
        output_ids[0, : tokens.size(0)].copy_(tokens)

    sample.picks_greedy = True  # type: ignore[attr-defined]
    runner._sample = sample


def keep_config_causal(model: Any) -> None:
    """Keep the batch's steps from making the single engine's calls non-causal.

    transformers' continuous batching calls the model with ``is_causal=False`` (its mask holds the pattern), and the
    model's forward writes that into the model's config for the length of the call (``utils/generic.py``), where
    every other call of the model reads it as its default: a seeded request's prompt on the single engine, in another
    thread while a step runs, would be attended without its causal mask and answer nonsense (a test). The steps do
    not need the flag (their mask says it all: transformers' SDPA turns it off by itself where a mask is given), so
    it is dropped before the model sees it. The wrapper keeps the forward's signature (``functools.wraps``): generate
    reads it to pass ``logits_to_keep``, without which the LM head would run over every row of a prompt (a test)."""
    forward = model.forward

    @functools.wraps(forward)
    def step_forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("is_causal") is False and kwargs.get("attention_mask") is not None:
            del kwargs["is_causal"]
        return forward(*args, **kwargs)

    model.forward = step_forward


def router(deliver: Callable[[Sequence[Any]], None]) -> Any:
    """The library's output router, handing each step's outputs to ``deliver`` instead of to callbacks and a shared
    queue."""

    class Router(internals.batching().output_router):  # type: ignore[misc]
        def deliver(self, output: Any) -> None:
            deliver([output])

        def deliver_batch(self, outputs: list[Any]) -> None:
            deliver(outputs)

    return Router()
