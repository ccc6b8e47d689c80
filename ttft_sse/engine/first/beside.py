"""What computes first tokens beside the batch, chosen once at load: interludes (engine/first/interlude.py) where
asked and possible, else the prefill process (engine/first/process.py) where it can help, else nothing."""

from __future__ import annotations

from typing import Any

import structlog

from ttft_sse.engine.base import ModelInfo
from ttft_sse.engine.first.interlude import Interlude
from ttft_sse.engine.first.process import PrefillProcess
from ttft_sse.engine.library import families, grouped, half_cache
from ttft_sse.settings import Settings

log = structlog.get_logger("ttft_sse.engine")


def start_beside(
    settings: Settings, model: Any, info: ModelInfo, seeds: dict[str, int]
) -> PrefillProcess | Interlude | None:
    """Interludes where asked and possible (their prompts' blocks salted by ``seeds``, the engine's cache salts by
    request name; the engine hands them to its cache's steps); else the prefill process, started, where it can help:
    on CPU, with a core of its own."""
    if settings.prefill_between_layers:
        reason = _no_interludes(settings, model, info)
        if reason is None:
            interlude = Interlude(model, seeds)
            log.info("interludes_on")
            return interlude
        log.info("interludes_off", reason=reason)
    if not settings.prefill_process:
        return None
    if settings.cores < 2:
        reason = "one core only (affinity and CPU quota)"
    elif not rows_alone(model, info):
        reason = "it needs the block kernel and the C attention (a GGUF model, on CPU, in fp32)"
    elif info.kernel_helpers > 0:
        # Both want the second core, and the batch does better with it at c=8 (figures: docs/engine.md).
        reason = "the block kernel's helper threads use the other cores (TTFT_KERNEL_HELPERS=0 gives them to it)"
    else:
        # Its KV cache in the batch's dtype, as chosen here (auto's choice by memory could differ in the child).
        kv = "f16" if half_cache.in_f16(model) else "fp32"
        process = PrefillProcess(settings.replace(kv_dtype=kv))
        process.start()
        return process
    log.info("prefill_process_off", reason=reason)
    return None


def rows_alone(model: Any, info: ModelInfo) -> bool:
    """Each row of a forward pass is computed from its own inputs alone (the block kernel's linear layers, the C
    attention): a first token computed beside the batch is then the batch's, bit for bit."""
    return grouped.paged(model) and info.weights.startswith("gguf-blocks")


def _no_interludes(settings: Settings, model: Any, info: ModelInfo) -> str | None:
    """Why interludes cannot run here, or None. They compute a step of their own through the decoder layers in C over
    the paged cache read in place, and hand their KV over by the library's prefix sharing."""
    layers = getattr(model.base_model, "layers", [])
    if not rows_alone(model, info):
        return "they need the block kernel and the C attention (a GGUF model, on CPU, in fp32)"
    if not layers or not all(isinstance(layer, families.FusedLayer) for layer in layers):
        return "they need the decoder layers in C (TTFT_FUSED_LAYERS)"
    if not settings.prefix_cache:
        return "they hand their KV to the batch through the prefix cache (TTFT_PREFIX_CACHE)"
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in layers):
        return "they hand their KV over by the prefix cache, which the library's sliding-window layers do not share"
    return None
