"""structlog set-up, and the middleware that gives every request an id, an arrival time and an access log line.

Every log line is bounded, whatever a client sends: what it names (fields, parameters) is listed the way error
messages list them (``errors.listed``: a few, each cut, "and N more"), and a path is cut to ``MAX_LOGGED_PATH``
characters with a resumable stream's id, which is a credential, replaced by its digest (``grants.digest``).
"""

from __future__ import annotations

import logging
import re
import sys
import time
import uuid

import structlog
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ttft_sse.admission.grants import digest
from ttft_sse.errors import printable

REQUEST_ID_HEADER = "x-request-id"
# Probes: orchestrators poll the health endpoints and Prometheus scrapes /metrics every few seconds, whatever their
# answer. Their access lines are debug, so that info holds what someone asked for: each generation's line, each
# refused request's access line, and each other request's. A probe that fails on an error still leaves the
# handler's error line (errors.py).
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
MAX_LOGGED_PATH = 200
_STREAM_PATH = re.compile(r"/streams/([^/]+)")


def logged_path(path: str) -> str:
    """``path`` as a log line shows it: a stream's id as its digest, at most ``MAX_LOGGED_PATH`` characters."""
    path = _STREAM_PATH.sub(lambda match: f"/streams/{digest(match.group(1))}", path)
    return printable(path, MAX_LOGGED_PATH)


def configure(*, level: str = "info", fmt: str = "json") -> None:
    """JSON lines on stderr (or a readable console form). Stdlib loggers (hypercorn's) go through the same path."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write a line (the message and its newline together): print's two writes let another thread's line,
        # written meanwhile by a logger of its own (transformers' has one), land between them.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RequestContext:
    """Pure ASGI middleware (it must not buffer streams): request id, arrival time, access log.

    The access log has one ``request`` line per request: at info, except for the probes of ``PROBE_PATHS`` (debug).
    A WebSocket connection is one request: its line comes when it ends, with status 101 once accepted, and its
    ``duration_ms`` is the connection's life.
    The id comes from the client's ``X-Request-ID`` when it sends a sane one, else a new one; it is echoed in
    the response and bound to every log line of the request. ``scope["state"]["arrival"]`` is the
    ``perf_counter`` at which the request reached the app: TTFT is measured from there.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.log = structlog.get_logger("ttft_sse.access")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        arrival = time.perf_counter()
        request_id = _request_id(scope)
        scope.setdefault("state", {})
        scope["state"]["arrival"] = arrival
        scope["state"]["request_id"] = request_id
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            elif kind == "websocket.accept":
                status = 101
                message.setdefault("headers", [])
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            elif kind == "websocket.close" and status == 0:
                status = 403  # closed before the handshake was accepted: the server refuses it with a 403
            await send(message)

        structlog.contextvars.bind_contextvars(request_id=request_id)
        path: str = scope["path"]
        probe = path.removeprefix(scope.get("root_path", "")) in PROBE_PATHS
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            (self.log.debug if probe else self.log.info)(
                "request",
                # A WebSocket's scope has no method: its handshake is a GET.
                method=printable(scope.get("method", "GET"), 20),
                path=logged_path(scope["path"]),
                status=status,
                duration_ms=round((time.perf_counter() - arrival) * 1000, 1),
            )
            structlog.contextvars.unbind_contextvars("request_id")


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text: str = value.decode("latin-1")
            if 0 < len(text) <= 128 and text.isascii() and text.isprintable():
                return text
    return uuid.uuid4().hex
