"""Reading a generation request from an HTTP request: query string (GET) or JSON body (POST)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from ttft_sse.auth import Caller
from ttft_sse.errors import InvalidRequest, PayloadTooLarge, Unauthorized, UnsupportedMediaType
from ttft_sse.runtime import Runtime
from ttft_sse.schemas import GenerationRequest

_JSON_LIKE = ("application/json", "application/x-www-form-urlencoded", "text/plain")


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def arrival_of(request: Request) -> float:
    arrival: float = request.scope["state"]["arrival"]
    return arrival


def caller_of(request: Request) -> Caller:
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


async def json_body(request: Request) -> Any:
    """The parsed JSON body, read up to the configured size cap (413 beyond it).

    Not Starlette's ``max_body_size``: that one answers a plain-text 413 past every exception handler, and
    every error here is JSON.
    """
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    # curl -d sends form-urlencoded by default; a JSON body under that label is still read as JSON.
    if content_type not in _JSON_LIKE and not content_type.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {content_type!r}")
    limit = runtime_of(request).settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


async def generation_request(request: Request) -> GenerationRequest:
    cap = runtime_of(request).settings.max_tokens_cap
    if request.method in ("GET", "HEAD"):
        return GenerationRequest.from_query(request.query_params, max_tokens_cap=cap)
    return GenerationRequest.from_json(await json_body(request), max_tokens_cap=cap)
