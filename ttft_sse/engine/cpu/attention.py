"""Attention on CPU for the batched engine's steps: request by request over the paged KV cache in place, or SDPA
over grouped KV heads in place.

**Request by request** (:func:`page`, ``TTFT_PAGED_ATTENTION``, fp32): a step of continuous batching holds several
requests side by side. transformers gathers every key and value of the step out of its paged cache into new tensors
(an ``index_select`` of each, in every layer), then runs one SDPA over them with a mask that keeps the requests
apart, so each query row is multiplied with every key of the step, its own request's or not: 8 streams of 100
tokens cost 8 x 800 dot products a head instead of 8 x 100. :func:`read_in_place` makes the cache only write the
new keys and values and hand over the layer's cache rows and the step's key index; ``attention.c`` then attends
each request's rows to its own keys, read through the index, in fp32, with AVX-512 or AVX2 and FMA (requests of
more than :data:`LONG_ROWS` rows take SDPA over their own gathered keys). The single-request engine's calls take
the same function over its dense cache, and so do the prefill process's (engine/batched/prefill.py: prompts behind a
cached prefix, several side by side), so that a request's rows come out of every engine bit for bit alike. The
decoder layers in C (engine/cpu/decoder.py) skip both the cache's update and the wrapper in the batched steps: the
cache's :class:`InPlace` gives them each layer's cache rows and the step's index arrays, and one C call writes the
new keys and values and calls ``attention.c`` itself.
Measured on the bundled model (one thread, AVX-512, the engine's timeline of forward passes, ``/tmp`` script):
a decode step of 8 streams 51.4 → 46.1 ms, a step of 7 streams and a 15-token prompt 85 → 75 ms, one stream's
32.4 → 32.0 ms; the engine's figures: docs/benchmarks.md.

**Grouped KV heads** (:func:`group`, ``TTFT_GROUPED_ATTENTION``), for the masked SDPA calls left (paged attention
off, another dtype, long prompts):

Models with grouped-query attention keep fewer KV heads than query heads (SmolLM2-135M: 3 for 9). torch's SDPA
takes them as they are (``enable_gqa=True``), but transformers' SDPA function uses that only on CPU calls without a
mask. A step of the batched engine always has one (the batch's requests, side by side in one sequence, must not see
each other), so for every layer of every step transformers first copies each KV head once per query head of its
group (``repeat_kv``), and SDPA then reads three times the KV. Measured on this machine (one thread, one SDPA call
with the engine's mask, µs; ``benchmarks/attention.py``):

=========================================== ============= ============
call                                        heads copied  heads in place
=========================================== ============= ============
decode step, 8 streams of 80 tokens         564           180
decode step, 8 streams of 200 tokens        1170          468
a 37-token prompt beside 7 streams of 80    1068          718
a 37-token prompt alone                     117           88
=========================================== ============= ============

A decode step of 8 streams of 80 tokens calls it once a layer: 30 layers, 17 → 5 ms of a ~120 ms step; the
engine's tokens/s at 8 streams, measured with the marks off and on: +5-9 %.

:func:`group` marks a model's attention modules so that their masked calls of more than one query row go to SDPA
with the grouped heads in place; every other call (one query row, no mask, a module not marked) is transformers'
own function, unchanged. transformers' ``TRANSFORMERS_SDPA_FORCE_GQA=1`` does the same for every call of the
process, which is wrong on CUDA (SDPA with a mask and grouped heads falls back to its slowest kernel there); the
engine marks only models loaded on CPU. The batched engine's figures with and without it: docs/benchmarks.md.

transformers looks its attention functions up by name at every call, and continuous batching accepts only the name
``sdpa`` (or flash or ``paged|eager``): :func:`group` and :func:`page` register this module's function under that
name, once per process, and it hands every call it does not take to the function it replaced.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from ttft_sse.engine.cpu import kernel

log = structlog.get_logger("ttft_sse.engine")

MARK = "ttft_grouped_sdpa"
"""Attribute set on an attention module whose masked calls take :func:`grouped_sdpa`."""
PAGED = "ttft_paged_attention"
"""Attribute set on an attention module whose batched steps attend request by request (:func:`page`): the C
function."""
PAGED_PART = "ttft_attention_part"
"""Attribute set with :data:`PAGED`: the same library's function for some parts of a step only (a part: a query
row's heads of one KV head), by which the block kernel's helper threads share a batched step's attention
(kernel.c, decoder.c)."""
KV = "ttft_kv"
"""The keyword argument by which a cache that reads in place (:func:`read_in_place`) hands a layer's KV rows and
the step's key index to the attention function."""
SOURCE = Path(__file__).with_name("attention.c")
LONG_ROWS = 512
"""Requests with more query rows than this in a step take SDPA: from ~1000 rows on its blocked products are faster
(one 9-head layer, µs: 65 rows 123 against SDPA's 205, 512 rows 5229 against 7059, 1024 rows 18932 against 16806).
512 is the batched engine's default step (``TTFT_BATCH_TOKENS``): with it, every request of a step takes C."""
PROBE_LONG = 5
"""The load probe's ``long_rows``: its small requests take both paths."""
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def group(model: Any, torch: Any) -> int:
    """Mark ``model``'s attention modules with grouped KV heads for :func:`grouped_sdpa`, after checking it against
    transformers' own function on a probe; returns how many were marked (0, logged, when the probe disagrees)."""
    modules = [m for m in model.modules() if getattr(m, "num_key_value_groups", 1) > 1]
    if not modules:
        return 0
    library = _install()
    probe = modules[0]
    try:
        groups, dim = probe.num_key_value_groups, probe.head_dim
        kv_heads = probe.config.num_key_value_heads
        step = masked_step(torch, kv_heads * groups, kv_heads, dim, [(3, 3), (1, 4), (2, 5)])
        want = library(probe, *step, scaling=probe.scaling)[0]
        setattr(probe, MARK, True)
        got = grouped_sdpa(probe, *step, scaling=probe.scaling)[0]
        agree = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        reason = "SDPA over grouped heads disagrees with repeated heads"
    except (AttributeError, RuntimeError, TypeError) as exc:  # an attention module unlike Llama's, an old torch
        agree, reason = False, repr(exc)
    return _settle(modules, MARK, True, "grouped", None if agree else reason)


