"""Attention on CPU request by request, over the KV cache in place (``TTFT_PAGED_ATTENTION``, fp32).

A step of continuous batching holds several requests side by side. transformers gathers every key and value of the
step out of its paged cache into new tensors (an ``index_select`` of each, in every layer) and runs one SDPA over
them with a mask that keeps the requests apart, so each query row is multiplied with every key of the step, its own
request's or not. Here the cache only writes the new keys and values (:func:`read_in_place`) and hands over the
layer's cache rows and the step's key index; ``attention.c`` then attends each request's rows to its own keys, read
through the index, in fp32, with AVX-512 or AVX2 and FMA. Requests of more than :data:`LONG_ROWS` rows take SDPA over
their own gathered keys. A cache in f16 (``TTFT_KV_DTYPE``: engine/library/half_cache.py) is read by the same library's
functions for fp16 values, which widen each key and value as they load it: the bits the fp32 functions give over the
same values held in fp32.

A sliding-window layer's cache (Gemma 3's) is a ring of its window's rows, which the library reads before it writes
(a new row takes the place of the one that slid out). A step reads it in place where writing first loses no row the
step reads: each request's new rows land on none of the rows it reads (every decode step, and a prompt that ends
within the window); its keys, the rows read with the new ones in their places, are then in order and within every
query row's window, so the window is plain causal attention over them (:func:`window_index`). Other steps (a
prompt or chunk that wraps around the ring) take the library's reading and its attention for those layers.

The single-request engine's calls and the prefill process's (engine/first/process.py: prompts behind a cached
prefix, several side by side) take the same C function over their dense caches, by way of the ``sdpa`` function
engine/library/grouped.py registers: a request's rows come out of every engine bit for bit alike. The decoder layers in
C (engine/library/decoder.py) skip both the cache's update and the attention function in the batched steps: the cache's
:class:`InPlace` gives them each layer's cache rows and the step's index arrays, and one C call writes the new keys
and values and calls ``attention.c`` itself.

Owns: :func:`page` (the probe and the marks), :func:`paged_attention` (the call), :func:`read_in_place` and
:class:`InPlace` (the cache's side), and the random steps the probes at load and the tests share.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from ttft_sse.engine.kernels import compiler
from ttft_sse.engine.library import half_cache

log = structlog.get_logger("ttft_sse.engine")

PAGED = "ttft_paged_attention"
"""Attribute set on an attention module whose batched steps attend request by request (:func:`page`): the C
function."""
PAGED_PART = "ttft_attention_part"
"""Attribute set with :data:`PAGED`: the same library's function for some parts of a step only (a part: a query
row's heads of one KV head), by which the block kernel's helper threads share a batched step's attention
(helpers.c, decoder.c)."""
PAGED_HALF = "ttft_paged_attention_f16"
PAGED_PART_HALF = "ttft_attention_part_f16"
"""The same two functions for a KV cache of fp16 values (set with :data:`PAGED` where the model's caches are in f16)."""
KV = "ttft_kv"
"""The keyword argument by which a cache that reads in place (:func:`read_in_place`) hands a layer's KV rows and
the step's key index to the attention function."""
SOURCE = Path(__file__).with_name("attention.c")
LONG_ROWS = 512
"""Requests with more query rows than this in a step take SDPA, whose blocked products win on long prompts (figures:
docs/engine.md). 512 is the batched engine's default step (``TTFT_BATCH_TOKENS``): with it, every request of a step
takes C."""
PROBE_LONG = 5
"""The load probe's ``long_rows``: its small requests take both paths."""
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


DISPATCHES = "ttft_dispatches_in_place"
"""Set on the attention function that hands marked modules' calls to :func:`paged_attention`
(engine/library/grouped.py's ``grouped_sdpa``, registered as transformers' ``sdpa`` by its ``install``)."""


PLAIN = frozenset(
    {"position_ids", "use_cache", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    | {"logits_indices", "logits_processor_args", "read_index", "write_index", "block_table"}
)
"""Keyword arguments of transformers' attention calls that do not change what attention computes (continuous
batching's bookkeeping among them). Any other one set (a softcap, a sliding window, sinks, a position bias, asking
for the attention weights) sends the call to the library's function."""


def plain_kwargs(kwargs: dict[str, Any], keys: int | None = None) -> bool:
    """Whether an attention call's keyword arguments leave it one the C function computes (:data:`PLAIN`). A sliding
    window changes nothing where no query row has more keys than it: ``keys``, the most keys a row of the call
    sees, is at most the window (0 for a call over the paged cache read in place, whose sliding-window steps
    :func:`window_index` keeps so)."""
    for name, value in kwargs.items():
        if name in PLAIN or value is None or value is False:
            continue
        if name == "sliding_window" and keys is not None and keys <= int(value):
            continue
        return False
    return True


def build(directory: Path) -> Path:
    """attention.c's library built for this CPU in ``directory`` (compiler.build)."""
    return compiler.build(directory, (SOURCE,), "attention")


def start(directory: Path) -> None:
    """:func:`build`'s compile started in the background (compiler.start)."""
    compiler.start(directory, (SOURCE,), "attention")


def page(model: Any, torch: Any, directory: Path) -> int:
    """Mark ``model``'s attention modules so that the batched engine's steps attend request by request over the
    paged KV cache in place (``attention.c``, built in ``directory``), after checking it against SDPA over the
    gathered keys with the step's mask on a probe; returns how many were marked (0, logged with the reason, when it
    cannot be built, the CPU has neither AVX-512 nor AVX2 with FMA, or the probe disagrees). The marks are read by
    the attention function engine/library/grouped.py registers (``grouped.install``): the caller registers it."""
    modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim")]
    if not modules:
        return 0
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "sdpa":  # continuous batching would call another function than grouped.grouped_sdpa
        log.warning("attention_not_paged", reason=f"the model's attention is {implementation!r}, not 'sdpa'")
        return 0
    probe = modules[0]
    half = half_cache.in_f16(model)
    try:
        library = build(directory)
        function = _function(library)
        halves = compiler.load(library, PAGED_HALF, _ARGUMENTS)
        heads, dim = probe.config.num_attention_heads, probe.head_dim
        kv_heads = probe.config.num_key_value_heads
        # Past and new rows; the last two, longer than the probe's long_rows, take SDPA (with a past, then without).
        requests = [(3, 7), (1, 4), (2, 5), (PROBE_LONG + 1, PROBE_LONG + 3), (PROBE_LONG + 2, PROBE_LONG + 2)]
        query, key, value, mask = masked_step(torch, heads, kv_heads, dim, requests)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=probe.scaling, enable_gqa=True
        ).transpose(1, 2)
        kv = in_cache(torch, key, value, slots=2 * key.shape[2])  # the keys scattered among other rows
        setattr(probe, PAGED, function)
        longest = max(n for n, _ in requests)
        got = paged_attention(probe, query, kv, *starts(torch, requests), longest, probe.scaling, long_rows=PROBE_LONG)
        agree = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        reason = "request-by-request attention disagrees with SDPA over the gathered keys"
        if agree and half:  # over fp16 values: the bits of the fp32 function over the same values widened
            setattr(probe, PAGED_HALF, halves)
            rounded = tuple(x.to(torch.float16) for x in kv[:2])
            widened = tuple(x.to(torch.float32) for x in rounded)
            got = paged_attention(probe, query, (*rounded, kv[2]), *starts(torch, requests), longest, probe.scaling)
            want = paged_attention(probe, query, (*widened, kv[2]), *starts(torch, requests), longest, probe.scaling)
            agree = bool(torch.equal(got, want))
            reason = "request-by-request attention over an f16 cache disagrees with it over the same values in fp32"
    except (OSError, RuntimeError, AttributeError, TypeError) as exc:
        agree, reason = False, str(exc)
    if not agree and hasattr(probe, PAGED_HALF):
        delattr(probe, PAGED_HALF)
    marked = settle(modules, PAGED, function if agree else None, "paged", None if agree else reason)
    if marked:
        part = compiler.load(library, "ttft_attention_part", _PART_ARGUMENTS)
        half_part = compiler.load(library, PAGED_PART_HALF, _PART_ARGUMENTS)
        for module in modules:
            setattr(module, PAGED_PART, part)
            if half:
                setattr(module, PAGED_HALF, halves)
                setattr(module, PAGED_PART_HALF, half_part)
    return marked


def settle(modules: list[Any], attribute: str, value: Any, name: str, refusal: str | None) -> int:
    """After a probe on ``modules[0]``: set ``attribute`` to ``value`` on every module and log ``attention_<name>``,
    or, with a ``refusal``, take the probe's attribute off again and log ``attention_not_<name>`` with it. Returns
    how many modules were marked."""
    if refusal is not None:
        if hasattr(modules[0], attribute):
            delattr(modules[0], attribute)
        log.warning(f"attention_not_{name}", reason=refusal)
        return 0
    for module in modules:
        setattr(module, attribute, value)
    log.info(f"attention_{name}", modules=len(modules))
    return len(modules)


def paged(model: Any) -> bool:
    """Whether :func:`page` marked ``model``'s attention modules."""
    return any(getattr(m, PAGED, None) is not None for m in model.modules())


# q, heads, kv_heads, dim, k, v, key_stride, head_stride, index, cu_q, cu_k, requests, max_rows, scale, out
_ARGUMENTS = (_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR)
# the same, then first, last, before out
_PART_ARGUMENTS = (*_ARGUMENTS[:-1], _I64, _I64, _PTR)


def _function(path: Path) -> Any:
    function = compiler.load(path, "ttft_paged_attention", _ARGUMENTS)
    if function(None, 1, 1, 16, None, None, 0, 0, None, None, None, 0, 0, 1.0, None) == -2:
        raise RuntimeError("the CPU has neither AVX-512 nor AVX2 with FMA")
    return function


def paged_attention(
    module: Any,
    query: Any,
    kv: tuple[Any, Any, Any],
    cu_q: Any,
    cu_k: Any,
    longest: int,
    scaling: float,
    long_rows: int = LONG_ROWS,
) -> Any:
    """A batched step's attention, request by request: ``query`` is ``[1, heads, rows, dim]``; ``kv`` the layer's
    key and value rows (``[slots, kv_heads, dim]``, a view with any strides but a last one of 1, the same for both;
    fp32, or fp16 for a module marked for an f16 cache) and the step's key index into them; ``cu_q``, ``cu_k`` where
    each request's rows and keys start; ``longest`` the most query rows of a request. Returns ``[1, rows, heads,
    dim]``. Requests of more than ``long_rows`` rows take SDPA over their gathered keys (widened to fp32)."""
    import torch

    keys, values, index = kv
    if keys.stride() != values.stride() or keys.stride(2) != 1 or keys.dtype != values.dtype:
        raise RuntimeError("paged attention needs keys and values laid out alike, each vector contiguous")
    function = module.ttft_paged_attention if keys.dtype == torch.float32 else getattr(module, PAGED_HALF, None)
    if function is None or keys.dtype not in (torch.float32, torch.float16):
        raise RuntimeError(f"paged attention has no function for a {keys.dtype} cache here")
    q = query[0].transpose(0, 1).contiguous()
    _, heads, dim = q.shape
    out = torch.empty_like(q)
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    index = index.to(torch.int64)
    requests = cu_q.numel() - 1
    done = function(
        q.data_ptr(), heads, keys.shape[1], dim, keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
        index.data_ptr(), cu_q.data_ptr(), cu_k.data_ptr(), requests, long_rows, scaling, out.data_ptr(),
    )  # fmt: skip
    if done != 0:
        raise RuntimeError(f"paged attention failed ({done})")
    if longest > long_rows:
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        for s in range(requests):
            q0, q1, k0, k1 = starts_q[s], starts_q[s + 1], starts_k[s], starts_k[s + 1]
            if q1 - q0 <= long_rows:
                continue
            k, v = (x.index_select(0, index[k0:k1]).transpose(0, 1)[None].to(q.dtype) for x in (keys, values))
            # A prompt without a past is causal as SDPA aligns it (no mask: it skips the blocks above the diagonal);
            # one behind a shared prefix sees the prefix too.
            past = (k1 - k0) - (q1 - q0)
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(past) if past else None
            part = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, q0:q1], k, v, attn_mask=mask, is_causal=not past, scale=scaling, enable_gqa=True
            )
            out[q0:q1] = part[0].transpose(0, 1)
    return out[None]


