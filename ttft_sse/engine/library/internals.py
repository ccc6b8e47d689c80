"""The one module that imports transformers' private parts, names each of them, and checks them at start.

The engines build on parts of transformers that are not its public API: continuous batching's manager, batch
processor, paged cache and its allocators, scheduler, request states, model runner and per-request logits processors,
and attention's registry of functions and Llama's decoder layer. :data:`INTERNALS` names every module, class,
function and attribute the engine uses; :data:`SCHEDULER_STATE` the scheduler's instance attributes it reads (the
prefill set-aside and the urgent hold-back, engine/library/scheduler.py), :data:`ARGUMENTS` the constructors' keyword
arguments it passes, and :data:`MANAGER_STATE` the manager's instance attributes the batch processor is built from
(:func:`build_processors`). ``pyproject.toml`` pins the transformers versions the engine is tested with;
:func:`missing` checks at load that every one of those names is there, so that another version makes the batched
engine fall back to one ``model.generate`` per request (the library's public path) with one log line, rather than
crash mid-request or compute wrongly.

The rest of the engine takes these parts from here (:func:`batching`, :func:`attention`, :func:`modeling`), as plain
references: no other module imports them. Nothing of the library is replaced for the process: the engine's batch
processor is built with the engine's own cache and scheduler classes on its own manager (:func:`build_processors`),
and its attention function is registered under a name of its own (engine/library/grouped.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CB = "transformers.generation.continuous_batching"
INTERNALS: dict[str, tuple[str, ...]] = {
    f"{CB}.continuous_api": (
        "ContinuousBatchingManager._create_batch_processor",  # the engine's manager builds its processor its way
        "ContinuousBatchingManager.add_request",
        "ContinuousBatchingManager.cancel_request",
        "ContinuousBatchingManager.is_running",
        "ContinuousBatchingManager.pause",  # the prefix store reads and writes the cache between two steps
        "ContinuousBatchProcessor",
        "OutputRouter.deliver",
        "OutputRouter.deliver_batch",
        "update_cb_config_after_cache_creation",
        "SLIDING_ATTENTION",
    ),
    f"{CB}.cb_logits_processors": (
        "ContinuousBatchingLogitsProcessor.fill_defaults",
        "ContinuousBatchingLogitsProcessor.prepare_tensor_args",
        "ContinuousBatchingLogitsProcessorList",
    ),
    f"{CB}.scheduler": (
        "FIFOScheduler.schedule_batch",
        "FIFOScheduler._infer_request_tokens",
        "FIFOScheduler._schedule_request",
        "FIFOScheduler.reset",  # sets the state below (SCHEDULER_STATE)
    ),
    f"{CB}.requests": (
        "RequestStatus.PENDING",
        "RequestStatus.PREFILLING",
        "RequestStatus.DECODING",
        "RequestState.status",
    ),
    f"{CB}.model_runner": ("ModelRunner._sample",),
    f"{CB}.cache": (
        "PagedAttentionCache.update",
        "PagedAttentionCache.mark_complete_blocks",
        "PagedAttentionCache.search_prefix_match",
        "PagedAttentionCache.free_blocks",
        "PagedAttentionCache.can_store_request_tokens",
    ),
    f"{CB}.cache_allocators.cache_allocator": (
        "CacheAllocator.match_prefix_blocks",
        "CacheAllocator.mark_complete_blocks",
        "BlockLedger.register_new_hash",
        "BlockLedger.acquire",  # the prefix store holds the blocks it restores (engine/batched/prefix_store.py)
        "compute_block_hash",  # engine/library/salts.py chains it from a request's salt
    ),
    f"{CB}.cache_allocators.cache_pool": (  # the prefix store takes free blocks for what it restores
        "CachePool.allocate_sector",
        "CachePool.get_free_blocks",
        "CachePool.count_free_blocks",
    ),
    f"{CB}.cache_allocators.full_attention": (
        "FullAttentionCacheAllocator.get_cache_for_block_table",
        "FullAttentionCacheAllocator.get_read_indices",
        "FullAttentionCacheAllocator.get_write_indices",
    ),
    f"{CB}.cache_allocators.sliding_attention": ("SlidingAttentionCacheAllocator",),
    "transformers.modeling_utils": ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface.register"),
    "transformers.models.llama.modeling_llama": ("LlamaDecoderLayer", "eager_attention_forward"),
    "transformers": ("ContinuousBatchingConfig", "GenerationConfig"),
}
"""Every module and attribute path of the library the engines use beyond its public API."""

SCHEDULER_STATE = ("active_requests", "waiting_requests", "waiting_requests_order", "max_requests_per_batch", "cache")
"""The FIFO scheduler's instance attributes the engine's scheduler reads and rearranges between two steps."""

ARGUMENTS: dict[tuple[str, str], tuple[str, ...]] = {
    (f"{CB}.continuous_api", "ContinuousBatchProcessor"): (
        "cache", "config", "generation_config", "continuous_batching_config", "logit_processor", "input_queue",
        "cancel_queue", "output_router", "background_thread_status", "model_device", "model_dtype", "scheduler",
        "distributed_helper",
    ),
    (f"{CB}.cache", "PagedAttentionCache"): (
        "config", "continuous_batching_config", "device", "distributed_helper", "dtype",
        "model_supports_logits_to_keep",
    ),
    (f"{CB}.scheduler", "FIFOScheduler"): ("cache", "safety_margin", "max_requests_per_batch"),
}  # fmt: skip
"""The keyword arguments :func:`build_processors` passes to the library's constructors, as the manager passes them."""

