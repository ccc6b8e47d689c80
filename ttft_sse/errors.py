"""One exception tree for the whole service, and the handlers that turn it into JSON at the HTTP boundary.

    ServiceError                      every error the service raises on purpose
    ├── ClientError                   the request is wrong; 4xx, never logged as a server fault
    │   ├── InvalidRequest            400 invalid_request_error (names the offending ``param``)
    │   │   └── PromptTooLong         400, the prompt does not fit the model's context
    │   ├── Unauthorized              401 authentication_error
    │   ├── Forbidden                 403 permission_error (a page of another origin opening /chat)
    │   ├── NotFound                  404 not_found_error
    │   │   └── Gone                  410, it existed once: an expired or deleted stream, or events dropped
    │   ├── Conflict                  409 conflict_error (e.g. cancelling a job that has already finished)
    │   ├── RequestTimeout            408 invalid_request_error: the body did not arrive in time (code ``body_timeout``)
    │   ├── PayloadTooLarge           413 invalid_request_error
    │   ├── TooManyRequests           429 rate_limit_error with Retry-After (a key's prefills over its bound)
    │   └── UnsupportedMediaType      415 invalid_request_error
    ├── ClientGone                    the client left before its request was read (mid-upload): nobody is there to
    │                                 answer; logged at info, counted as ``client_gone``, never as a server error
    ├── Unavailable                   503 with Retry-After
    │   ├── NotReady                  the model is still loading
    │   ├── Overloaded                every generation slot and queue place is taken
    │   └── ShuttingDown              shutdown_error: the server is draining (code ``draining``: refused before
    │                                 anything was generated; ``drain_timeout``: cut at the end of the drain grace)
    ├── Cancelled                     cancelled_error: a client stopped the generation (``DELETE /streams/{id}``);
    │                                 the final event of the stream for anyone still reading it
    ├── EngineError                   500 server_error: generation itself failed
    └── StartupError                  the model cannot be found or loaded; the process exits with its message

Lower-layer errors (torch, transformers, the thread bridge) are translated with ``raise EngineError(...) from
exc`` inside the engine; Starlette's ``ClientDisconnect`` becomes ``ClientGone``. Every JSON error has one shape:
``{"error": {"message", "type", "param", "code"}}``. No traceback ever reaches a client: unexpected exceptions become
a generic 500 and are logged with a request id. A message or param may quote what the client sent: each is made
printable UTF-8 (a lone surrogate becomes its ``\\udXXX`` escape) and cut to a bounded length, so that quoting a
hostile value can neither fail to encode nor echo a megabyte back.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

log = structlog.get_logger("ttft_sse.errors")

MAX_MESSAGE_CHARS = 1000  # an error message longer than this is cut (it can quote what the client sent)
MAX_PARAM_CHARS = 200


def printable(text: str, limit: int) -> str:
    """``text`` as valid UTF-8 (lone surrogates as ``\\udXXX`` escapes), at most ``limit`` characters (cut with …)."""
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def quoted(value: object, limit: int = 60) -> str:
    """A client's value for an error message: JSON-quoted where JSON can write it, cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return printable(text, limit)


def listed(names: Sequence[str], *, shown: int = 5, each: int = 40) -> str:
    """Names a client sent (fields, parameters), for a message or a log line: the first ``shown``, each cut to
    ``each`` characters, then "and N more". However many and however long, the result is bounded."""
    text = ", ".join(printable(name, each) for name in names[:shown])
    more = len(names) - shown
    return f"{text} and {more} more" if more > 0 else text