def page(model: Any, torch: Any, directory: Path) -> int:
    """Mark ``model``'s attention modules so that the batched engine's steps attend request by request over the
    paged KV cache in place (``attention.c``, built in ``directory``), after checking it against SDPA over the
    gathered keys with the step's mask on a probe; returns how many were marked (0, logged with the reason, when it
    cannot be built, the CPU has neither AVX-512 nor AVX2 with FMA, or the probe disagrees)."""
    modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim")]
    if not modules:
        return 0
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "sdpa":  # continuous batching would call another function than grouped_sdpa
        log.warning("attention_not_paged", reason=f"the model's attention is {implementation!r}, not 'sdpa'")
        return 0
    _install()
    probe = modules[0]
    try:
        library = kernel.build(directory, (SOURCE,), "attention")
        function = _function(library)
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
    except (OSError, RuntimeError, AttributeError, TypeError) as exc:
        agree, reason = False, str(exc)
    marked = _settle(modules, PAGED, function if agree else None, "paged", None if agree else reason)
    if marked:
        part = kernel.load(library, "ttft_attention_part", _PART_ARGUMENTS)
        for module in modules:
            setattr(module, PAGED_PART, part)
    return marked


def _settle(modules: list[Any], attribute: str, value: Any, name: str, refusal: str | None) -> int:
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
    function = kernel.load(path, "ttft_paged_attention", _ARGUMENTS)
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
    key and value rows (``[slots, kv_heads, dim]``, a view with any strides but a last one of 1, the same for both)
    and the step's key index into them; ``cu_q``, ``cu_k`` where each request's rows and keys start; ``longest``
    the most query rows of a request. Returns ``[1, rows, heads, dim]``. Requests of more than ``long_rows`` rows
    take SDPA over their gathered keys."""
    import torch

    keys, values, index = kv
    if keys.stride() != values.stride() or keys.stride(2) != 1:
        raise RuntimeError("paged attention needs keys and values laid out alike, each vector contiguous")
    q = query[0].transpose(0, 1).contiguous()
    _, heads, dim = q.shape
    out = torch.empty_like(q)
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    index = index.to(torch.int64)
    requests = cu_q.numel() - 1
    done = module.ttft_paged_attention(
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
            k, v = (x.index_select(0, index[k0:k1]).transpose(0, 1)[None] for x in (keys, values))
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
    """Make transformers' paged KV cache ``cache`` write each layer's new keys and values but no longer gather the
    step's keys and values into new tensors: it hands the attention function (:func:`grouped_sdpa`, for modules
    :func:`page` marked) the layer's cache rows and the step's key index instead (keyword :data:`KV`). The cache
    also keeps an :class:`InPlace` (attribute :data:`IN_PLACE`), by which the decoder layers in C
    (engine/cpu/decoder.py) write and attend in one call. Only for caches of full-attention layers (sliding windows are
    left as they are: returns False)."""
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )

    if not all(type(a) is FullAttentionCacheAllocator for a in cache.cache_allocators.values()):
        log.warning("attention_not_paged", reason="the model has other than full-attention layers")
        return False
    library: Callable[..., tuple[Any, Any]] = cache.update
    in_place = InPlace(cache)

    def update(key_states: Any, value_states: Any, layer_idx: int, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if kwargs.get("block_table") is not None:  # the library's decode path for flash kernels (CUDA)
            return library(key_states, value_states, layer_idx, kwargs)
        reads = kwargs["read_index"]
        index = key_index(kwargs, cache.layer_to_allocator[layer_idx].index)
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
    how many requests; the cache rows' strides, in floats (a key row, a head); how many rows they hold."""

    write: Any
    index: Any
    cu_q: Any
    cu_k: Any
    requests: int
    key_stride: int
    head_stride: int
    slots: int


