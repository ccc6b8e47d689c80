"""Attention on CPU: SDPA over grouped KV heads in place, for the batched engine's masked steps.

Models with grouped-query attention keep fewer KV heads than query heads (SmolLM2-135M: 3 for 9). torch's SDPA
takes them as they are (``enable_gqa=True``), but transformers' SDPA function uses that only on CPU calls without a
mask. A step of the batched engine always has one (the batch's requests, side by side in one sequence, must not see
each other), so for every layer of every step transformers first copies each KV head once per query head of its
group (``repeat_kv``), and SDPA then reads three times the KV. Measured on this machine (one thread, one SDPA call
with the engine's mask, µs; ``benchmarks/grouped_attention.py``):

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
``sdpa`` (or flash or ``paged|eager``): :func:`group` registers this module's function under that name, once per
process, and it hands every call it does not take to the function it replaced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import structlog

log = structlog.get_logger("ttft_sse.engine")

MARK = "ttft_grouped_sdpa"
"""Attribute set on an attention module whose masked calls take :func:`grouped_sdpa`."""


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
    if not agree:
        if hasattr(probe, MARK):
            delattr(probe, MARK)
        log.warning("attention_not_grouped", reason=reason)
        return 0
    for module in modules:
        setattr(module, MARK, True)
    log.info("attention_grouped", modules=len(modules))
    return len(modules)


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
    calls of more than one query row (the only calls where transformers repeats them on CPU)."""
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


@functools.cache
def _install() -> Callable[..., tuple[Any, None]]:
    """Register :func:`grouped_sdpa` as transformers' ``sdpa``, once; returns the function it replaced."""
    from transformers import AttentionInterface

    library: Callable[..., tuple[Any, None]] = AttentionInterface()["sdpa"]
    AttentionInterface.register("sdpa", grouped_sdpa)
    return library
