"""The API as an OpenAPI 3.1 document (``GET /openapi.json``), built from the validators' own schemas.

The request bodies are ``GenerationRequest.json_schema`` and ``api.openai_requests.json_schema``: written from the
same limits the validators read, and checked against the validators by a test that draws bodies and compares
verdicts. Nothing here restates a limit. The paths are the app's routes (a test checks that each route is here and
nothing else is).
"""

from __future__ import annotations

from typing import Any, get_args

from ttft_sse import __version__
from ttft_sse.api.openai_requests import json_schema as openai_schema
from ttft_sse.schemas import FIELDS, GenerationRequest, field_schemas
from ttft_sse.settings import Settings
from ttft_sse.stores.jobs import Status

OPENAPI_VERSION = "3.1.0"

_ERROR = {"$ref": "#/components/schemas/Error"}
_RETRY_AFTER = {
    "Retry-After": {"description": "whole seconds to wait before trying again", "schema": {"type": "integer"}}
}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def document(settings: Settings) -> dict[str, Any]:
    """The OpenAPI document of an app run with ``settings`` (the limits that are settings, ``max_tokens``' cap)."""
    cap = settings.max_tokens_cap
    generation = {"$ref": "#/components/schemas/GenerationRequest"}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "ttft-sse",
            "version": __version__,
            "description": "An LLM streaming server built for time-to-first-token. Errors are one JSON shape "
            '(`{"error": {"message", "type", "param", "code"}}`); `param` names the offending field.',
        },
        "paths": {
            "/stream": {
                "get": _generating(
                    "Tokens as Server-Sent Events (for EventSource): the request in the query string",
                    _SSE,
                    parameters=_query_parameters(cap),
                ),
                "post": _generating("Tokens as Server-Sent Events", _SSE, body=generation),
            },
            "/complete": {
                "post": _generating(
                    "The whole answer as one JSON document",
                    {"application/json": {"schema": {"$ref": "#/components/schemas/Completion"}}},
                    body=generation,
                )
            },
            "/prefill": {
                "post": _generating(
                    "Start computing the prompt typed so far into the prefix cache (background work); answers at once",
                    {
                        "application/json": {
                            "schema": _object(
                                {"prompt_tokens": {"type": "integer"}, "cached_tokens": {"type": "integer"}}
                            )
                        }
                    },
                    body=generation,
                    status="202",
                )
            },
            "/streams": {
                "post": _generating(
                    "Start a resumable stream; GET its url to read it (Last-Event-ID resumes). With API keys, the "
                    "stream is the key's, and url carries its grant (?grant=), which opens it for an hour",
                    {
                        "application/json": {
                            "schema": {
                                **_object(
                                    {"id": {"type": "string"}, "url": {"type": "string"}, "lane": {"type": "string"}}
                                ),
                                "properties": {
                                    "id": {"type": "string"},
                                    "url": {"type": "string"},
                                    "lane": {"type": "string"},
                                    "grant": {"type": "string", "description": "with API keys only"},
                                },
                            }
                        }
                    },
                    body=generation,
                    status="201",
                )
            },
            "/streams/{stream_id}": {
                "get": _operation(
                    "Read a resumable stream, from after Last-Event-ID",
                    {"200": {"description": "the events", "content": _SSE}, "204": {"description": "nothing left"}},
                    parameters=[
                        _path("stream_id"),
                        {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}},
                        {"name": "lastEventId", "in": "query", "schema": {"type": "string"}},
                        _GRANT,
                    ],
                    errors=("400", "401", "404", "410"),
                ),
                "delete": _operation(
                    "Stop a resumable stream's generation",
                    {"204": {"description": "stopped"}},
                    parameters=[_path("stream_id"), _GRANT],
                    errors=("401", "404"),
                ),
            },
            "/chat": {
                "get": _operation(
                    "The seed design's WebSocket chat, for clients written against it (Server-Sent Events on /stream "
                    "are the primary surface)",
                    {
                        "101": {
                            "description": "Switching Protocols. Then, in text frames: the client sends the body of "
                            "POST /stream as JSON; the server sends each piece of text, then [DONE], or one "
                            "'[ERROR] <message>' and closes. The key: Authorization, X-API-Key, ?api_key= or the "
                            "protocol bearer.<key>. See docs/streams.md"
                        },
                        "426": {
                            "description": "not a WebSocket handshake",
                            "content": {"application/json": {"schema": _ERROR}},
                        },
                    },
                    parameters=[{"name": "api_key", "in": "query", "schema": {"type": "string"}}],
                    errors=(),
                )
            },
            "/jobs": {
                "post": _generating(
                    "Queue the request as an overflow job; poll its result_url",
                    {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}},
                    body=generation,
                    status="202",
                )
            },
            "/result/{job_id}": {
                "get": _operation("A job and, once done, its result", _job(), parameters=[_path("job_id")])
            },
            "/jobs/{job_id}": {
                "delete": _operation("Cancel a job", _job(), parameters=[_path("job_id")], errors=("404", "409"))
            },
            "/v1/chat/completions": {
                "post": _generating(
                    "OpenAI chat completions (stream: true for Server-Sent Events)",
                    {"application/json": {"schema": {"type": "object"}}, **_SSE},
                    body={"$ref": "#/components/schemas/ChatCompletionRequest"},
                )
            },
            "/v1/completions": {
                "post": _generating(
                    "OpenAI text completions: the prompt as is, without the chat template",
                    {"application/json": {"schema": {"type": "object"}}, **_SSE},
                    body={"$ref": "#/components/schemas/CompletionRequest"},
                )
            },
            "/v1/models": {"get": _operation("The served model (OpenAI's list)", _json_ok(), errors=("503",))},
            "/v1/models/{model}": {
                "get": _operation(
                    "The served model, by name", _json_ok(), parameters=[_path("model")], errors=("404", "503")
                )
            },
            "/healthz": {"get": _operation("Liveness: the process answers", _json_ok(), errors=())},
            "/readyz": {
                "get": _operation(
                    "Readiness: 200 once the model is loaded and warm, 503 while loading or draining",
                    _json_ok(),
                    errors=("503",),
                )
            },
            "/metrics": {
                "get": _operation(
                    "Prometheus metrics",
                    {
                        "200": {
                            "description": "the exposition",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                    errors=(),
                )
            },
            "/openapi.json": {"get": _operation("This document", _json_ok(), errors=())},
            "/": {
                "get": _operation(
                    "The chat page",
                    {"200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}},
                    errors=(),
                )
            },
        },
        "components": {
            "schemas": {
                "GenerationRequest": GenerationRequest.json_schema(max_tokens_cap=cap),
                "ChatCompletionRequest": openai_schema(chat=True, max_tokens_cap=cap),
                "CompletionRequest": openai_schema(chat=False, max_tokens_cap=cap),
                "Error": _error_schema(),
                "Completion": _completion_schema(),
                "Job": _job_schema(),
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            },
        },
        # Keys are needed only where TTFT_API_KEYS is set: no security is one of the alternatives.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }


def _query_parameters(cap: int) -> list[dict[str, Any]]:
    """``GET /stream``'s query: the body's fields, scalars as text, ``stop`` repeated, ``messages`` as JSON."""
    fields = field_schemas(max_tokens_cap=cap)
    parameters: list[dict[str, Any]] = []
    for name in FIELDS:
        schema = {key: value for key, value in fields[name].items() if key != "description"}
        if isinstance(schema.get("type"), list):
            schema["type"] = next(kind for kind in schema["type"] if kind != "null")
        if name == "messages":
            parameters.append({"name": name, "in": "query", "content": {"application/json": {"schema": schema}}})
        elif name == "stop":
            item = {"type": "string", "minLength": 1}
            array = {"type": "array", "items": item, "maxItems": fields["stop"]["anyOf"][2]["maxItems"]}
            parameters.append({"name": name, "in": "query", "schema": array, "explode": True})
        else:
            parameters.append({"name": name, "in": "query", "schema": schema})
    return parameters


def _generating(
    summary: str,
    content: dict[str, Any],
    *,
    body: dict[str, Any] | None = None,
    parameters: list[dict[str, Any]] | None = None,
    status: str = "200",
) -> dict[str, Any]:
    operation = _operation(
        summary,
        {status: {"description": "the answer", "content": content}},
        parameters=parameters,
        errors=("400", "401", "408", "413", "415", "500", "503"),
    )
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return operation


def _operation(
    summary: str,
    responses: dict[str, Any],
    *,
    parameters: list[dict[str, Any]] | None = None,
    errors: tuple[str, ...] = ("400", "401", "404"),
) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": dict(responses)}
    if parameters:
        operation["parameters"] = parameters
    for status in errors:
        error: dict[str, Any] = {"description": _REASONS[status], "content": {"application/json": {"schema": _ERROR}}}
        if status == "503":
            error["headers"] = _RETRY_AFTER
        operation["responses"][status] = error
    return operation


_REASONS = {
    "400": "the request is wrong; param names the field",
    "401": "a key is needed (TTFT_API_KEYS)",
    "404": "no such thing",
    "408": "the body did not arrive in time (TTFT_BODY_TIMEOUT_SECONDS)",
    "409": "it has ended already",
    "410": "it existed, and is gone",
    "413": "the body is over TTFT_MAX_BODY_BYTES",
    "415": "the body is not labelled as JSON",
    "500": "generation failed",
    "503": "loading, draining, or no room: retry after Retry-After",
}


_GRANT = {
    "name": "grant",
    "in": "query",
    "schema": {"type": "string"},
    "description": "with API keys: the stream's grant, from the url POST /streams answered (instead of a key header)",
}


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _json_ok() -> dict[str, Any]:
    return {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}


def _job() -> dict[str, Any]:
    return {
        "200": {
            "description": "the job",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}},
        }
    }


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": sorted(properties)}


def _job_schema() -> dict[str, Any]:
    schema = _object(
        {"id": {"type": "string"}, "status": {"enum": list(get_args(Status))}, "result_url": {"type": "string"}}
    )
    schema["description"] = "a done job also has the /complete answer's fields; a failed one an error"
    return schema


def _error_schema() -> dict[str, Any]:
    nullable = {"type": ["string", "null"]}
    return _object(
        {
            "error": _object(
                {"message": {"type": "string"}, "type": {"type": "string"}, "param": nullable, "code": nullable}
            )
        }
    )


def _completion_schema() -> dict[str, Any]:
    return _object(
        {
            "text": {"type": "string"},
            "finish_reason": {"enum": ["stop", "length"]},
            "usage": _object(
                {name: {"type": "integer"} for name in ("prompt_tokens", "completion_tokens", "total_tokens")}
            ),
            "timings": {"type": "object", "additionalProperties": {"type": "number"}},
        }
    )
