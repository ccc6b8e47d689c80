"""Where the batched engine reaches into transformers' continuous batching, and the check that those places exist.

The engine builds on private parts of transformers' continuous batching: the manager's batch-processor factory and
output router, the runner's sampler, the per-request logits processors, the scheduler table, the FIFO scheduler's
hooks and the state of its instance (the requests it holds: :data:`SCHEDULER_STATE`), the paged cache's allocators
and the token ids they hash (engine/modes.py), and the cache's own allocation (:func:`zero_cache_lazily`) and
class (:func:`keep_cache_in_f16`). ``pyproject.toml`` pins the transformers versions the engine is tested with;
:func:`missing_internals` checks at load that every name the engine uses is there, so that another version makes the
engine fall back to one ``model.generate`` per request (the library's public path) with one log line, rather than
crash mid-request or compute wrongly.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from ttft_sse.engine.batched import memory
from ttft_sse.engine.first.claims import Claims
from ttft_sse.engine.kernels import argmax
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.library import half_cache
from ttft_sse.settings import Settings

CACHE_MODULE = "transformers.generation.continuous_batching.cache"
BLOCK_TOKENS = 4
"""Tokens per KV block: the unit of prefix sharing. A prompt reuses every whole block it shares with an earlier one,
short of its last token, so small blocks reuse more of it; decoding is as fast with small blocks as with large
ones. 4 is the library's minimum."""

INTERNALS: dict[str, tuple[str, ...]] = {
    "transformers.generation.continuous_batching.continuous_api": (
        "ContinuousBatchingManager._create_batch_processor",
        "ContinuousBatchingManager.add_request",
        "ContinuousBatchingManager.cancel_request",
        "ContinuousBatchingManager.is_running",
        "ContinuousBatchingManager.pause",  # the prefix store reads and writes the cache between two steps
        "PagedAttentionCache",  # the name the manager builds its cache by (keep_cache_in_f16)
        "OutputRouter.deliver",
        "OutputRouter.deliver_batch",
    ),
    "transformers.generation.continuous_batching.cb_logits_processors": (
        "ContinuousBatchingLogitsProcessor.fill_defaults",
        "ContinuousBatchingLogitsProcessor.prepare_tensor_args",
        "ContinuousBatchingLogitsProcessorList",
    ),
    "transformers.generation.continuous_batching.scheduler": (
        "SCHEDULER_MAPPING",
        "FIFOScheduler.schedule_batch",
        "FIFOScheduler._infer_request_tokens",
        "FIFOScheduler._schedule_request",
        "FIFOScheduler.reset",  # sets the state below (SCHEDULER_STATE)
    ),
    "transformers.generation.continuous_batching.requests": (
        "RequestStatus.PENDING",
        "RequestStatus.DECODING",
        "RequestState.status",
    ),
    "transformers.generation.continuous_batching.model_runner": ("ModelRunner._sample",),
    CACHE_MODULE: (
        "PagedAttentionCache.update",
        "PagedAttentionCache.mark_complete_blocks",
        "PagedAttentionCache.search_prefix_match",
        "PagedAttentionCache.free_blocks",
        "torch",  # the name its __init__ allocates the cache through (zero_cache_lazily)
    ),
    "transformers.generation.continuous_batching.cache_allocators.cache_allocator": (
        "CacheAllocator.match_prefix_blocks",
        "CacheAllocator.mark_complete_blocks",
        "BlockLedger.register_new_hash",
        "BlockLedger.acquire",  # the prefix store holds the blocks it restores (engine/batched/prefix_store.py)
        "compute_block_hash",  # engine/library/salts.py chains it from a request's salt
    ),
    "transformers.generation.continuous_batching.cache_allocators.cache_pool": (
        "CachePool.allocate_sector",
        "CachePool.get_free_blocks",
        "CachePool.count_free_blocks",
    ),
    "transformers.generation.continuous_batching.cache_allocators.full_attention": ("FullAttentionCacheAllocator",),
    "transformers": ("ContinuousBatchingConfig", "GenerationConfig"),
}
"""Every module and attribute path of the library the batched engine uses beyond its public API."""

SCHEDULER_STATE: tuple[str, ...] = (
    "active_requests",  # request id → state: those a step may compute (prefills and sitting-out rows taken out)
    "waiting_requests",  # request id → state: those not started
    "waiting_requests_order",  # the order they start in (urgent ones first)
    "max_requests_per_batch",  # the rows a step computes at most
)
"""Attributes of the library's scheduler instance that engine/library/scheduler.py reads and changes. They are the
instance's, set by ``reset``: :func:`missing_internals` looks for them on a FIFO scheduler built without a cache."""


def missing_internals(
    internals: dict[str, tuple[str, ...]] = INTERNALS, state: tuple[str, ...] = SCHEDULER_STATE
) -> list[str]:
    """The dotted names of ``internals`` and of the scheduler's ``state`` that the installed transformers lacks
    (empty when all are there)."""
    missing = _missing_state(state)
    for module_name, paths in internals.items():
        try:
            module: Any = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for path in paths:
            found: Any = module
            for part in path.split("."):
                found = getattr(found, part, None)
                if found is None:
                    missing.append(f"{module_name}.{path}")
                    break
    return missing


