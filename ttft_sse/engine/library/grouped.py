"""The engine's attention function on CPU, and the marks that send a model's attention calls to it: SDPA over
grouped KV heads in place (``TTFT_GROUPED_ATTENTION``), and engine/kernels/attention.py's request-by-request attention
(``TTFT_PAGED_ATTENTION``).

transformers looks an attention module's function up by name at every call: its config's ``_attn_implementation``, in
the library's registry. :func:`dispatch` registers :func:`grouped_sdpa` under a name of the engine's own
(:data:`NAME`, once a process) and gives the model's marked attention modules a copy of their config that names it,
so that only their calls reach it; every other model of the process keeps the library's ``sdpa``, and the model's
own config still says ``sdpa``: continuous batching accepts only the library's names (``sdpa``, ``paged|eager``, the
flash ones) and builds a step's attention mask only for the first two, so an engine's own name in the model's config
would refuse the batch. :func:`grouped_sdpa` hands every call it does not take to the library's ``sdpa``. It takes:

* the calls of a module :func:`page` marked (``TTFT_PAGED_ATTENTION``): a batched step over the paged KV cache read
  in place, and a dense cache's calls (the single-request engine's, the prefill process's), all by the same C
  function, so that a request's rows come out of every engine bit for bit alike;
* the masked calls of more than one query row of a module :func:`group` marked: SDPA with the grouped KV heads in
  place.

Models with grouped-query attention keep fewer KV heads than query heads (SmolLM2-135M: 3 for 9). torch's SDPA takes
them as they are (``enable_gqa=True``), but transformers' SDPA function uses that only for CPU calls without a mask.
A batched step always has one (its requests, side by side in one sequence, must not see each other), so transformers
would copy each KV head once per query head of its group (``repeat_kv``) in every layer of every step, and SDPA would
read the KV that many times over (figures: docs/engine.md). transformers' ``TRANSFORMERS_SDPA_FORCE_GQA=1`` does the
same for every call of the process, which is wrong on CUDA (SDPA with a mask and grouped heads falls back to its
slowest kernel there): the engine marks only models loaded on CPU.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from ttft_sse.engine.kernels import attention, compiler
from ttft_sse.engine.library import half_cache, internals

log = structlog.get_logger("ttft_sse.engine")

NAME = "ttft_grouped"
"""The name :func:`grouped_sdpa` is registered under, which the marked attention modules' config copy names."""
MARK = "ttft_grouped_sdpa"
"""Attribute set on an attention module whose masked calls take :func:`grouped_sdpa`."""


def group(model: Any, torch: Any) -> int:
    """Mark ``model``'s attention modules with grouped KV heads for :func:`grouped_sdpa`, after checking it against
    transformers' own function on a probe; returns how many were marked (0, logged, when the probe disagrees)."""
    modules = [m for m in model.modules() if getattr(m, "num_key_value_groups", 1) > 1]
    if not modules:
        return 0
    library = _library_sdpa()
    probe = modules[0]
    try:
        groups, dim = probe.num_key_value_groups, probe.head_dim
        kv_heads = probe.config.num_key_value_heads
        step = attention.masked_step(torch, kv_heads * groups, kv_heads, dim, [(3, 3), (1, 4), (2, 5)])
        want = library(probe, *step, scaling=probe.scaling)[0]
        setattr(probe, MARK, True)
        got = grouped_sdpa(probe, *step, scaling=probe.scaling)[0]
        agree = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        reason = "SDPA over grouped heads disagrees with repeated heads"
    except (AttributeError, RuntimeError, TypeError) as exc:  # an attention module unlike Llama's, an old torch
        agree, reason = False, repr(exc)
    return settle(modules, MARK, True, "grouped", None if agree else reason)