class InPlace:
    """A paged KV cache that reads in place (:func:`read_in_place`): each layer's key and value rows, as the
    library's indices count them, and the index arrays of the step in flight."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        # Each layer's key and value rows: its page views, flattened. They cover every row an index reaches (the
        # value rows' length, the shorter view).
        self.rows: dict[int, tuple[Any, Any]] = {
            layer: tuple(x.flatten(0, 1) for x in allocator.get_cache_for_block_table(layer))
            for layer, allocator in cache.layer_to_allocator.items()
        }
        # The step in flight: its kwargs' index list and query starts (held, so that their identity names the step)
        # and its Step for each allocator group.
        self._step: tuple[Any, Any, dict[int, Step]] = (None, None, {})
        self.between: Callable[[InPlace], None] | None = None
        """Called with this cache before each layer of a batched step that the decoder layers in C compute whole
        (engine/cpu/decoder.py): the batched engine's interludes (engine/batched/interlude.py), where it runs them."""
        self.waiting: Any = None
        """With :attr:`between`, a ctypes int that is not 0 while it has something to do (a newcomer waits): the
        decoder layers run in one call (engine/cpu/decoder.py's ``run_layers``) read it before each layer, and stop
        there for it. None: they run one by one, ``between`` called before each."""
        self.stacked: Any = None
        """The output of the step in flight's decoder layers, computed in one call by its first layer: the later
        layers pass it on."""

    def step(self, module: Any, kwargs: dict[str, Any]) -> Step | None:
        """For a layer's call in a batched step that :func:`paged_attention` computes whole (``module`` marked by
        :func:`page`, arguments that change nothing it computes, no request of more than :data:`LONG_ROWS` rows,
        the attention function :func:`grouped_sdpa`), what that step's layers of ``module``'s group share; None for
        any other call, which goes through the cache's update and the attention function. Computed once a step
        and group: the layers of a forward pass are handed the same kwargs."""
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
            or not _plain(kwargs)
        ):
            return None
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, None) is not grouped_sdpa:
            return None
        import torch

        if writes is not kwargs["write_index"] or starts_q is not kwargs["cu_seq_lens_q"]:
            writes, starts_q, steps = kwargs["write_index"], kwargs["cu_seq_lens_q"], {}
            self._step = (writes, starts_q, steps)
        write = writes[group].to(torch.int64).contiguous()
        index = key_index(kwargs, group).to(torch.int64).contiguous()
        keys = self.rows[module.layer_idx][0]
        slots = int(keys.shape[0])
        if any(int(t.max()) >= slots for t in (write, index) if t.numel()):
            raise RuntimeError("a step's cache index reaches past the cache")
        cu_q = starts_q.to(torch.int32).contiguous()
        cu_k = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32).contiguous()
        found = Step(write, index, cu_q, cu_k, cu_q.numel() - 1, keys.stride(0), keys.stride(1), slots)
        steps[group] = found
        return found


