"""``POST /prefill``: start computing a prompt's KV while its user types (ttft_sse/prefixes/prefills.py); 202 at once.

The body is one a generating endpoint takes: ``/stream``'s and ``/complete``'s (``prompt`` or ``messages``), or an
OpenAI one (a body with ``model``: ``/v1/chat/completions``'s with ``messages``, ``/v1/completions``'s with
``prompt``). The same key is asked for as there. ``X-Prefill-Session`` names the caller's session (a browser tab):
a newer prefill of the same key and session supersedes the older one.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from ttft_sse.api.body import caller_of, json_body, runtime_of
from ttft_sse.api.openai_requests import parse_chat, parse_completion
from ttft_sse.schemas import GenerationRequest

SESSION_HEADER = "x-prefill-session"


async def prefill(request: Request) -> JSONResponse:
    runtime = runtime_of(request)
    caller = caller_of(request)
    generation = _generation(await json_body(request), max_tokens_cap=runtime.settings.max_tokens_cap)
    session = request.headers.get(SESSION_HEADER, "")
    accepted = await runtime.prefills.start(generation, caller=caller, session=session)
    return JSONResponse(accepted.as_dict(), status_code=202)


def _generation(body: Any, *, max_tokens_cap: int) -> GenerationRequest:
    """The request ``body`` stands for: an OpenAI body where it names a ``model``, else ours."""
    if isinstance(body, dict) and "model" in body:
        parse = parse_chat if "messages" in body else parse_completion
        return parse(body, max_tokens_cap=max_tokens_cap).generation
    return GenerationRequest.from_json(body, max_tokens_cap=max_tokens_cap)