def _missing_state(state: tuple[str, ...]) -> list[str]:
    """The names of ``state`` that a FIFO scheduler of the library lacks once built (its cache is only kept)."""
    name = "transformers.generation.continuous_batching.scheduler.FIFOScheduler"
    try:
        from transformers.generation.continuous_batching.scheduler import FIFOScheduler

        scheduler = FIFOScheduler(None, None, 1)
    except Exception:  # another version's scheduler: none of its state can be relied on
        return [f"{name}().{attribute}" for attribute in state]
    return [f"{name}().{attribute}" for attribute in state if not hasattr(scheduler, attribute)]


def create_manager(
    loaded: Any,
    settings: Settings,
    *,
    blocks: int,
    scheduler: str,
    deliver: Callable[[Sequence[Any]], None],
    claims: Claims,
    populate: Callable[[Any], None],
) -> Any:
    """The library's continuous-batching manager for ``loaded``'s model (engine/loaded.py): a paged
    cache of ``blocks`` blocks of :data:`BLOCK_TOKENS`, the registered ``scheduler``, each step's outputs to
    ``deliver`` (:func:`router`), tokens picked per request (engine/library/selection.py, with ``claims``), and on
    CPU the cache zeroed lazily (its tensor to ``populate``), in f16 where the model's KV caches are
    (engine/library/half_cache.py), and the greedy pick in C where it builds."""
    import transformers

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
        scheduler_type=scheduler,
    )
    manager = loaded.model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.output_router = router(deliver)
    from ttft_sse.engine.library.selection import selection  # torch and transformers: imported at load

    manager.logit_processor = selection(claims)  # before the loop builds its batch processor from it
    if loaded.model.device.type == "cpu":
        zero_cache_lazily(manager, populate)
        if half_cache.in_f16(loaded.model):
            keep_cache_in_f16(manager)
        picker = argmax.build(settings.cache_dir / KERNEL_DIR)
        if picker is not None:
            pick_greedy_with(manager, picker)
    return manager


def pick_greedy_with(manager: Any, picker: argmax.Argmax) -> None:
    """Have each batch processor ``manager`` builds (in its loop's thread, when the loop starts) pick greedy tokens
    with ``picker`` (engine/kernels/argmax.py) instead of ``torch.argmax``."""
    import torch

    create = manager._create_batch_processor

    def created() -> Any:
        processor = create()
        argmax.pick_greedy(processor.model_runner, picker, torch)
        return processor

    manager._create_batch_processor = created


def zero_cache_lazily(manager: Any, made: Callable[[Any], None]) -> None:
    """Have the paged cache each batch processor ``manager`` builds take its memory zeroed lazily, on CPU
    (engine/batched/memory.py), and hand the cache's tensor to ``made`` once the processor is built.

    transformers allocates the whole cache with ``torch.zeros`` in ``PagedAttentionCache.__init__``. While the
    processor is built, the cache module's ``torch`` is a stand-in whose ``zeros`` of CPU bytes is
    :func:`memory.lazy_zeros` and which is torch for every other name; then torch again. The processor's ``cache``
    and the cache's ``cache_tensor`` are instance attributes (no check of the class finds them): where they are not
    there, ``made`` is not called."""
    import torch

    cache_module: Any = importlib.import_module(CACHE_MODULE)
    create = manager._create_batch_processor

    class LazyZeros:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        def zeros(self, *size: Any, **kwargs: Any) -> Any:
            if (
                len(size) == 1
                and isinstance(size[0], int)
                and kwargs.get("dtype") is torch.uint8
                and torch.device(kwargs.get("device") or "cpu").type == "cpu"
                and set(kwargs) <= {"dtype", "device"}
            ):
                return memory.lazy_zeros(size[0], torch)
            return torch.zeros(*size, **kwargs)

    def created() -> Any:
        cache_module.torch = LazyZeros()
        try:
            processor = create()
        finally:
            cache_module.torch = torch
        tensor = getattr(getattr(processor, "cache", None), "cache_tensor", None)  # instance attributes: looked up
        if tensor is not None:
            made(tensor)
        return processor

    manager._create_batch_processor = created


def keep_cache_in_f16(manager: Any) -> None:
    """Have the paged cache each batch processor ``manager`` builds keep its keys and values in f16
    (engine/library/half_cache.py's ``paged_class``) while the model computes in fp32.

    The manager builds its cache as ``PagedAttentionCache(..., dtype=model.dtype)``, by the name in its module; while
    the processor is built that name is the f16 class (a subclass: the library's checks still see its own), then the
    library's again. The scheduler, built after the cache, is handed the f16 one."""
    module: Any = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
    library = module.PagedAttentionCache
    narrow = half_cache.paged_class(library)
    create = manager._create_batch_processor

    def created() -> Any:
        module.PagedAttentionCache = narrow
        try:
            return create()
        finally:
            module.PagedAttentionCache = library

    manager._create_batch_processor = created


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
    from transformers.generation.continuous_batching.continuous_api import OutputRouter

    class Router(OutputRouter):  # type: ignore[misc]
        def deliver(self, output: Any) -> None:
            deliver([output])

        def deliver_batch(self, outputs: list[Any]) -> None:
            deliver(outputs)

    return Router()
