"""KV caches that keep keys and values in f16 while the model computes in fp32 (``TTFT_KV_DTYPE``).

A 7B model with multi-head attention holds 1 MiB of fp32 keys and values a token: 8 GiB for the batched engine's
8,192 tokens, twice llama.cpp's f16 cache. In f16 each key and value is rounded to the nearest fp16 value as it is
stored and widened back to fp32, exactly, as it is read: half the memory, and the attention's arithmetic stays fp32's
over the rounded values. The answers are those of the fp32 model with its keys and values so rounded: they may differ
from the fp32 cache's (docs/loading.md says how often on the bundled model).

Every engine that computes a request rounds its keys and values the same way, so that a request's answer stays the
same on all of them (the batched engine's steps, interludes and prefix sharing, its seeded and too-long requests on
the single engine, the prefill process's first tokens):

- the batched engine's paged cache (engine/library/paged_cache.py): transformers' ``PagedAttentionCache`` allocated in
  f16; its update rounds the new rows as it writes them and widens what it reads back; the decoder layers in C write
  fp16 values themselves (decoder.c) and the C attention reads them (attention.c's ``_f16`` functions);
- the single engine's and the prefill process's dense caches (:func:`dense`): transformers' ``DynamicCache`` holding
  f16 tensors, each update widened back to fp32 for the attention.

The model carries the choice (:func:`mark`, at load: engine/loading/model.py), which the engines read
(:func:`in_f16`). torch's ``.to(torch.float16)``, F16C's conversion and half.h's plain C all round to the nearest
fp16 value, ties to even, so the C writes and torch's give the same values (a test).
"""

from __future__ import annotations

import functools
from typing import Any

F16 = "float16"
FP32 = "float32"
MARK = "ttft_kv_dtype"
"""The attribute of a model that says the element type of its KV caches (:data:`F16` or :data:`FP32`)."""


def mark(model: Any, dtype: str) -> None:
    """Have ``model``'s KV caches hold ``dtype`` values (:data:`F16`; anything else: the model's own dtype)."""
    setattr(model, MARK, dtype)


def in_f16(model: Any) -> bool:
    """Whether ``model``'s KV caches hold f16 values while it computes in fp32 (:func:`mark`)."""
    return getattr(model, MARK, None) == F16


def dense(model: Any) -> Any:
    """A new dense KV cache for ``model`` (a ``generate`` call's, or the prefill process's): in f16 where
    :func:`in_f16` (:func:`_dense_class`), else transformers' ``DynamicCache``."""
    import transformers

    kind = _dense_class() if in_f16(model) else transformers.DynamicCache
    return kind(config=model.config)


@functools.cache
def _dense_class() -> type:
    """transformers' ``DynamicCache`` (its layers, sliding-window ones included, and their crop, copy and reorder)
    holding keys and values in f16: each update stores the new rows rounded to f16 and returns the layer's keys and
    values widened to the new rows' dtype (a copy: the attention's fp32 operands)."""
    import torch
    import transformers

    class HalfDynamicCache(transformers.DynamicCache):  # type: ignore[misc]
        def update(
            self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[Any, Any]:
            wide = key_states.dtype
            keys, values = super().update(
                key_states.to(torch.float16), value_states.to(torch.float16), layer_idx, *args, **kwargs
            )
            return keys.to(wide), values.to(wide)

    return HalfDynamicCache