def read_in_place(cache: Any) -> bool:
    """Make transformers' paged KV cache ``cache`` write each layer's new keys and values but not gather the step's
    keys and values into new tensors: it hands the attention function (``grouped.grouped_sdpa``, for modules
    :func:`page` marked) the layer's cache rows and the step's key index instead (keyword :data:`KV`). The cache
    also keeps an :class:`InPlace` (attribute :data:`IN_PLACE`), by which the decoder layers in C
    (engine/library/decoder.py) write and attend in one call. Full-attention layers' caches, and sliding-window ones'
    where a step can read them in place (:func:`window_index`; other steps of those layers read as the library
    does). Returns False, leaving the cache as it is, for any other allocator (or one whose internals this code
    does not know)."""
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )
    from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
        SlidingAttentionCacheAllocator,
    )

    known = (FullAttentionCacheAllocator, SlidingAttentionCacheAllocator)
    allocators = list(cache.cache_allocators.values())
    if not all(type(a) in known for a in allocators):
        log.warning("attention_not_paged", reason="the model has other than full- and sliding-attention layers")
        return False
    internals = ("_kv_page_views", "sentinel_index", "write_trash_index", "sliding_window")
    if not all(hasattr(a, name) for a in allocators if type(a) is SlidingAttentionCacheAllocator for name in internals):
        log.warning("attention_not_paged", reason="the sliding-window cache is not the one this code reads in place")
        return False
    library: Callable[..., tuple[Any, Any]] = cache.update
    in_place = InPlace(cache)

    def update(key_states: Any, value_states: Any, layer_idx: int, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if kwargs.get("block_table") is not None:  # the library's decode path for flash kernels (CUDA)
            return library(key_states, value_states, layer_idx, kwargs)
        index = in_place.index(kwargs, cache.layer_to_allocator[layer_idx])
        if index is None:  # a sliding-window step that overwrites what it reads: the library reads, then writes
            return library(key_states, value_states, layer_idx, kwargs)
        reads = kwargs["read_index"]
        kwargs["read_index"] = [i[:0] for i in reads]  # nothing to read: the library only writes
        try:
            states = library(key_states, value_states, layer_idx, kwargs)
        finally:
            kwargs["read_index"] = reads
        kwargs[KV] = (*in_place.rows[layer_idx], index)
        return states

    cache.update = update
    setattr(cache, IN_PLACE, in_place)
    return True


def _page_views(allocator: Any, layer: int) -> tuple[Any, Any]:
    """A layer's key and value pages: the library's block-table views, which a sliding-window allocator holds as
    its full-attention base does but does not hand out (the ring has no block-table path)."""
    if hasattr(allocator, "sliding_window"):
        views: tuple[Any, Any] = allocator._kv_page_views[layer]
        return views
    pages: tuple[Any, Any] = allocator.get_cache_for_block_table(layer)
    return pages


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


IN_PLACE = "ttft_in_place"
"""Attribute of a cache that reads in place (:func:`read_in_place`): its :class:`InPlace`."""


class Step(NamedTuple):
    """What every layer of one group of a batched step shares when it writes its keys and values and attends in one
    call (:meth:`InPlace.step`): the cache rows the new keys and values go to, one a new row (int64); the key index
    the attention reads through (int64); where each request's rows and keys start (int32, with the total last);
    how many requests; the cache rows' strides, in values (a key row, a head); how many rows they hold; whether they
    hold fp16 values (an f16 cache: engine/library/half_cache.py), else fp32."""

    write: Any
    index: Any
    cu_q: Any
    cu_k: Any
    requests: int
    key_stride: int
    head_stride: int
    slots: int
    half: bool


def _nothing() -> None:
    """:attr:`InPlace.before_kernel` where no engine asks for it."""


class InPlace:
    """A paged KV cache that reads in place (:func:`read_in_place`): each layer's key and value rows, as the
    library's indices count them, and the index arrays of the step in flight."""

    def __init__(self, cache: Any) -> None:
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
        self.between: Callable[[InPlace], None] | None = None
        """Called with this cache before each layer of a batched step that the decoder layers in C compute whole
        (engine/library/decoder.py): the batched engine's interludes (engine/first/interlude.py), where it runs them."""
        self.waiting: Any = None
        """With :attr:`between`, a ctypes int that is not 0 while it has something to do (a newcomer waits): the
        decoder layers run in one call (engine/library/stack.py's ``run_layers``) read it before each layer, and stop
        there for it. None: they run one by one, ``between`` called before each."""
        self.before_kernel: Callable[[], None] = _nothing
        """Called as a batched step's decoder layers in C are about to run (engine/library/stack.py, decoder.py), each
        time a layer or the stack of them goes into C, without the GIL: the batched engine posts the last step's outputs
        there (engine/batched/held.py)."""
        self.stacked: Any = None
        """The output of the step in flight's decoder layers, computed in one call by its first layer: the later
        layers pass it on."""

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
        :func:`page`, arguments that change nothing it computes, no request of more than :data:`LONG_ROWS` rows, the
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
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, None)
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


