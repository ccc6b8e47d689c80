"""``/chat``: the seed design's WebSocket protocol, for clients written against it; Server-Sent Events stay primary.

The protocol, exactly as that design's client speaks it (every frame is text)::

    client → {"prompt": "...", "max_tokens": N}        one JSON object: the body of POST /stream (any of its fields)
    server → "Once"  " upon"  " a time" …             each piece of text as it is decoded, one frame each
    server → "[DONE]"                                  the answer is complete
    server → "[ERROR] <message>"                       instead, on any failure; then the server closes

Its reference client appends every frame that is not ``[DONE]`` to the page, so every failure a user can meet is a
frame with a sentence, never a bare close: a missing or wrong API key, a foreign origin, a bad message, no room and
the drain are all answered after the handshake is accepted (a refused handshake reaches a page as a close with code
1006 and no reason). After ``[DONE]`` the connection takes the next prompt (one connection, many prompts, one at a
time); after ``[ERROR]`` the server closes it with the code :data:`CLOSE_CODES` gives.

Each prompt goes through the path ``/stream`` takes (``Generations.open`` → ``Run.events``): validation, the caller's
lane, admission (overload is an ``[ERROR]`` naming ``Retry-After``), first-token targets, metrics and the generation
log line (endpoint ``chat``). Its time to first token counts from the prompt's frame. ``queued`` events have no frame
in this protocol: a queued prompt is silent until its first piece. A client that goes away stops its generation; a
frame that arrives while an answer streams is refused (the answer stops). On SIGTERM, answers in flight finish
within the drain grace (or end with ``[ERROR]`` when it runs out), idle connections close with 1001, and a prompt
that arrives meanwhile is refused.

Keys: a browser cannot set headers on a WebSocket, so the key comes from ``Authorization: Bearer``/``X-API-Key``
(other clients), else the query parameter ``api_key``, else a ``Sec-WebSocket-Protocol`` value ``bearer.<key>``.
Origins: a browser always sends ``Origin`` on a WebSocket, and no CORS check applies, so any page could open one;
a page from another origin than the server's own host (or ``TTFT_CHAT_ORIGINS``) is refused, as a body without a
JSON label is on the HTTP surfaces (api/body.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import aclosing
from urllib.parse import urlsplit

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketState

from ttft_sse import json_input
from ttft_sse.admission.auth import Caller, Keyring
from ttft_sse.api.body import caller_of, runtime_of
from ttft_sse.engine.base import Finished, Piece
from ttft_sse.errors import (
    ClientError,
    Forbidden,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
    ShuttingDown,
    Unauthorized,
    Unavailable,
)
from ttft_sse.generation import Run
from ttft_sse.runtime import Runtime
from ttft_sse.schemas import GenerationRequest

log = structlog.get_logger("ttft_sse.chat")

ENDPOINT = "chat"  # the metrics' and the generation log's endpoint label
DONE = "[DONE]"
ERROR = "[ERROR]"
KEY_PROTOCOL = "bearer."  # a Sec-WebSocket-Protocol value that carries an API key: bearer.<key>
KEY_PARAMETER = "api_key"
UNREAD_GRACE_S = 1.0  # how long a refusal made before any message is read waits for the prompt a client sends on open

# Close codes (RFC 6455 §7.4.1 and IANA's registry): what ended the connection, for clients that read them.
NORMAL, GOING_AWAY, UNSUPPORTED_DATA, POLICY_VIOLATION, TOO_BIG = 1000, 1001, 1003, 1008, 1009
INTERNAL_ERROR, TRY_AGAIN_LATER = 1011, 1013
UNAUTHORIZED, FORBIDDEN, TIMEOUT = 3000, 3003, 3008  # IANA-registered 3xxx codes


def close_code(exc: BaseException) -> int:
    """The close code after the ``[ERROR]`` frame of ``exc``: the first of :data:`CLOSE_CODES` whose error it is."""
    return next((code for kind, code in CLOSE_CODES if isinstance(exc, kind)), INTERNAL_ERROR)


class Binary(InvalidRequest):
    """A binary frame: the protocol's frames are text."""


CLOSE_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (Unauthorized, UNAUTHORIZED),
    (Forbidden, FORBIDDEN),
    (RequestTimeout, TIMEOUT),
    (PayloadTooLarge, TOO_BIG),
    (Binary, UNSUPPORTED_DATA),
    (ClientError, POLICY_VIOLATION),  # after its subclasses above
    (ShuttingDown, GOING_AWAY),
    (Unavailable, TRY_AGAIN_LATER),  # after ShuttingDown, one of its kinds
)
"""Each error's close code, the more particular kind first; anything else ends with 1011 (an internal error)."""