def masked_step(
    torch: Any, query_heads: int, kv_heads: int, dim: int, requests: Sequence[tuple[int, int]], seed: int = 0
) -> tuple[Any, Any, Any, Any]:
    """Random query, key and value of one batched step, and its mask, as continuous batching lays them out: the
    ``requests`` side by side, each ``(new rows, KV length)``, each row seeing its own request's KV up to its own
    position. For the probe at load, the tests and the benchmark."""
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
    them back: the paged cache as :func:`paged_attention` reads it. For the probe at load, the tests and the
    benchmark."""
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


def grouped_sdpa(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' SDPA attention function, with grouped KV heads attended in place for a marked module's masked
    calls of more than one query row (the only calls where transformers repeats them on CPU), and request by
    request over the KV cache in place for the batched steps of a module :func:`page` marked."""
    kv = kwargs.pop(KV, None)
    paged = getattr(module, PAGED, None) is not None and _plain(kwargs)
    scale = module.scaling if scaling is None else scaling
    if kv is not None:
        if paged:
            cu_q, cu_k, longest = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], int(kwargs["max_length_q"])
            return paged_attention(module, query, kv, cu_q, cu_k, longest, scale), None
        # A module not marked (the tests unmark them), or a call with more than the C function computes (a
        # softcap, a sliding window, sinks): the keys and values the library would have gathered.
        rows, index = kv[:2], kv[2]
        key, value = (x.index_select(0, index).transpose(0, 1)[None] for x in rows)
    elif paged and _dense(query, key, value, attention_mask, dropout, is_causal):
        # The single-request engine's calls, and the prefill process's: a dense cache, [sequences, kv_heads, keys,
        # dim]. The same C function as the batched engine's, so that a request's rows come out the same in every
        # engine (not only close).
        import torch

        sequences, heads, rows, dim = query.shape
        kv_heads, keys = key.shape[1], key.shape[2]
        bounds = (
            torch.arange(0, (sequences + 1) * rows, rows, dtype=torch.int32),
            torch.arange(0, (sequences + 1) * keys, keys, dtype=torch.int32),
        )
        if sequences == 1:
            dense = (key[0].transpose(0, 1), value[0].transpose(0, 1), torch.arange(keys))
        else:
            # Key j of sequence b is row b * kv_heads * keys + j of the keys seen as [slots, kv_heads, dim] rows of
            # dim floats (a head keys * dim floats further on): as many slots as reach the last sequence's keys.
            slots = (sequences - 1) * kv_heads * keys + keys
            shape, strides = (slots, kv_heads, dim), (dim, keys * dim, 1)
            index = (torch.arange(sequences)[:, None] * (kv_heads * keys) + torch.arange(keys)).flatten()
            dense = (key.as_strided(shape, strides), value.as_strided(shape, strides), index)
            query = query.transpose(0, 1).reshape(1, heads, sequences * rows, dim)
        out = paged_attention(module, query, dense, *bounds, rows, scale)
        return out.view(sequences, rows, heads, dim), None
    plain = (
        not getattr(module, MARK, False)
        or attention_mask is None
        or query.shape[2] == 1  # transformers folds the groups into the rows instead: no copy
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap"))
        or kwargs.get("output_attentions", False)
    )
    if plain:
        library = _install()
        return library(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    import torch

    # With a mask transformers passes is_causal=False too: the mask is the causal (and per-request) pattern.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _dense(query: Any, key: Any, value: Any, attention_mask: Any, dropout: float, is_causal: bool | None) -> bool:
    """A call the C function computes as transformers' SDPA function would: causal (no mask, its rows being all its
    keys or one; or the mask of new rows behind a cached prefix, :func:`_causal`), at most :data:`LONG_ROWS` rows
    (longer prompts take SDPA, in the batched engine too), keys and values laid out alike; one sequence, or several
    of as many rows and keys each, keys and values contiguous (the prefill process's groups of prompts)."""
    sequences, rows, keys = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = is_causal is not False and (rows == keys or rows == 1)
    else:
        causal = _causal(attention_mask, rows, keys)
    return (
        causal
        and dropout == 0.0
        and (sequences == 1 or (key.is_contiguous() and value.is_contiguous()))
        and rows <= LONG_ROWS
        and str(query.dtype) == "torch.float32"
        and key.stride() == value.stride()
        and key.stride(3) == 1
    )


_checked: tuple[Any, bool] = (None, False)
"""The last mask :func:`_causal` looked at (a weak reference) and its answer: a forward pass hands every layer the
same mask."""


def _causal(mask: Any, rows: int, keys: int) -> bool:
    """Whether ``mask`` (``[sequences or 1, 1, rows, keys]``, booleans) lets each of ``rows`` new rows see the keys up
    to its own position and no further: the last ``rows`` of ``keys`` positions, causal, in every sequence.
    transformers builds that mask for sequences behind a cached prefix (the prefill process's,
    engine/batched/prefill.py)."""
    global _checked
    seen, answer = _checked
    if seen is not None and seen() is mask:
        return answer
    import torch

    answer = (
        mask.dtype == torch.bool
        and tuple(mask.shape[1:]) == (1, rows, keys)
        and bool(torch.equal(mask, torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows).expand_as(mask)))
    )
    _checked = (weakref.ref(mask), answer)
    return answer


PLAIN = frozenset(
    {"position_ids", "use_cache", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    | {"logits_indices", "logits_processor_args", "read_index", "write_index", "block_table"}
)
"""Keyword arguments of transformers' attention calls that do not change what attention computes (continuous
batching's bookkeeping among them). Any other one set (a softcap, a sliding window, sinks, a position bias, asking
for the attention weights) sends the call to the library's function."""


def _plain(kwargs: dict[str, Any]) -> bool:
    return all(name in PLAIN or value is None or value is False for name, value in kwargs.items())


@functools.cache
def _install() -> Callable[..., tuple[Any, None]]:
    """Register :func:`grouped_sdpa` as transformers' ``sdpa``, once; returns the function it replaced."""
    from transformers import AttentionInterface

    library: Callable[..., tuple[Any, None]] = AttentionInterface()["sdpa"]
    AttentionInterface.register("sdpa", grouped_sdpa)
    return library