MANAGER_STATE = (
    "batch_processor", "model", "continuous_batching_config", "distributed_helper", "generation_config",
    "logit_processor", "input_queue", "cancel_queue", "is_tp_driver", "output_router", "background_thread_status",
    "_use_prefix_sharing",
)  # fmt: skip
"""The manager's instance attributes :func:`build_processors` reads (and ``_use_prefix_sharing``, which it writes), as
the manager's own ``_create_batch_processor`` does."""


def missing(internals: dict[str, tuple[str, ...]] = INTERNALS) -> list[str]:
    """The dotted names of ``internals``, the scheduler's state and the constructors' arguments that the installed
    transformers lacks (empty when all are there)."""
    found: list[str] = []
    for module_name, paths in internals.items():
        try:
            module: Any = importlib.import_module(module_name)
        except ImportError:
            found.append(module_name)
            continue
        for path in paths:
            if _lookup(module, path) is None:
                found.append(f"{module_name}.{path}")
    if internals is not INTERNALS or found:
        return found
    for (module_name, name), arguments in ARGUMENTS.items():
        parameters = inspect.signature(getattr(importlib.import_module(module_name), name).__init__).parameters
        found += [f"{module_name}.{name}({argument}=)" for argument in arguments if argument not in parameters]
    scheduler = importlib.import_module(f"{CB}.scheduler").FIFOScheduler(None, None, 1)  # no cache: its state alone
    found += [f"{CB}.scheduler.FIFOScheduler().{name}" for name in SCHEDULER_STATE if not hasattr(scheduler, name)]
    return found


def missing_on(manager: Any) -> list[str]:
    """The names of :data:`MANAGER_STATE` that ``manager`` (the library's, just made) lacks."""
    return [f"ContinuousBatchingManager().{name}" for name in MANAGER_STATE if not hasattr(manager, name)]


def _lookup(module: Any, path: str) -> Any:
    found: Any = module
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


@dataclass(frozen=True)
class Batching:
    """Continuous batching's private parts, as the engine uses them."""

    processor: Any  # ContinuousBatchProcessor
    paged_cache: Any  # PagedAttentionCache
    fifo_scheduler: Any  # FIFOScheduler
    status: Any  # RequestStatus
    output_router: Any  # OutputRouter
    logits_processor: Any  # ContinuousBatchingLogitsProcessor
    logits_processors: Any  # ContinuousBatchingLogitsProcessorList
    compute_block_hash: Callable[[Any, list[int]], int]
    full_allocator: Any  # FullAttentionCacheAllocator
    sliding_allocator: Any  # SlidingAttentionCacheAllocator
    update_config: Callable[..., None]  # update_cb_config_after_cache_creation
    sliding: str  # SLIDING_ATTENTION, the allocators' key of sliding-window layers


