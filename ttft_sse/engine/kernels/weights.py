"""Weight layouts for fp32 on CPU: the operand each GEMM wants for the number of rows a forward pass has.

A linear layer computes ``x @ weight.T`` for ``rows`` rows of ``x``: one row a stream in a decode step, a prompt's new
tokens in a prefill. No one layout of the weight is fastest for every ``rows``. One row is bound by memory: the plain
GEMM over a column-major weight is best. From two rows on that GEMM repacks the weight on every call, which costs
more than the arithmetic of a few rows; from a few dozen rows on, oneDNN's pre-packed kernel loses to it again. So the
weight is kept twice: column-major (:func:`arrange`, for one row and for long prefills) and, unless ``packed`` is
off, pre-packed by oneDNN for :data:`PACKED_ROWS` rows (a decode step of 2-32 streams, a short prompt). The price is
memory: the packed copies are as large as the weights (figures: docs/engine.md).

bf16 and fp16 go through other kernels (bf16 is slower column-major), and CUDA does its own: fp32 on CPU only.
"""

from __future__ import annotations

import functools
from typing import Any

import structlog

log = structlog.get_logger("ttft_sse.engine")

PACKED_ROWS = range(2, 33)
"""Row counts that take the pre-packed weight; every other count takes the column-major one."""

PACK_HINT = 8
"""The row count oneDNN tunes the packed layout for (any count works): a decode step of 8 streams."""


def arrange(model: Any, torch: Any, *, packed: bool) -> str:
    """Lay out ``model``'s fp32 weights for the CPU GEMM; returns the layout's name (``column-major``, or
    ``column-major+packed`` when the packed copies were made and give the plain GEMM's results).

    Column-major: ``weight.T`` stored contiguous, the same values and shape. A tied LM head and embedding share one
    parameter: both see the new layout.

    The other tensors are copied too. Loaded tensors are views of the checkpoint's memory map, and the map, every
    page of it read by the copies above, stays resident while any view lives: with every tensor copied it goes.
    Where no plain linear layer is left (the block kernel serves them all), nothing read the map wholesale: its
    views stay, their pages read as they are used (an embedding's rows as tokens come), rather than every tensor
    read and copied at the start (an embedding table of hundreds of MB: seconds from a cold page cache, and as much
    memory).
    """
    # Plain linear layers only: a layer on codes (engine/kernels/kernel.py) reads no fp32 weight.
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    layout = "column-major"
    if not linears:
        return layout
    if packed:
        layout = _pack(linears, torch) or layout
    seen: set[int] = set()
    for module in linears:
        if id(module.weight) not in seen:
            seen.add(id(module.weight))
            module.weight.data = module.weight.data.t().contiguous().t()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensor.data = tensor.data.clone()
    return layout


def _pack(linears: list[Any], torch: Any) -> str | None:
    """Give every linear layer a oneDNN pre-packed copy of its weight (:class:`PackedLinear`); ``None`` if this
    build of torch cannot, or its packed GEMM does not agree with the plain one (then nothing is changed)."""
    if not linears:
        return None
    try:
        copies = [pack(m.weight.data, torch) for m in linears]
        probe = linears[0]
        rows = probe_rows(torch, PACK_HINT, probe.in_features)
        want = torch.nn.functional.linear(rows, probe.weight, probe.bias)
        got = packed_linear(torch, rows, copies[0], probe.bias)
    except (RuntimeError, AttributeError) as exc:
        log.warning("weights_not_packed", reason=repr(exc))
        return None
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        log.warning("weights_not_packed", reason="the packed GEMM disagrees with the plain one")
        return None
    packed_class = packed_linear_class()
    for module, copy in zip(linears, copies, strict=True):
        module.__class__ = packed_class
        module.packed_weight = copy
    return "column-major+packed"


def pack(weight: Any, torch: Any) -> Any:
    """``weight`` (out x in, any dtype oneDNN takes: fp32, bf16) pre-packed by oneDNN for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT)


def packed_linear(torch: Any, x: Any, packed_weight: Any, bias: Any) -> Any:
    """``x @ weight.T + bias`` on a weight from :func:`pack`; ``x`` in the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [None], "")


def probe_rows(torch: Any, rows: int, features: int) -> Any:
    """Fixed fp32 input rows for checking a kernel against the plain GEMM at load."""
    return torch.linspace(-1.0, 1.0, rows * features).reshape(rows, features)


def agrees(got: Any, want: Any, within: float = 1e-4) -> bool:
    """Whether a probe's result is its reference's to ``within`` of the reference's largest value (of 1 at least)."""
    return float((got - want).abs().max()) <= within * max(1.0, float(want.abs().max()))


@functools.cache
def packed_linear_class() -> type[Any]:
    """``torch.nn.Linear`` with a pre-packed weight beside its own, taken for :data:`PACKED_ROWS` rows."""
    import torch

    class PackedLinear(torch.nn.Linear):  # type: ignore[misc]
        packed_weight: Any

        def forward(self, x: Any) -> Any:
            if x.numel() // x.shape[-1] in PACKED_ROWS:
                return packed_linear(torch, x, self.packed_weight, self.bias)
            return torch.nn.functional.linear(x, self.weight, self.bias)

    return PackedLinear