def error_frame(exc: BaseException) -> str:
    """``[ERROR] <message>``; a 503's message ends with the ``Retry-After`` the HTTP surfaces send as a header.
    Never a traceback: an unexpected exception is logged and said as "internal server error"."""
    if not isinstance(exc, ServiceError):
        log.error("chat_failed", error_type=type(exc).__name__, exc_info=exc)
        return f"{ERROR} internal server error"
    if isinstance(exc, Unavailable):
        return f"{ERROR} {exc.message} (Retry-After: {exc.headers()['Retry-After']})"
    return f"{ERROR} {exc.message}"


async def upgrade_required(request: Request) -> Response:
    """``GET /chat`` without a WebSocket handshake: 426, saying how to open it."""
    error = InvalidRequest(
        "/chat is a WebSocket endpoint: open it with a WebSocket client (ws:// or wss://), or use /stream (SSE)",
        code="websocket_required",
    )
    # RFC 9110 §15.5.22 wants the Upgrade header; HTTP/2 forbids it (connection-specific, RFC 9113 §8.2.2).
    headers = {"Upgrade": "websocket"} if request.scope.get("http_version") in ("1.0", "1.1") else {}
    return JSONResponse(error.to_dict(), status_code=426, headers=headers)


async def chat(websocket: WebSocket) -> None:
    runtime = runtime_of(websocket)
    offered: list[str] = list(websocket.scope.get("subprotocols") or ())
    await websocket.accept(subprotocol=chosen_protocol(offered))
    try:
        if runtime.lifecycle.closing.is_set():  # a newcomer while draining: told so, not just closed
            raise runtime.lifecycle.refusal()
        check_origin(websocket, runtime.settings.chat_origin_set)
        caller = caller_from(websocket, runtime.keyring, offered)
    except ServiceError as exc:
        runtime.metrics.observe_refused(ENDPOINT, exc)
        await _fail(websocket, exc, unread=True)
        return
    await _Connection(websocket, runtime, caller).serve()


def chosen_protocol(offered: Sequence[str]) -> str | None:
    """The subprotocol the handshake answers with. A browser fails a handshake that offered protocols and got none
    back, so one is chosen whenever any is offered: the first that is not a key, else the key's own value."""
    for value in offered:
        if not value.startswith(KEY_PROTOCOL):
            return value
    return offered[0] if offered else None


def caller_from(websocket: WebSocket, keyring: Keyring, offered: Sequence[str]) -> Caller:
    """Who is asking: a key in the headers (as on every HTTP surface), else ``?api_key=``, else the protocol
    ``bearer.<key>``. ``Unauthorized`` when keys are on and none of them holds a valid one."""
    if not keyring.enabled:
        return keyring.identify(None)
    headers = websocket.headers
    if "authorization" in headers or "x-api-key" in headers:
        return caller_of(websocket)
    presented = websocket.query_params.get(KEY_PARAMETER)
    if presented is None:
        presented = next((v.removeprefix(KEY_PROTOCOL) for v in offered if v.startswith(KEY_PROTOCOL)), None)
    if not presented:
        raise Unauthorized(
            f"an API key is required: a browser passes it as /chat?{KEY_PARAMETER}=<key> or as the WebSocket "
            f"protocol '{KEY_PROTOCOL}<key>'; other clients may send 'Authorization: Bearer <key>'",
            code="missing_api_key",
        )
    return keyring.identify(presented)


def check_origin(websocket: WebSocket, allowed: frozenset[str]) -> None:
    """A browser's page must come from the server's own host (any port or scheme) or from ``allowed``
    (``TTFT_CHAT_ORIGINS``; ``*`` is any). No ``Origin``: not a browser, nothing to check."""
    origin = websocket.headers.get("origin")
    if origin is None or "*" in allowed or origin.lower().rstrip("/") in allowed:
        return
    own = urlsplit("//" + websocket.headers.get("host", "")).hostname
    try:
        theirs = urlsplit(origin).hostname
    except ValueError:
        theirs = None
    if own is not None and theirs == own:
        return
    raise Forbidden(
        f"a page from {origin[:100]!r} may not open /chat: only the server's own pages and TTFT_CHAT_ORIGINS may",
        code="origin_not_allowed",
    )


async def _fail(websocket: WebSocket, exc: BaseException, *, unread: bool = False) -> None:
    """The ``[ERROR]`` frame, then the close; nothing where the connection is closed already.

    ``unread``: refused before any message was read. A client sends its prompt on open, and hypercorn closes the TCP
    connection as soon as its Close frame is out: a prompt left unread in the socket turns that close into a reset,
    and a client that had not yet read the ``[ERROR]`` frame can lose it (the ``websockets`` client drops the frames
    of a read whose close reply fails). So such a refusal first takes the client's first message, or its leaving,
    for up to :data:`UNREAD_GRACE_S`."""
    if websocket.application_state is not WebSocketState.CONNECTED:
        return
    await websocket.send_text(error_frame(exc))
    if unread:
        with anyio.move_on_after(UNREAD_GRACE_S):
            if (await websocket.receive())["type"] == "websocket.disconnect":
                return
    reason = (getattr(exc, "code", None) or getattr(exc, "error_type", None) or "server_error")[:100]
    await websocket.close(close_code(exc), reason)