def masked_step(
    torch: Any, query_heads: int, kv_heads: int, dim: int, requests: Sequence[tuple[int, int]], seed: int = 0
) -> tuple[Any, Any, Any, Any]:
    """Random query, key and value of one batched step, and its mask, as continuous batching lays them out: the
    ``requests`` side by side, each ``(new rows, KV length)``, each row seeing its own request's KV up to its own
    position. For the probes at load and the tests."""
    rows, length = sum(r for r, _ in requests), sum(k for _, k in requests)
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, query_heads, rows, dim, generator=generator)
    key = torch.randn(1, kv_heads, length, dim, generator=generator)
    value = torch.randn(1, kv_heads, length, dim, generator=generator)
    allowed = torch.zeros(rows, length, dtype=torch.bool)
    row = column = 0
    for new, kv in requests:
        allowed[row : row + new, column : column + kv] = torch.ones(new, kv, dtype=torch.bool).tril(kv - new)
        row, column = row + new, column + kv
    mask = torch.zeros(rows, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return query, key, value, mask[None, None]


def in_cache(torch: Any, key: Any, value: Any, slots: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """A step's keys and values (``[1, kv_heads, keys, dim]``, as :func:`masked_step` gives them) written at random
    rows of a cache of ``slots`` rows of other random values (``[slots, kv_heads, dim]``), and the index that reads
    them back: the paged cache as :func:`paged_attention` reads it. For the probe at load and the tests."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randperm(slots, generator=generator)[: key.shape[2]]
    rows = [torch.randn(slots, key.shape[1], key.shape[3], generator=generator) for _ in range(2)]
    for target, source in zip(rows, (key, value), strict=True):
        target[index] = source[0].transpose(0, 1)
    return rows[0], rows[1], index


def starts(torch: Any, requests: Sequence[tuple[int, int]]) -> tuple[Any, Any]:
    """Where each of ``requests`` (new rows, keys) starts, rows then keys, with the total last (``cu_seq_lens_q``
    and ``cu_seq_lens_k``, as continuous batching passes them)."""
    return tuple(
        torch.tensor([0, *itertools.accumulate(request[i] for request in requests)], dtype=torch.int32) for i in (0, 1)
    )