@functools.cache
def batching() -> Batching:
    """Continuous batching's private parts (imports them, once; :func:`missing` says first whether they are there)."""
    api = importlib.import_module(f"{CB}.continuous_api")
    processors = importlib.import_module(f"{CB}.cb_logits_processors")
    allocators = f"{CB}.cache_allocators"
    return Batching(
        processor=api.ContinuousBatchProcessor,
        paged_cache=importlib.import_module(f"{CB}.cache").PagedAttentionCache,
        fifo_scheduler=importlib.import_module(f"{CB}.scheduler").FIFOScheduler,
        status=importlib.import_module(f"{CB}.requests").RequestStatus,
        output_router=api.OutputRouter,
        logits_processor=processors.ContinuousBatchingLogitsProcessor,
        logits_processors=processors.ContinuousBatchingLogitsProcessorList,
        compute_block_hash=importlib.import_module(f"{allocators}.cache_allocator").compute_block_hash,
        full_allocator=importlib.import_module(f"{allocators}.full_attention").FullAttentionCacheAllocator,
        sliding_allocator=importlib.import_module(f"{allocators}.sliding_attention").SlidingAttentionCacheAllocator,
        update_config=api.update_cb_config_after_cache_creation,
        sliding=api.SLIDING_ATTENTION,
    )


@dataclass(frozen=True)
class Attention:
    """Attention's private parts: the registry models look their attention function up in, and Llama's pieces that
    the fused decoder layers (engine/library/decoder.py) are built from."""

    functions: Any  # ALL_ATTENTION_FUNCTIONS: the registry every model's attention calls through
    interface: Any  # AttentionInterface: ``register`` adds a name to it
    decoder_layer: Any  # LlamaDecoderLayer
    eager: Callable[..., Any]  # eager_attention_forward: the registry's default


@functools.cache
def attention() -> Attention:
    """Attention's private parts (imports them, once)."""
    modeling = importlib.import_module("transformers.modeling_utils")
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    return Attention(
        functions=modeling.ALL_ATTENTION_FUNCTIONS,
        interface=modeling.AttentionInterface,
        decoder_layer=llama.LlamaDecoderLayer,
        eager=llama.eager_attention_forward,
    )


def modeling(module: str, *names: str) -> tuple[Any, ...]:
    """The classes ``names`` of the model module ``module`` (``transformers.models.<family>.modeling_<family>``);
    ImportError or AttributeError where that transformers has no such module or class."""
    found = importlib.import_module(module)
    return tuple(getattr(found, name) for name in names)


def build_processors(manager: Any, cache: Callable[..., Any], scheduler: type, made: Callable[[Any], None]) -> None:
    """Have ``manager`` (the library's ``ContinuousBatchingManager``, for this engine alone) build its batch
    processor as its own ``_create_batch_processor`` does (transformers 5.25), with the paged cache made by ``cache``
    (the library's class or a subclass: engine/library/paged_cache.py) and a ``scheduler`` of the class given, and
    hand each processor it makes to ``made`` (in the batching loop's thread, as the loop starts). Set on the
    manager instance: nothing of the library changes for another manager."""
    parts = batching()

    def create() -> Any:
        processor = getattr(manager, "batch_processor", None)
        if isinstance(processor, parts.processor):  # a restarted loop keeps its processor, reset
            processor.reset()
            return processor
        model, config = manager.model, manager.continuous_batching_config
        supports_logits_to_keep = getattr(model, "_supports_logits_to_keep", None)
        paged = cache(
            config=model.config.get_text_config(),
            continuous_batching_config=config,
            device=model.device,
            distributed_helper=manager.distributed_helper,
            dtype=model.dtype,
            model_supports_logits_to_keep=callable(supports_logits_to_keep) and supports_logits_to_keep(),
        )
        manager._use_prefix_sharing = paged.use_prefix_sharing
        parts.update_config(cb_config=config, num_blocks=paged.num_blocks, max_batch_tokens=paged.max_batch_tokens)
        if parts.sliding in paged.cache_allocators:  # the library's decode path takes no sliding-window layers
            config.max_blocks_per_request = 0
        processor = parts.processor(
            cache=paged,
            config=model.config.get_text_config(),
            generation_config=manager.generation_config,
            continuous_batching_config=config,
            logit_processor=manager.logit_processor,
            input_queue=manager.input_queue if manager.is_tp_driver else None,
            cancel_queue=manager.cancel_queue if manager.is_tp_driver else None,
            output_router=manager.output_router,
            background_thread_status=manager.background_thread_status,
            model_device=model.device,
            model_dtype=model.dtype,
            scheduler=scheduler(
                cache=paged,
                safety_margin=config.safety_margin,
                max_requests_per_batch=config.max_requests_per_batch,
            ),
            distributed_helper=manager.distributed_helper,
        )
        made(processor)
        return processor

    manager._create_batch_processor = create
