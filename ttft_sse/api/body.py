"""Reading a generation request from an HTTP request: query string (GET) or JSON body (POST).

A body is JSON, labelled as JSON: ``Content-Type: application/json`` (or a ``+json`` type), UTF-8. Anything else is a
415 unless ``TTFT_ALLOW_ANY_CONTENT_TYPE`` is on, because the labels a browser may send to another origin without
asking first (no label, ``text/plain``, a form) are how a page elsewhere would make a visitor's browser start
generations here (cross-site request forgery); a JSON label makes the browser ask first (CORS preflight), and this
server grants no other origin. Then: at most ``TTFT_MAX_BODY_BYTES``, all of it within
``TTFT_BODY_TIMEOUT_SECONDS`` of the request's arrival (408 after), parsed by :mod:`ttft_sse.json_input` (depth,
number and Unicode limits). A client that leaves mid-upload is ``ClientGone``, not a server error.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import anyio
from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect, HTTPConnection, Request

from ttft_sse import json_input
from ttft_sse.admission.auth import Caller
from ttft_sse.errors import (
    ClientGone,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    UnsupportedMediaType,
    printable,
)
from ttft_sse.runtime import Runtime
from ttft_sse.schemas import GenerationRequest


def runtime_of(request: HTTPConnection) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def arrival_of(request: Request) -> float:
    arrival: float = request.scope["state"]["arrival"]
    return arrival


def caller_of(request: HTTPConnection) -> Caller:
    """Who is asking, from ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``; 401 when keys are on and
    neither holds a valid one. Call it first, before reading the body: a stranger learns nothing about it.
    """
    keyring = runtime_of(request).keyring
    if not keyring.enabled:
        return keyring.identify(None)
    presented = request.headers.get("x-api-key")
    authorization = request.headers.get("authorization")
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthorized("the Authorization header must use the Bearer scheme", code="invalid_api_key")
        presented = credentials.strip()
    return keyring.identify(presented)


def check_content_type(content_type: str | None, *, allow_any: bool) -> None:
    """415 unless ``content_type`` labels UTF-8 JSON (``application/json`` or ``*/*+json``; no charset, or utf-8).

    ``allow_any`` (``TTFT_ALLOW_ANY_CONTENT_TYPE``) reads every body as JSON whatever its label, ``curl -d``'s
    form label included: only where no browser can reach the server.
    """
    if allow_any:
        return
    if content_type is None:
        raise UnsupportedMediaType(
            "the request has no Content-Type; send the JSON body with Content-Type: application/json",
            param="Content-Type",
            code="unsupported_media_type",
        )
    media, *parameters = (part.strip() for part in content_type.split(";"))
    media = media.lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {printable(repr(media), 80)}",
            param="Content-Type",
            code="unsupported_media_type",
        )
    for parameter in parameters:
        key, _, value = parameter.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise UnsupportedMediaType(
                f"the body must be UTF-8, got charset {printable(repr(value.strip()), 40)}",
                param="Content-Type",
                code="unsupported_media_type",
            )


async def json_body(request: Request) -> Any:
    """The parsed JSON body: labelled as JSON (415), within the size cap (413), in time (408), sound (400).

    Not Starlette's ``max_body_size``: that one answers a plain-text 413 past every exception handler, and
    every error here is JSON.
    """
    settings = runtime_of(request).settings
    check_content_type(request.headers.get("content-type"), allow_any=settings.allow_any_content_type)
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is {printable(declared, 40)} bytes; the limit is {limit}")
    chunks, size = [], 0
    # The deadline counts from the request's arrival: a body that trickles in (a byte now and then) is as stuck as
    # one that stopped.
    deadline = arrival_of(request) + settings.body_timeout_seconds
    try:
        with anyio.fail_after(max(deadline - time.perf_counter(), 0)):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {settings.body_timeout_seconds:g} s ({size} bytes came)",
            code="body_timeout",
        ) from None
    except ClientDisconnect as exc:
        raise ClientGone(f"the client closed the connection after {size} bytes of the request body") from exc
    raw = b"".join(chunks)
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    return json_input.parse(raw)


def query_of(request: Request) -> QueryParams:
    """The query string's parameters, refused (400) unless it is UTF-8 once percent-decoded: a JSON body with invalid
    UTF-8 is refused too, and Starlette's own reading would replace the bad bytes with U+FFFD without a word."""
    raw: bytes = request.scope.get("query_string", b"")
    try:
        urllib.parse.parse_qsl(raw.decode("utf-8"), keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidRequest(
            "the query string is not valid UTF-8 (once percent-decoded); encode text as UTF-8", code="invalid_utf8"
        ) from None
    return request.query_params


async def generation_request(request: Request) -> GenerationRequest:
    cap = runtime_of(request).settings.max_tokens_cap
    if request.method in ("GET", "HEAD"):
        return GenerationRequest.from_query(query_of(request), max_tokens_cap=cap)
    return GenerationRequest.from_json(await json_body(request), max_tokens_cap=cap)
