"""A batched step's fused decoder layers over the paged KV cache read in place (engine/library/in_place.py's
:class:`~in_place.InPlace`), each in one C call (``ttft_decoder_layer``: :func:`whole`), or every layer of the model
in one (``ttft_decoder_stack``: :func:`run_layers`, over a :class:`Chain`), with the arrays decoder.c reads for them.

engine/library/decoder.py makes the layers and their chain (``fuse``), and its layers' forward calls these; the batched
engine's interludes call them for their own passes. Before the layers go into C, without the GIL, each call hands
the batched engine its moment (:attr:`in_place.InPlace.before_kernel`).
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Any

from ttft_sse.engine.kernels import attention, kernel
from ttft_sse.engine.kernels.structs import Stack, Step
from ttft_sse.engine.library import families
from ttft_sse.engine.library import in_place as places

_PTR = ctypes.c_void_p


@dataclass(frozen=True)
class Chain:
    """Every decoder layer of a model, fused, in order (:func:`decoder.fuse` gives each of them the model's): what
    :func:`run_layers` computes in one call."""

    layers: tuple[Any, ...]
    addresses: Any  # a ctypes array of each layer's ``Layer``
    run: Any  # ttft_decoder_stack
    int8_addresses: Any = None  # each layer's int8 ``Layer`` (TTFT_DEGRADE=int8), for a thread on int8 rows
    # Where layers take rotary embeddings of different kinds (Gemma 3's sliding and full layers: other bases), each
    # layer's kind and the model's rotary embedding that makes them; else empty and None (one for all).
    kinds: tuple[str, ...] = ()
    rotary: Any = None


@dataclass(frozen=True)
class _Rows:
    """A chain's layers' cache rows in one paged cache, as decoder.c reads them; the cache's allocator group of each
    layer, and the first layer's attention module of each group (it names the group's step)."""

    keys: Any
    values: Any
    groups: tuple[int, ...]
    firsts: dict[int, Any]


_rows_of: weakref.WeakKeyDictionary[places.InPlace, _Rows] = weakref.WeakKeyDictionary()
"""Each paged cache's :class:`_Rows`, made at its first step that runs the layers in one call."""


def _rows(chain: Chain, in_place: places.InPlace) -> _Rows:
    found = _rows_of.get(in_place)
    if found is None:
        indices = [layer.self_attn.layer_idx for layer in chain.layers]
        keys, values = ((_PTR * len(indices))(*(in_place.rows[i][n].data_ptr() for i in indices)) for n in (0, 1))
        groups = tuple(in_place.cache.layer_to_allocator[i].index for i in indices)
        firsts: dict[int, Any] = {}
        for layer, group in zip(chain.layers, groups, strict=True):
            firsts.setdefault(group, layer.self_attn)
        found = _rows_of[in_place] = _Rows(keys, values, groups, firsts)
    return found


def step_groups(chain: Chain, in_place: places.InPlace, kwargs: dict[str, Any]) -> dict[int, attention.Step] | None:
    """The step of each allocator group of ``chain``'s layers in the batched step ``kwargs`` describe
    (:meth:`in_place.InPlace.step`), or None if one of them is not computed in one call."""
    steps: dict[int, attention.Step] = {}
    for group, module in _rows(chain, in_place).firsts.items():
        shared = in_place.step(module, kwargs)
        if shared is None:
            return None
        steps[group] = shared
    return steps


