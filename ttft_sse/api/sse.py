"""``GET|POST /stream``: tokens as Server-Sent Events, the moment each one is decoded."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import structlog
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from ttft_sse.api.body import arrival_of, caller_of, generation_request, runtime_of
from ttft_sse.engine.base import Finished, Piece, Progress
from ttft_sse.errors import ServiceError
from ttft_sse.generation import Queued, Run

log = structlog.get_logger("ttft_sse.stream")

# What tells a proxy, even one configured with defaults, to pass each event on at once: nginx (and proxies that
# copy it) turn buffering off for a response with X-Accel-Buffering: no; no-transform forbids rewriting the body
# (compressing it, which would hold events back in a compressor's buffer); no-store keeps caches out.
CACHE_CONTROL = "no-store, no-transform"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": CACHE_CONTROL, "X-Accel-Buffering": "no"}


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class TokenStream(EventSourceResponse):
    """sse-starlette's response, less its ``Connection: keep-alive`` header.

    Do not put it back: HTTP/2 forbids connection-specific headers (RFC 9113 §8.2.2) and hypercorn speaks h2;
    on HTTP/1.1 keep-alive is the default anyway. ``X-Accel-Buffering: no`` (set by sse-starlette) and
    ``Cache-Control: no-store, no-transform`` stay: they keep proxies from buffering the stream.

    Shutdown: sse-starlette's own drain (``AppStatus``, ``shutdown_event``) is not used; under hypercorn nothing
    would trigger it. The drain ends each stream through its events instead (``Runtime.drain``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k.lower() != b"connection"]


async def stream(request: Request) -> Response:
    if request.method == "HEAD":  # headers only; never start a generation for a HEAD
        return Response(headers=SSE_HEADERS)
    runtime = runtime_of(request)
    caller = caller_of(request)
    run = await runtime.generations.open(
        await generation_request(request),
        caller=caller,
        arrival=arrival_of(request),
        endpoint="stream",
    )
    settings = runtime.settings
    return TokenStream(
        _events(run),
        headers={"Cache-Control": CACHE_CONTROL},
        ping=settings.ping_seconds,
        send_timeout=60,
        background=BackgroundTask(run.close),
    )


async def _events(run: Run) -> AsyncIterator[ServerSentEvent]:
    try:
        async for item in run.progress_events():
            yield sse_event(item, id=str(item.index) if isinstance(item, Piece) else None)
    except Exception as exc:
        yield sse_event(exc)


def sse_event(item: Queued | Progress | Piece | Finished | Exception, *, id: str | None = None) -> ServerSentEvent:
    """One event of the wire format every SSE surface of ours shares (``/stream``, ``/streams/{id}``)."""
    if isinstance(item, Piece):
        return ServerSentEvent(_json({"text": item.text}), event="token", id=id)
    if isinstance(item, Queued):
        return ServerSentEvent(_json({"position": item.position}), event="queued", id=id)
    if isinstance(item, Progress):
        return ServerSentEvent(
            _json({"prompt_tokens": item.prompt_tokens, "computed": item.computed}), event="progress"
        )
    if isinstance(item, Finished):
        done = {
            "finish_reason": item.finish_reason,
            "usage": item.usage.as_dict(),
            "timings": item.timings,
            "degraded": item.degraded,
        }
        return ServerSentEvent(_json(done), event="done", id=id)
    if isinstance(item, ServiceError):
        return ServerSentEvent(_json(item.to_dict()), event="error", id=id)
    # never a traceback on the wire; the log has it
    log.error("stream_failed", error_type=type(item).__name__, exc_info=item)
    error = {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}}
    return ServerSentEvent(_json(error), event="error", id=id)
