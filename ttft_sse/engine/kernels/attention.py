"""Attention on CPU request by request, over the KV cache in place (``TTFT_PAGED_ATTENTION``, fp32): ``attention.c``,
built, checked and called.

A step of continuous batching holds several requests side by side. transformers gathers every key and value of the
step out of its paged cache into new tensors (an ``index_select`` of each, in every layer) and runs one SDPA over
them with a mask that keeps the requests apart, so each query row is multiplied with every key of the step, its own
request's or not. Here the cache only writes the new keys and values (engine/library/in_place.py) and hands over the
layer's cache rows and the step's key index; ``attention.c`` then attends each request's rows to its own keys, read
through the index, in fp32, with AVX-512 or AVX2 and FMA (:func:`paged_attention`). Requests of more than
:data:`LONG_ROWS` rows take SDPA over their own gathered keys. A cache in f16 (``TTFT_KV_DTYPE``:
engine/library/half_cache.py) is read by the same library's functions for fp16 values, which widen each key and value
as they load it: the bits the fp32 functions give over the same values held in fp32.

The single-request engine's calls and the prefill process's (engine/first/process.py: prompts behind a cached
prefix, several side by side) take the same C function over their dense caches, by way of the attention function
engine/library/grouped.py registers: a request's rows come out of every engine bit for bit alike. The decoder layers
in C (engine/library/decoder.py) skip both the cache's update and the attention function in the batched steps: the
cache gives them each layer's cache rows and the step's index arrays (a :class:`Step`), and one C call writes the new
keys and values and calls ``attention.c`` itself.

Owns: the library's build (:func:`build`, :func:`start`) and functions (:func:`function`, the marks' names),
:func:`paged_attention` (the call), :class:`Step`, and the random steps the probe at load (engine/library/grouped.py's
``page``) and the tests share.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from ttft_sse.engine.kernels import compiler

log = structlog.get_logger("ttft_sse.engine")

PAGED = "ttft_paged_attention"
"""Attribute set on an attention module whose batched steps attend request by request (engine/library/grouped.py's
``page``): the C function."""
PAGED_PART = "ttft_attention_part"
"""Attribute set with :data:`PAGED`: the same library's function for some parts of a step only (a part: a query
row's heads of one KV head), by which the block kernel's helper threads share a batched step's attention
(helpers.c, decoder.c)."""
PAGED_HALF = "ttft_paged_attention_f16"
PAGED_PART_HALF = "ttft_attention_part_f16"
"""The same two functions for a KV cache of fp16 values (set with :data:`PAGED` where the model's caches are in f16)."""
KV = "ttft_kv"
"""The keyword argument by which a cache that reads in place (engine/library/in_place.py) hands a layer's KV rows and
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
(engine/library/grouped.py's ``grouped_sdpa``, which the engine's models call under a name of its own)."""


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


# q, heads, kv_heads, dim, k, v, key_stride, head_stride, index, cu_q, cu_k, requests, max_rows, scale, out
ARGUMENTS = (_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR)
# the same, then first, last, before out
PART_ARGUMENTS = (*ARGUMENTS[:-1], _I64, _I64, _PTR)


def function(path: Path) -> Any:
    """attention.c's ``ttft_paged_attention`` in the library at ``path``; RuntimeError where this CPU cannot run it."""
    found = compiler.load(path, "ttft_paged_attention", ARGUMENTS)
    if found(None, 1, 1, 16, None, None, 0, 0, None, None, None, 0, 0, 1.0, None) == -2:
        raise RuntimeError("the CPU has neither AVX-512 nor AVX2 with FMA")
    return found


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


class Step(NamedTuple):
    """What every layer of one group of a batched step shares when it writes its keys and values and attends in one
    call (engine/library/in_place.py's ``InPlace.step``): the cache rows the new keys and values go to, one a new
    row (int64); the key index the attention reads through (int64); where each request's rows and keys start (int32,
    with the total last); how many requests; the cache rows' strides, in values (a key row, a head); how many rows
    they hold; whether they hold fp16 values (an f16 cache: engine/library/half_cache.py), else fp32."""

    write: Any
    index: Any
    cu_q: Any
    cu_k: Any
    requests: int
    key_stride: int
    head_stride: int
    slots: int
    half: bool


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