def run_layers(
    chain: Chain,
    in_place: places.InPlace,
    steps: dict[int, attention.Step],
    x: Any,
    rows: int,
    cos: Any,
    sin: Any,
    *,
    between: bool,
    positions: Any = None,
) -> Any:
    """The output of ``chain``'s layers for the ``rows`` rows of ``x``, in one C call (``ttft_decoder_stack``): each
    layer's one call (as :func:`whole`) in turn over the paged cache of ``in_place``, by the step of its allocator
    group (``steps``). ``cos`` and ``sin`` are the first layer's rotary embedding; where the chain's layers take
    several kinds (:attr:`Chain.kinds`), the others are made here for ``positions`` (the rows' position ids). With
    ``between``, ``in_place.between`` runs before the first layer and wherever the call stops because
    ``in_place.waiting`` says a newcomer waits; the call then goes on from that layer."""
    import torch

    tables = _rotary_tables(chain, x, cos, sin, positions)  # held: C reads them
    found = _rows(chain, in_place)
    made = {group: _c_step(shared, found.firsts[group]) for group, shared in steps.items()}  # held: C reads them
    pointers = (_PTR * len(found.groups))(*(ctypes.addressof(made[group]) for group in found.groups))
    waiting = in_place.waiting if between else None
    layers = chain.int8_addresses if kernel.ROWS.int8 and chain.int8_addresses is not None else chain.addresses
    stack = Stack(
        len(chain.layers), ctypes.addressof(layers), ctypes.addressof(pointers),
        ctypes.addressof(found.keys), ctypes.addressof(found.values),
        None if waiting is None else ctypes.addressof(waiting),
        *((None, None) if tables is None else (ctypes.addressof(tables[0]), ctypes.addressof(tables[1]))),
    )  # fmt: skip
    serve = in_place.between if between else None
    if serve is not None:
        serve(in_place)  # an interlude (engine/first/interlude.py), if a newcomer waits
    y = torch.empty_like(x)
    at, source = 0, x
    in_place.before_kernel()
    while True:
        status = chain.run(
            ctypes.addressof(stack), at, source.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), y.data_ptr()
        )
        if status < 0:
            raise RuntimeError(f"the C decoder layers failed ({status})")
        if status >= len(chain.layers):
            return y
        at, source = status, y  # stopped before layer `status`: y holds the output of the layers before it
        if serve is not None:
            serve(in_place)


def _rotary_tables(chain: Chain, x: Any, cos: Any, sin: Any, positions: Any) -> tuple[Any, Any, Any] | None:
    """Each layer's rotary embedding (:func:`families.embeddings`) as ctypes arrays of addresses (cos, sin), and
    the tensors behind them, where the chain's layers take several kinds; None where they take one (the call's)."""
    if not chain.kinds:
        return None
    made = families.embeddings(chain.rotary, chain.kinds, x, cos, sin, positions)
    count = len(chain.kinds)
    arrays = tuple((_PTR * count)(*(made[kind][n].data_ptr() for kind in chain.kinds)) for n in (0, 1))
    return arrays[0], arrays[1], made


def _c_step(shared: attention.Step, module: Any) -> Step:
    """``shared`` as decoder.c reads it, for the layers of ``module``'s kind (marked by grouped.py's ``page``); the
    arrays stay ``shared``'s (the caller holds both while C reads them)."""
    function = getattr(module, attention.PAGED_HALF if shared.half else attention.PAGED)
    part = getattr(module, attention.PAGED_PART_HALF if shared.half else attention.PAGED_PART, None)
    arrays = (shared.write, shared.index, shared.cu_q, shared.cu_k)
    return Step(
        ctypes.cast(function, _PTR).value,
        None if part is None else ctypes.cast(part, _PTR).value,
        *(a.data_ptr() for a in arrays),
        shared.requests,
        shared.key_stride,
        shared.head_stride,
        attention.LONG_ROWS,
        int(shared.half),
        module.scaling,
    )


def c_step(shared: attention.Step, module: Any) -> Step:
    """``shared`` as decoder.c reads it, for the layers of ``module``'s kind (marked by grouped.py's ``page``); the
    arrays stay ``shared``'s (the caller holds both while C reads them). The last one made is kept, for the step's
    next layers; another engine's step in another thread only makes it again."""
    global _last
    made, step = _last
    if made is not shared:
        step = _c_step(shared, module)
        _last = (shared, step)
    return step


_last: tuple[attention.Step | None, Step] = (None, Step())
"""The last :func:`c_step` made, and what it was made of (held, so that its arrays stay alive)."""


def whole(layer: Any, shared: attention.Step, x: Any, rows: int, cos: Any, sin: Any, keys: Any, values: Any) -> Any:
    """``layer``'s (a fused decoder layer's: engine/library/decoder.py) output for the ``rows`` rows of ``x``, in one C
    call that writes their keys and values into the paged cache's rows ``keys`` and ``values`` by ``shared`` and
    attends over them."""
    import torch

    step = c_step(shared, layer.self_attn)  # held until the call returns: decoder.c reads it
    y = torch.empty_like(x)
    status = layer.whole(
        layer.addresses[kernel.ROWS.int8], ctypes.addressof(step), x.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
        keys.data_ptr(), values.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"the C decoder layer failed ({status})")
    return y
