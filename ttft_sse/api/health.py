"""Liveness and readiness.

``/readyz`` is for anyone who can reach the server (probes send no key): what it shows of the host is kept to what
a caller needs. The model's ``source``, where it is a path on the host, is its file name only, unless the caller
shows a valid API key (with ``TTFT_API_KEYS`` set): a keyless server shows no caller the absolute path.
"""

from __future__ import annotations

import os
from pathlib import PurePath

from starlette.requests import Request
from starlette.responses import JSONResponse

from ttft_sse.api.body import caller_of, runtime_of
from ttft_sse.engine import choice
from ttft_sse.errors import Unauthorized
from ttft_sse.runtime import Runtime


async def healthz(request: Request) -> JSONResponse:
    """The process is alive and its event loop answers (also while the model loads or works)."""
    return JSONResponse({"status": "ok", "state": runtime_of(request).lifecycle.state})


async def readyz(request: Request) -> JSONResponse:
    """200 once the model is loaded and warmed, with what is loaded and how long each start-up stage took."""
    runtime = runtime_of(request)
    lifecycle = runtime.lifecycle
    if not lifecycle.ready:
        body: dict[str, object] = {
            "status": lifecycle.state,
            "reason": lifecycle.not_ready_reason(),
            "startup": lifecycle.startup_report(),
        }
        if lifecycle.state == "stopping":  # draining: what is still running, for whoever watches the rollout
            body.update(running=runtime.gate.running, waiting=runtime.gate.waiting)
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
    info = runtime.engine.info
    return JSONResponse(
        {
            "status": "ready",
            "model": info.name,
            "engine": choice.report(runtime.engine),
            "source": info.source if _keyed(request) else _file_name(info.source),
            "device": info.device,
            "dtype": info.dtype,
            "weights": info.weights,
            "weights_by_type": info.weights_by_type,
            "decoder": info.decoder,
            "context_length": info.context_length,
            "threads": info.threads,
            "kernel_helpers": info.kernel_helpers,
            "beside_batch": info.beside_batch,
            "modes": list(info.modes),
            "mode": runtime.engine.mode,
            "memory": {
                "weights_bytes": info.weights_bytes,
                "kv_cache_tokens": info.kv_cache_tokens,
                "kv_cache_bytes": info.kv_cache_bytes,
                "kv_cache_dtype": info.kv_cache_dtype,
                "load_peak_rss_bytes": info.load_peak_rss_bytes,
            },
            "startup": lifecycle.startup_report(),
            "running": runtime.gate.running,
            "waiting": runtime.gate.waiting,
            "waiting_by_lane": runtime.gate.waiting_by_lane(),
            **_targets(runtime),
        }
    )


def _keyed(request: Request) -> bool:
    """The caller showed a valid API key (never on a keyless server). A wrong key is not refused here: /readyz
    answers probes, which send none."""
    if not runtime_of(request).keyring.enabled:
        return False
    try:
        return caller_of(request).key_id is not None
    except Unauthorized:
        return False


def _file_name(source: str) -> str:
    """A path on the host as its last part (the model file's or folder's name); anything else (a model id) as is."""
    return PurePath(source).name if os.path.isabs(source) else source


def _targets(runtime: Runtime) -> dict[str, object]:
    """The lanes' first-token targets (TTFT_SLA_MS), the slots kept for the high lane and those past
    the others' cap, and the degrader's state."""
    if runtime.targets is None:
        return {}
    body: dict[str, object] = {
        "first_token_targets_ms": {lane.label: round(s * 1000) for lane, s in sorted(runtime.targets.targets.items())},
        "high_reserved_slots": runtime.gate.reserved,
        "high_extra_slots": runtime.gate.extra,
    }
    if runtime.degrader is not None:
        body["degraded"] = runtime.degrader.degraded
    return body
