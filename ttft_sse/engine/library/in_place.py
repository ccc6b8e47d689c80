"""The paged KV cache read in place (``TTFT_PAGED_ATTENTION``, on CPU in fp32): the batched engine's cache writes each
layer's new keys and values and gathers nothing; its :class:`InPlace` hands the attention function
(engine/library/grouped.py's ``grouped_sdpa``, for modules it marked) the layer's cache rows and the step's key index
instead (keyword :data:`~ttft_sse.engine.kernels.attention.KV`), which attention.c reads request by request
(engine/kernels/attention.py); and it gives the decoder layers in C (engine/library/decoder.py, stack.py) each
layer's cache rows and the step's index arrays, by which one C call writes and attends.

Full-attention layers' caches are read in place, and sliding-window ones' where a step can be (:func:`window_index`;
other steps of those layers read as the library does). :func:`reads_in_place` says whether a cache's allocators are
ones this module knows; the engine's paged cache (engine/library/paged_cache.py) keeps an :class:`InPlace` where they
are, with the engine's :class:`StepHooks`, handed in explicitly: what runs between two layers of a step (the
interludes) and as its layers go into C (the held outputs' release).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ttft_sse.engine.kernels.attention import DISPATCHES, KV, LONG_ROWS, PAGED, Step, plain_kwargs
from ttft_sse.engine.library import internals

log = structlog.get_logger("ttft_sse.engine")


def _nothing() -> None:
    """:attr:`StepHooks.before_kernel` where no engine asks for one."""


@dataclass(frozen=True)
class StepHooks:
    """What the batched engine runs inside its steps over the cache read in place (in the batching thread)."""

    before_kernel: Callable[[], None] = _nothing
    """Called as a step's decoder layers in C are about to run, each time a layer or the stack of them goes into C,
    without the GIL (engine/library/stack.py, decoder.py): the engine posts the last step's outputs there
    (engine/batched/held.py)."""
    between: Callable[[InPlace], None] | None = None
    """Called with the cache before each layer of a batched step that the decoder layers in C compute whole, and
    between two steps while streams decode (engine/library/scheduler.py): the interludes (engine/first/interlude.py),
    where they run."""
    waiting: Any = None
    """With :attr:`between`, a ctypes int that is not 0 while it has something to do (a newcomer waits): the decoder
    layers run in one call (stack.run_layers) read it before each layer, and stop there for it. None: they run one by
    one, ``between`` called before each."""


def reads_in_place(cache: Any) -> bool:
    """Whether transformers' paged KV cache ``cache`` is one whose layers this module reads in place: only full- and
    sliding-attention allocators, the sliding ones with the internals :func:`window_index` reads (logged where not:
    the cache then gathers as the library does)."""
    parts = internals.batching()
    known = (parts.full_allocator, parts.sliding_allocator)
    allocators = list(cache.cache_allocators.values())
    if not all(type(a) in known for a in allocators):
        log.warning("attention_not_paged", reason="the model has other than full- and sliding-attention layers")
        return False
    names = ("_kv_page_views", "sentinel_index", "write_trash_index", "sliding_window")
    if not all(hasattr(a, name) for a in allocators if type(a) is parts.sliding_allocator for name in names):
        log.warning("attention_not_paged", reason="the sliding-window cache is not the one this code reads in place")
        return False
    return True


class InPlace:
    """A paged KV cache that reads in place (engine/library/paged_cache.py): each layer's key and value rows, as the
    library's indices count them, the index arrays of the step in flight, and the engine's step hooks."""

    def __init__(self, cache: Any, hooks: StepHooks) -> None:
        self.cache = cache
        # Each layer's key and value rows: its page views, flattened. They cover every row an index reaches (the
        # value rows' length, the shorter view).
        self.rows: dict[int, tuple[Any, Any]] = {
            layer: tuple(x.flatten(0, 1) for x in _page_views(allocator, layer))
            for layer, allocator in cache.layer_to_allocator.items()
        }
        # The step whose key indices are held (its kwargs' write index list) and each group's (None: not in place).
        self._indices: tuple[Any, dict[int, Any]] = (None, {})
        # The step in flight: its kwargs' index list and query starts (held, so that their identity names the step)
        # and its Step for each allocator group.
        self._step: tuple[Any, Any, dict[int, Step]] = (None, None, {})
        self.between = hooks.between  # the engine's StepHooks: read by the decoder layers in C and the scheduler
        self.waiting = hooks.waiting
        self.before_kernel = hooks.before_kernel
        self.stacked: Any = None
        """The output of the step in flight's decoder layers, computed in one call by its first layer: the later
        layers pass it on."""

    def update(
        self,
        store: Callable[..., tuple[Any, Any]],
        key_states: Any,
        value_states: Any,
        layer: int,
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any]:
        """The cache's update in a step (``store``: the library's, which writes the new rows and reads the step's):
        the new rows written, nothing gathered, the layer's rows and the step's key index handed to the attention
        function in ``kwargs`` (:data:`KV`). The library's read where the step cannot be read in place."""
        if kwargs.get("block_table") is not None:  # the library's decode path for flash kernels (CUDA)
            return store(key_states, value_states, layer, kwargs)
        index = self.index(kwargs, self.cache.layer_to_allocator[layer])
        if index is None:  # a sliding-window step that overwrites what it reads: the library reads, then writes
            return store(key_states, value_states, layer, kwargs)
        reads = kwargs["read_index"]
        kwargs["read_index"] = [i[:0] for i in reads]  # nothing to read: the library only writes
        try:
            states = store(key_states, value_states, layer, kwargs)
        finally:
            kwargs["read_index"] = reads
        kwargs[KV] = (*self.rows[layer], index)
        return states

    def index(self, kwargs: dict[str, Any], allocator: Any) -> Any:
        """The key index the layers of ``allocator`` read in place in the step ``kwargs`` describe (int64), or None
        where they cannot (a sliding-window step that overwrites what it reads: :func:`window_index`). Made once a
        step and group."""
        writes, held = self._indices
        if writes is not kwargs["write_index"]:
            writes, held = kwargs["write_index"], {}
            self._indices = (writes, held)
        group = allocator.index
        if group not in held:
            import torch

            if hasattr(allocator, "sliding_window"):
                write = writes[group].to(torch.int64)
                found = window_index(kwargs["read_index"][group].to(torch.int64), write, allocator, torch)
            else:
                found = key_index(kwargs, group).to(torch.int64)
            held[group] = None if found is None else found.contiguous()
        return held[group]

    def step(self, module: Any, kwargs: dict[str, Any]) -> Step | None:
        """For a layer's call in a batched step that :func:`paged_attention` computes whole (``module`` marked by
        grouped.page, arguments that change nothing it computes, no request of more than :data:`LONG_ROWS` rows, the
        attention function ``grouped.grouped_sdpa``), what that step's layers of ``module``'s group share; None for
        any other call, which goes through the cache's update and the attention function. Computed once a step and
        group: the layers of a forward pass are handed the same kwargs."""
        if getattr(module, PAGED, None) is None:
            return None
        writes, starts_q, steps = self._step
        allocator = self.cache.layer_to_allocator[module.layer_idx]
        group = allocator.index
        if writes is kwargs.get("write_index") and starts_q is kwargs.get("cu_seq_lens_q") and group in steps:
            return steps[group]  # the step's next layer: its first one checked the same kwargs
        if (
            kwargs.get("block_table") is not None
            or kwargs.get("write_index") is None
            or int(kwargs["max_length_q"]) > LONG_ROWS
            or not plain_kwargs(kwargs)
        ):
            return None
        interface = internals.attention().functions.get_interface(module.config._attn_implementation, None)
        if not getattr(interface, DISPATCHES, False):  # not engine/library/grouped.py's function: the library's
            return None
        import torch

        if writes is not kwargs["write_index"] or starts_q is not kwargs["cu_seq_lens_q"]:
            writes, starts_q, steps = kwargs["write_index"], kwargs["cu_seq_lens_q"], {}
            self._step = (writes, starts_q, steps)
        index = self.index(kwargs, allocator)
        if index is None:
            return None
        write = writes[group].to(torch.int64).contiguous()
        keys = self.rows[module.layer_idx][0]
        slots = int(keys.shape[0])
        if any(int(t.max()) >= slots for t in (write, index) if t.numel()):
            raise RuntimeError("a step's cache index reaches past the cache")
        cu_q = starts_q.to(torch.int32).contiguous()
        cu_k = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32).contiguous()
        half = keys.dtype == torch.float16
        found = Step(write, index, cu_q, cu_k, cu_q.numel() - 1, keys.stride(0), keys.stride(1), slots, half)
        steps[group] = found
        return found