def page(model: Any, torch: Any, directory: Path) -> int:
    """Mark ``model``'s attention modules so that the batched engine's steps attend request by request over the
    paged KV cache in place (``attention.c``, built in ``directory``), after checking it against SDPA over the
    gathered keys with the step's mask on a probe; returns how many were marked (0, logged with the reason, when it
    cannot be built, the CPU has neither AVX-512 nor AVX2 with FMA, or the probe disagrees). The marks are read by
    :func:`grouped_sdpa`: :func:`dispatch` then has the model call it."""
    modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim")]
    if not modules:
        return 0
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "sdpa":  # continuous batching would call another function than the library's sdpa
        log.warning("attention_not_paged", reason=f"the model's attention is {implementation!r}, not 'sdpa'")
        return 0
    probe = modules[0]
    half = half_cache.in_f16(model)
    try:
        library = attention.build(directory)
        function = attention.function(library)
        halves = compiler.load(library, attention.PAGED_HALF, attention.ARGUMENTS)
        heads, dim = probe.config.num_attention_heads, probe.head_dim
        kv_heads = probe.config.num_key_value_heads
        # Past and new rows; the last two, longer than the probe's long_rows, take SDPA (with a past, then without).
        long = attention.PROBE_LONG
        requests = [(3, 7), (1, 4), (2, 5), (long + 1, long + 3), (long + 2, long + 2)]
        query, key, value, mask = attention.masked_step(torch, heads, kv_heads, dim, requests)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=probe.scaling, enable_gqa=True
        ).transpose(1, 2)
        kv = attention.in_cache(torch, key, value, slots=2 * key.shape[2])  # the keys scattered among other rows
        setattr(probe, attention.PAGED, function)
        longest = max(n for n, _ in requests)
        got = attention.paged_attention(
            probe, query, kv, *attention.starts(torch, requests), longest, probe.scaling, long_rows=long
        )
        agree = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        reason = "request-by-request attention disagrees with SDPA over the gathered keys"
        if agree and half:  # over fp16 values: the bits of the fp32 function over the same values widened
            setattr(probe, attention.PAGED_HALF, halves)
            rounded = tuple(x.to(torch.float16) for x in kv[:2])
            widened = tuple(x.to(torch.float32) for x in rounded)
            got = attention.paged_attention(
                probe, query, (*rounded, kv[2]), *attention.starts(torch, requests), longest, probe.scaling
            )
            want = attention.paged_attention(
                probe, query, (*widened, kv[2]), *attention.starts(torch, requests), longest, probe.scaling
            )
            agree = bool(torch.equal(got, want))
            reason = "request-by-request attention over an f16 cache disagrees with it over the same values in fp32"
    except (OSError, RuntimeError, AttributeError, TypeError) as exc:
        agree, reason = False, str(exc)
    if not agree and hasattr(probe, attention.PAGED_HALF):
        delattr(probe, attention.PAGED_HALF)
    marked = settle(modules, attention.PAGED, function if agree else None, "paged", None if agree else reason)
    if marked:
        part = compiler.load(library, "ttft_attention_part", attention.PART_ARGUMENTS)
        half_part = compiler.load(library, attention.PAGED_PART_HALF, attention.PART_ARGUMENTS)
        for module in modules:
            setattr(module, attention.PAGED_PART, part)
            if half:
                setattr(module, attention.PAGED_HALF, halves)
                setattr(module, attention.PAGED_PART_HALF, half_part)
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
    return any(getattr(m, attention.PAGED, None) is not None for m in model.modules())


def dispatch(model: Any) -> int:
    """Have the attention modules of ``model`` that :func:`group` or :func:`page` marked call :func:`grouped_sdpa`:
    registered under :data:`NAME` (once a process), and named in a copy of their config (one copy for the modules
    that share a config). Returns how many modules call it (0: none was marked, and nothing changed)."""
    modules = [m for m in model.modules() if getattr(m, MARK, False) or getattr(m, attention.PAGED, None) is not None]
    if not modules:
        return 0
    _register()
    copies: dict[int, Any] = {}
    for module in modules:
        config = copies.get(id(module.config))
        if config is None:
            config = copy.deepcopy(module.config)
            config._attn_implementation = NAME
            copies[id(module.config)] = config
        module.config = config
    return len(modules)


@functools.cache
def _register() -> None:
    """:func:`grouped_sdpa` registered under :data:`NAME`: a name added to the library's registry, none replaced."""
    internals.attention().interface.register(NAME, grouped_sdpa)


@functools.cache
def _library_sdpa() -> Callable[..., tuple[Any, None]]:
    """The library's ``sdpa`` attention function, which :func:`grouped_sdpa` hands the calls it does not take."""
    found: Callable[..., tuple[Any, None]] = internals.attention().interface()["sdpa"]
    return found


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
    """The engine's attention function (:data:`NAME`): request by request by the C function for a module :func:`page`
    marked (over the paged cache read in place, or a dense cache :func:`_dense` takes), SDPA over the grouped KV heads
    in place for a masked call of more than one query row of a module :func:`group` marked (the only calls where
    transformers repeats them on CPU), and the library's ``sdpa`` for every other call."""
    kv = kwargs.pop(attention.KV, None)
    # A sliding window is plain attention where no row has more keys than it: in place, always (the cache hands over
    # only such steps' keys: in_place.window_index); over a dense cache, where the call has no more keys.
    keys = 0 if kv is not None else key.shape[2]
    paged = getattr(module, attention.PAGED, None) is not None and attention.plain_kwargs(kwargs, keys)
    scale = module.scaling if scaling is None else scaling
    if kv is not None:
        if paged:
            cu_q, cu_k, longest = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], int(kwargs["max_length_q"])
            return attention.paged_attention(module, query, kv, cu_q, cu_k, longest, scale), None
        # A module not marked (the tests unmark them), or a call with more than the C function computes (a
        # softcap, sinks): the keys and values the library would have gathered.
        rows, index = kv[:2], kv[2]
        key, value = (x.index_select(0, index).transpose(0, 1)[None].to(query.dtype) for x in rows)  # f16: widened
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
        out = attention.paged_attention(module, query, dense, *bounds, rows, scale)
        return out.view(sequences, rows, heads, dim), None
    plain = (
        not getattr(module, MARK, False)
        or attention_mask is None
        or query.shape[2] == 1  # transformers folds the groups into the rows instead: no copy
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap"))
        or kwargs.get("output_attentions", False)
    )
    if plain:
        library = _library_sdpa()
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
    keys or one; or the mask of new rows behind a cached prefix, :func:`_causal`), at most ``attention.LONG_ROWS`` rows
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
        and rows <= attention.LONG_ROWS
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
    engine/first/process.py)."""
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


setattr(grouped_sdpa, attention.DISPATCHES, True)
