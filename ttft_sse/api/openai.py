"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``: the OpenAI protocol over the same generation path.

Another surface, not another server. A body is read by the same ``json_body`` (size cap, content type), mapped onto a
``GenerationRequest`` (the same validation, so the same messages) and run by ``runtime.generations`` (the same gate,
engine and ``generation`` log line) as ``/stream`` and ``/complete``. Only the framing is OpenAI's::

    data: {"choices":[{"delta":{"role":"assistant","content":""},…}],…}     chat only: the role, once, first
    data: {"choices":[{"delta":{"content":"Paris"},…}],…}                  one chunk per piece; never empty
    data: {"choices":[{"delta":{},"finish_reason":"stop"}],"timings":{…}}  exactly one finish_reason, then…
    data: {"choices":[],"usage":{…}}                                       …only with stream_options.include_usage
    data: [DONE]

Errors before the stream starts are the service's usual JSON errors, whose shape is OpenAI's, so the openai client
raises its matching exception (``BadRequestError``, ``InternalServerError``…). An error after the stream started is one
``data: {"error": {…}}`` chunk, then ``data: [DONE]``; the openai client raises ``APIError`` with its message.

The request bodies, and the choices made in reading them: ttft_sse/api/openai_requests.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import structlog
from sse_starlette import ServerSentEvent
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ttft_sse.api.body import arrival_of, caller_of, json_body, runtime_of
from ttft_sse.api.complete import collect, server_timing
from ttft_sse.api.openai_requests import OWNED_BY, parse_chat, parse_completion, renamed_max_tokens
from ttft_sse.api.sse import TokenStream
from ttft_sse.engine.base import Finished, ModelInfo, Piece, Usage
from ttft_sse.errors import NotFound, NotReady, ServiceError, listed
from ttft_sse.generation import Queued, Run

log = structlog.get_logger("ttft_sse.openai")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, *, chat: bool) -> Response:
    runtime = runtime_of(request)
    caller = caller_of(request)  # first: without a valid key (when keys are on), a 401 before the body is read
    parse = parse_chat if chat else parse_completion
    parsed = parse(await json_body(request), max_tokens_cap=runtime.settings.max_tokens_cap)
    if parsed.user is not None:
        # Logged with every line of this request (the generation line too), never echoed. The binding ends with
        # the request: hypercorn runs each request in a task of its own, with its own copy of the context.
        structlog.contextvars.bind_contextvars(user=parsed.user[:256])
    if parsed.ignored:
        # Bounded: the names are the client's (the probe sent 2,000 of 200 characters each).
        log.warning("openai_fields_ignored", fields=listed(parsed.ignored), count=len(parsed.ignored))
    with renamed_max_tokens(parsed.max_tokens_field):  # "lower max_tokens to …" names the client's field
        run = await runtime.generations.open(
            parsed.generation,
            caller=caller,
            arrival=arrival_of(request),
            endpoint="chat_completions" if chat else "completions",
        )
    reply = Reply(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{request.scope['state']['request_id']}",
        created=int(time.time()),
        model=runtime.engine.info.name,
        chat=chat,
    )
    if parsed.stream:
        return TokenStream(
            _chunks(run, reply, include_usage=parsed.include_usage),
            ping=runtime.settings.ping_seconds,
            send_timeout=60,
            sep="\n",  # as OpenAI and vLLM frame events; hand-written clients split on "\n\n"
            background=BackgroundTask(run.close),
        )
    result = await collect(request, run)
    if result is None:  # only when the client disconnected; nobody reads this
        return Response(status_code=499)
    text, finished = result
    return JSONResponse(reply.whole(text, finished), headers={"Server-Timing": server_timing(finished.timings)})


@dataclass(frozen=True)
class Reply:
    """The frame of one reply: chat (``chat.completion``) or text (``text_completion``), whole or in chunks."""

    id: str
    created: int
    model: str
    chat: bool

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _frame(self, kind: str, choice: dict[str, Any] | None, finish_reason: str | None = None) -> dict[str, Any]:
        choices = [] if choice is None else [{"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}]
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def role_chunk(self, **extra: Any) -> dict[str, Any]:
        return {**self._frame(self._chunk_kind, {"delta": {"role": "assistant", "content": ""}}), **extra}

    def chunk(self, text: str | None, *, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        """A choice chunk; ``text=None`` is the finishing chunk, which carries no text."""
        delta: dict[str, Any] = {} if text is None else {"content": text}
        choice = {"delta": delta} if self.chat else {"text": text or ""}
        return {**self._frame(self._chunk_kind, choice, finish_reason), **extra}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._frame(self._chunk_kind, None), "usage": usage.openai_dict()}

    def whole(self, text: str, finished: Finished) -> dict[str, Any]:
        if self.chat:
            frame = self._frame(
                "chat.completion", {"message": {"role": "assistant", "content": text}}, finished.finish_reason
            )
        else:
            frame = self._frame("text_completion", {"text": text}, finished.finish_reason)
        return {
            **frame,
            "usage": finished.usage.openai_dict(),
            "timings": finished.timings,
            "degraded": finished.degraded,
        }


def _event(data: Any) -> ServerSentEvent:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(text, sep="\n")


_INTERNAL_ERROR = {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}}


async def _chunks(run: Run, reply: Reply, *, include_usage: bool) -> AsyncIterator[ServerSentEvent]:
    # With include_usage, OpenAI puts "usage": null on every other chunk; without it, no chunk has the key.
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    started = False
    try:
        async with aclosing(run.events()) as events:
            async for item in events:
                if isinstance(item, Queued):
                    continue  # the protocol has no word for it; sse-starlette's pings keep the connection open
                if reply.chat and not started:
                    yield _event(reply.role_chunk(**extra))
                started = True
                if isinstance(item, Piece):
                    yield _event(reply.chunk(item.text, **extra))
                else:
                    final = reply.chunk(
                        None, finish_reason=item.finish_reason, timings=item.timings, degraded=item.degraded, **extra
                    )
                    yield _event(final)
                    if include_usage:
                        yield _event(reply.usage_chunk(item.usage))
    except ServiceError as exc:
        yield _event(exc.to_dict())
    except Exception as exc:  # never a traceback on the wire; the log has it
        log.exception("stream_failed", error_type=type(exc).__name__)
        yield _event(_INTERNAL_ERROR)
    yield _event("[DONE]")


# -- models ------------------------------------------------------------------------------------------------------


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_card(_served(request))]})


async def retrieve_model(request: Request) -> JSONResponse:
    info = _served(request)
    name = request.path_params["model"]
    if name != info.name:
        message = f"model {name!r} is not served here; this server serves {info.name!r}"
        raise NotFound(message, param="model", code="model_not_found")
    return JSONResponse(_card(info))


def _served(request: Request) -> ModelInfo:
    runtime = runtime_of(request)
    if not runtime.lifecycle.ready:
        raise NotReady(runtime.lifecycle.not_ready_reason(), retry_after=5)
    return runtime.engine.info


def _card(info: ModelInfo) -> dict[str, Any]:
    # "created" is when the card was made, as vLLM does: the API wants a time, and the weights carry none.
    return {
        "id": info.name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": OWNED_BY,
        "max_model_len": info.context_length,
    }
