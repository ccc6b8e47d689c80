"""Linear layers on a GGUF file's own Q4_0/Q4_1 codes and bf16 copies, for CPU (``TTFT_INT4_WEIGHTS``, off by default).

A GGUF quantised to Q4_0 or Q4_1 (the bundled SmolLM2 is Q4_1) stores each linear weight in blocks of 32 inputs
(engine/codes.py), and a decode step on the fp32 weights transformers expands them to streams 32 bits an input from
memory. torch's CPU kernel for weight-only int4 (``_weight_int4pack_mm_for_cpu``, the one torchao's int4
weight-only mode calls) multiplies by the codes directly, ``w = (q-8)*scale + zero`` a block of 32: the file's own
formula with ``scale = d``, ``zero = m + 8d``. It is fastest for a few rows; for more, oneDNN's GEMM on a
pre-packed bf16 copy of the weight (AMX on this CPU) is. Measured on this machine (one thread, 30 weights of
576x1536, ms, fp32 input cast to bf16 and the output back; ``/tmp`` scripts, run once each):

====== ===================== ================== =============== ==========
rows   fp32, column-major    fp32, oneDNN packed bf16, oneDNN    int4 codes
====== ===================== ================== =============== ==========
1      8.7                   10.8               7.4             2.3
8      20.3                  13.5               7.2             6.4
16     22.0                  15.5               8.1             12.3
32     25.7                  21.0               9.9             23.4
512    163.5                 167.9              67.5            378.1
====== ===================== ================== =============== ==========

So every fp32 linear layer gets a bf16 copy packed by oneDNN, and the layers the file holds as Q4 also get their
codes: forwards of up to 8 rows (decode steps of up to 8 streams) take the int4 kernel, longer ones (prompts,
bigger batches) and layers without codes (the LM head: the bundled file's embedding is Q8_0) the bf16 copy. Both
kernels take bf16 activations (and give a bf16 output): the int4 layers' weights are the file's (scales rounded to
bf16), the rounding of what multiplies them is bf16's; the bf16 copies round the weights too.

That is why this is not the default. Each row of the int4 kernel's result depends on that row alone (checked bit
for bit), but a batched step does not: a stream's row takes the bf16 copy in a step with more than 8 rows, and
attention over a batch differs from attention alone by fp32 rounding, which rounding to bf16 turns into whole bf16
steps now and then. Greedy answers then depend on the batch, as with ``TTFT_DTYPE=bfloat16``.

Only a layer whose 4-bit blocks give back exactly the fp32 weight transformers loaded gets codes (engine/codes.py),
and then drops its fp32 weight, which nothing reads any more. Attention, norms and the rest stay fp32. The block
kernel (engine/kernel.py, the default) multiplies fp32 rows by the same codes and keeps every stream's answer
independent of the batch: this mode is kept for before/after runs.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from ttft_sse.engine import codes as gguf_codes
from ttft_sse.engine import weights

log = structlog.get_logger("ttft_sse.engine")

INT4_ROWS = range(1, 9)
"""Row counts that take the int4 kernel (decode steps of up to 8 streams); more take the bf16 copy, faster from
~10 rows on."""


def apply(model: Any, gguf_path: str | Path, torch: Any, *, cache: Path | None = None) -> int:
    """Make every fp32 linear layer of ``model`` an ``Int4Linear``: a bf16 oneDNN-packed copy of its weight, and,
    where the file's Q4 blocks give back that weight exactly, its codes. Returns how many got codes (0, logged
    with the reason, when this torch cannot, or its kernels disagree with the fp32 GEMM on a probe: then nothing
    is changed).

    The codes are found, and kept in ``cache`` for the next start, by :func:`engine.codes.of_layers`; 8-bit ones
    (the bundled LM head's) are not taken: the int4 kernel has no use for them."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        log.warning("weights_not_int4", reason="this torch has no CPU int4 kernel")
        return 0
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        # The kernel's vectorised path was measured on AVX-512 only; its scalar one (fp32 inputs take it) was 20x
        # slower than the fp32 GEMM at one row.
        log.warning("weights_not_int4", reason=f"the int4 kernel is used on AVX-512 only; this CPU: {capability}")
        return 0
    layers = {
        name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
    }
    found = {name: codes for name, codes in gguf_codes.of_layers(layers, gguf_path, cache).items() if codes.bits == 4}
    changed: list[Any] = []
    try:
        for name, layer in layers.items():
            _attach(layer, found.get(name), torch)
            changed.append(layer)
        with_codes = [layer for layer in changed if layer.codes is not None]
        if with_codes:
            _check(with_codes[0], torch)  # both kernels: 8 rows take the codes, 9 the bf16 copy
            without_codes = next((layer for layer in changed if layer.codes is None), None)
            if without_codes is not None:  # a bf16 copy alone (the LM head)
                _check(without_codes, torch)
            for layer in with_codes:
                # Never read again, and not shared (a tied LM head has no codes): 424 MB for the bundled model.
                layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            log.info("weights_int4", layers=len(with_codes), bf16_only=len(changed) - len(with_codes))
            return len(with_codes)
        reason = "no linear weight of the model is stored as Q4_0 or Q4_1 in the file"
    except RuntimeError as exc:
        reason = str(exc)
    for layer in changed:  # back to the plain fp32 layers they were
        layer.__class__ = torch.nn.Linear
        del layer.codes, layer.scales, layer.wide
    log.warning("weights_not_int4", reason=reason)
    return 0


def _check(layer: Any, torch: Any) -> None:
    """The layer against the fp32 GEMM of the same bf16-rounded rows, at a row count for each of its kernels."""
    for count in (max(INT4_ROWS), max(INT4_ROWS) + 1):
        rows = weights.probe_rows(torch, count, layer.in_features)
        with torch.no_grad():
            want = torch.nn.functional.linear(rows.to(torch.bfloat16).float(), layer.weight, layer.bias)
            got = layer(rows)
        # bf16 keeps 8 bits: its rounding of the output alone is up to 1/256 of the largest value.
        if float((got - want).abs().max()) > 2e-2 * float(want.abs().max()):
            raise RuntimeError(f"the CPU int4 or bf16 kernel disagrees with the fp32 GEMM at {count} rows")


def _int4_mm(torch: Any, rows: Any, codes: Any, scales: Any) -> Any:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, codes, gguf_codes.BLOCK, scales)