def window_index(read: Any, write: Any, allocator: Any, torch: Any) -> Any:
    """The keys a step's attention reads in place for the layers of sliding-window ``allocator``, or None where it
    cannot: the library's ``read`` index (each request's cached rows in order, then a placeholder for each new row)
    with the new rows' ``write`` rows in the placeholders' places, if the new rows are all stored (none past the
    window, sent to the library's trash row) and none lands on a row read (which writing first would overwrite).
    Then each request's keys are at most its window, in order, so every query row's window holds all of its causal
    keys."""
    if bool((write == allocator.write_trash_index).any()):
        return None
    if read.numel() == 0:  # new prompts alone: their own rows
        return write
    placeholders = read == allocator.sentinel_index
    if bool(torch.isin(write, read[~placeholders]).any()):
        return None
    index = read.clone()
    index[placeholders] = write
    return index


def key_index(kwargs: dict[str, Any], group: int) -> Any:
    """The keys a batched step's attention reads for the layers of allocator ``group``, from its kwargs: the read
    index, or in a step of new prompts only (nothing to read) the rows written now, in order."""
    index = kwargs["read_index"][group]
    return kwargs["write_index"][group] if index.numel() == 0 else index


def _page_views(allocator: Any, layer: int) -> tuple[Any, Any]:
    """A layer's key and value pages: the library's block-table views, which a sliding-window allocator holds as
    its full-attention base does but does not hand out (the ring has no block-table path)."""
    if hasattr(allocator, "sliding_window"):
        views: tuple[Any, Any] = allocator._kv_page_views[layer]
        return views
    pages: tuple[Any, Any] = allocator.get_cache_for_block_table(layer)
    return pages
