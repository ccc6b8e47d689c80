"""``GET /openapi.json``: the API as OpenAPI 3.1, from the validators' own schemas (``ttft_sse.api.openapi``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from ttft_sse.api.body import runtime_of
from ttft_sse.api.openapi import document


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(document(runtime_of(request).settings))