@functools.cache
def int4_linear_class() -> type[Any]:
    """``torch.nn.Linear`` with a bf16 oneDNN-packed copy of its weight and, if the file has them, its 4-bit codes:
    up to :data:`INT4_ROWS` rows go through torch's CPU int4 kernel, others (and every row count, without codes)
    through the bf16 copy. bf16 in, the input's dtype out."""
    import torch

    class Int4Linear(torch.nn.Linear):  # type: ignore[misc]
        codes: Any
        scales: Any
        wide: Any

        def forward(self, x: Any) -> Any:
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
            if self.codes is not None and rows.shape[0] in INT4_ROWS:
                y = _int4_mm(torch, rows, self.codes, self.scales)
            else:
                y = weights.packed_linear(torch, rows, self.wide, None)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias

    return Int4Linear


def _attach(layer: Any, codes: gguf_codes.Codes | None, torch: Any) -> None:
    """Make ``layer`` (a ``torch.nn.Linear``) an ``Int4Linear``: its bf16 copy, and its codes in the int4 kernel's
    layout if it has them."""
    layer.wide = weights.pack(layer.weight.data.to(torch.bfloat16), torch)
    layer.codes = layer.scales = None
    if codes is not None:
        q = torch.from_numpy(codes.q.astype(np.int32) + 8)  # the kernel's codes are 0..15
        layer.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # (in // BLOCK, out, 2): a block's scale and zero for every output.
        scales = np.stack([codes.scale.T, codes.zero.T], axis=-1)
        layer.scales = torch.from_numpy(np.ascontiguousarray(scales)).to(torch.bfloat16)
    layer.__class__ = int4_linear_class()
