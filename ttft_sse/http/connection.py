"""HTTP/1.x connections: ambiguous framing is refused, and a response given before its request's body was read says
``Connection: close``.

A request with both ``Content-Length`` and ``Transfer-Encoding`` (RFC 9112 §6.3) is framed one way by one parser and
another way by the next: it is how a request is smuggled past a proxy inside another's body. h11 lets
``Transfer-Encoding`` win and keeps the connection; here such a request gets a 400 (``ambiguous_framing``) with
``Connection: close`` before any route sees it, so the connection ends after that answer and nothing pipelined
behind it is read as a request.

A refusal often comes before the body is read (415, 413 from the declared length, 401, 408). The server cannot take
another request on that connection (the rest of the body is still on its way), so hypercorn closes it after the
response; a client that was not told so sends its next request down a closing connection and gets "server
disconnected without sending a response". RFC 9112 §9.6: a server that does not read a whole body closes the
connection and says so. HTTP/2 streams are independent and forbid the header: only HTTP/1.x gets it.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

AMBIGUOUS = {
    "error": {
        "message": "the request has both Content-Length and Transfer-Encoding, which frame its body two ways "
        "(RFC 9112 section 6.3); send one of them",
        "type": "invalid_request_error",
        "param": None,
        "code": "ambiguous_framing",
    }
}


class CloseWhenBodyUnread:
    """Pure ASGI middleware: refuses ambiguous framing (400, then the connection closes), and adds
    ``Connection: close`` to a response that starts before the body has all come."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("http_version") not in ("1.0", "1.1") or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        names = {name for name, _ in scope.get("headers", ())}
        if b"content-length" in names and b"transfer-encoding" in names:
            await JSONResponse(AMBIGUOUS, status_code=400, headers={"Connection": "close"})(scope, receive, send)
            return
        read = False

        async def receive_watched() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read = True
            return message

        async def send_watched(message: Message) -> None:
            if message["type"] == "http.response.start" and not read:
                MutableHeaders(scope=message)["connection"] = "close"
            await send(message)

        await self.app(scope, receive_watched, send_watched)


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False