class _Connection:
    """One accepted connection: prompts one after another, each answered through ``Generations``."""

    def __init__(self, websocket: WebSocket, runtime: Runtime, caller: Caller) -> None:
        self._ws = websocket
        self._runtime = runtime
        self._caller = caller

    async def serve(self) -> None:
        settings = self._runtime.settings
        first = True
        while True:
            # The first prompt is the request's body, due as a body is; later ones may wait as an idle connection.
            limit = settings.body_timeout_seconds if first else settings.keep_alive_seconds
            message = await self._next_message(limit, first=first)
            if message is None:
                return
            arrival = time.perf_counter()
            try:
                request = self._request(message)
                run = await self._runtime.generations.open(
                    request, caller=self._caller, arrival=arrival, endpoint=ENDPOINT
                )
            except ServiceError as exc:
                self._runtime.metrics.observe_refused(ENDPOINT, exc)  # counted once, whoever counts it first
                await _fail(self._ws, exc)
                return
            if not await self._answer(run):
                return
            first = False

    async def _next_message(self, limit: float, *, first: bool) -> Message | None:
        """The next frame's message, or None where the connection ended: the client left, it stayed silent past
        ``limit`` (the first prompt: an ``[ERROR]``; later: a plain close), or the server began to stop."""
        closing = self._runtime.lifecycle.closing
        if closing.is_set():
            await self._close_for_shutdown()
            return None
        receiving = asyncio.ensure_future(self._ws.receive())
        stopping = asyncio.ensure_future(closing.wait())
        try:
            await asyncio.wait({receiving, stopping}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not receiving.done():
                receiving.cancel()
                await asyncio.wait({receiving})  # until it has ended: cancelled, or with a frame after all
        if not receiving.cancelled():  # a frame that came as the wait ended is taken all the same
            message = receiving.result()
            return None if message["type"] == "websocket.disconnect" else message
        if closing.is_set():
            await self._close_for_shutdown()
        elif first:
            timeout = RequestTimeout(
                f"no prompt arrived within {limit:g} s of the connection; send one JSON object such as "
                '{"prompt": "Hello", "max_tokens": 32}',
                code="prompt_timeout",
            )
            self._runtime.metrics.observe_refused(ENDPOINT, timeout)
            await _fail(self._ws, timeout)
        else:
            await self._ws.close(NORMAL, f"idle for {limit:g} s")
        return None

    async def _close_for_shutdown(self) -> None:
        await self._ws.close(GOING_AWAY, "the server is shutting down")

    def _request(self, message: Message) -> GenerationRequest:
        """The frame's generation request, validated as ``POST /stream``'s body is."""
        text = message.get("text")
        if not isinstance(text, str):
            raise Binary(
                "frames must be text: send the prompt as one JSON text frame such as "
                '{"prompt": "Hello", "max_tokens": 32}',
                code="binary_frame",
            )
        settings = self._runtime.settings
        size = len(text.encode("utf-8"))
        if size > settings.max_body_bytes:
            raise PayloadTooLarge(f"the message is {size} bytes; the limit is {settings.max_body_bytes}")
        if not text.strip():
            raise InvalidRequest('the message is empty; send a JSON object such as {"prompt": "Hello"}')
        return GenerationRequest.from_json(json_input.parse(text), max_tokens_cap=settings.max_tokens_cap)

    async def _answer(self, run: Run) -> bool:
        """Send ``run``'s pieces and ``[DONE]``, while listening: the client leaving stops the generation, a frame
        meanwhile is refused. True once ``[DONE]`` has gone, and the connection can take the next prompt."""
        done = False
        heard: list[Message] = []
        async with anyio.create_task_group() as group:

            async def speak() -> None:
                nonlocal done
                try:
                    done = await self._speak(run)
                finally:
                    group.cancel_scope.cancel()

            async def listen() -> None:
                heard.append(await self._ws.receive())
                group.cancel_scope.cancel()  # the generation stops as ``speak``'s events are closed

            group.start_soon(speak)
            group.start_soon(listen)
        if not heard:
            return done
        if heard[0]["type"] == "websocket.disconnect":
            return False
        await _fail(
            self._ws,
            InvalidRequest(
                "a frame arrived while an answer was streaming; send the next prompt after [DONE]",
                code="prompt_while_answering",
            ),
        )
        return False

    async def _speak(self, run: Run) -> bool:
        try:
            async with aclosing(run.events()) as events:
                async for item in events:
                    if isinstance(item, Piece):
                        await self._ws.send_text(item.text)
                    elif isinstance(item, Finished):
                        await self._ws.send_text(DONE)
                        return True
        except Exception as exc:  # Run.events has counted and logged it; the client gets its sentence
            await _fail(self._ws, exc)
        return False