class ServiceError(Exception):
    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        message = printable(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else printable(param, MAX_PARAM_CHARS)
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ServiceError:
        """The error whose :meth:`to_dict` gave ``body``: a stream's final event read back from Redis. Its class is
        not kept; its JSON (message, type, param, code) is the same."""
        error = body["error"]
        exc = cls(error["message"], param=error.get("param"), code=error.get("code"))
        exc.error_type = error["type"]
        return exc


class ClientError(ServiceError):
    status_code = 400
    error_type = "invalid_request_error"


class InvalidRequest(ClientError):
    pass


class PromptTooLong(InvalidRequest):
    pass


class Unauthorized(ClientError):
    status_code = 401
    error_type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="ttft-sse"'}


class Forbidden(ClientError):
    status_code = 403
    error_type = "permission_error"


class NotFound(ClientError):
    status_code = 404
    error_type = "not_found_error"


class Gone(NotFound):
    status_code = 410


class Conflict(ClientError):
    status_code = 409
    error_type = "conflict_error"


class RequestTimeout(ClientError):
    status_code = 408


class PayloadTooLarge(ClientError):
    status_code = 413


class UnsupportedMediaType(ClientError):
    status_code = 415


class TooManyRequests(ClientError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, param: str | None = None, code: str | None = None):
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, int(-(-self.retry_after // 1))))}


class Unavailable(ServiceError):
    status_code = 503
    error_type = "unavailable_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        # Retry-After takes whole seconds; round up so that a client never comes back too early.
        return {"Retry-After": str(max(1, int(-(-self.retry_after // 1))))}


class NotReady(Unavailable):
    pass


class Overloaded(Unavailable):
    error_type = "overloaded_error"


class ShuttingDown(Unavailable):
    """The server is shutting down. Sent as a 503 before a response starts, or as the final SSE ``error`` event."""

    error_type = "shutdown_error"


class Cancelled(ServiceError):
    status_code = 409
    error_type = "cancelled_error"


class ClientGone(ServiceError):
    """The client closed the connection before its request was read. 499 (nginx's "client closed request") goes
    to the access log only: the connection is gone, nothing is sent."""

    status_code = 499
    error_type = "client_gone"


class EngineError(ServiceError):
    pass


class StartupError(ServiceError):
    pass


def error_response(exc: ServiceError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers())


def _count_refusal(request: Request, exc: Exception) -> None:
    """Count a request that its route refused before it reached ``Generations`` (a bad body, say).

    ``observe_refused`` counts each exception once, so one that ``Generations.open`` or ``Run.events`` already
    counted (and ``/complete`` re-raised) is not counted again. The endpoint label is the route's name, which
    is what routes pass to ``Generations.open`` as ``endpoint``.
    """
    runtime = getattr(request.app.state, "runtime", None)
    route = request.scope.get("route")
    if runtime is not None and route is not None:
        runtime.metrics.observe_refused(getattr(route, "name", None) or request.url.path, exc)


async def _service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    _count_refusal(request, exc)
    if isinstance(exc, ClientGone):
        # Only routes that read a body meet this, and none of their paths holds a stream's id.
        log.info("client_gone", error=exc.message, method=request.method, path=printable(request.url.path, 200))
    elif not isinstance(exc, ClientError | Unavailable):
        log.error("request_failed", error=exc.message, error_type=type(exc).__name__)
    return error_response(exc)


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    """Starlette's ``ClientDisconnect`` from wherever a route met it: the client left, not a server fault."""
    return await _service_error(request, ClientGone("the client closed the connection before the request was read"))


_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 413:
        message = "request body is too large"
    else:
        message = str(exc.detail)
    body = {
        "error": {
            "message": message,
            "type": _HTTP_TYPES.get(exc.status_code, "invalid_request_error"),
            "param": None,
            "code": None,
        }
    }
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    _count_refusal(request, exc)
    log.exception("unhandled_error", error_type=type(exc).__name__)
    body = {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=500)


EXCEPTION_HANDLERS: dict[Any, Any] = {
    ServiceError: _service_error,
    ClientDisconnect: _client_disconnect,
    HTTPException: _http_error,
    Exception: _unexpected_error,
}


@contextlib.contextmanager
def redis_unavailable(store: str) -> Iterator[None]:
    """Translate Redis being down into the service's trouble, not the client's: a 503 naming ``store`` (the job
    queue, the stream store) with a short Retry-After."""
    from redis.exceptions import RedisError

    try:
        yield
    except RedisError as exc:
        log.error("redis_unavailable", store=store, error_type=type(exc).__name__, error=str(exc))
        raise Unavailable(f"{store} (Redis) cannot be reached; try again shortly", retry_after=5) from exc
