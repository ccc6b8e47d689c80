"""HTTP/1.x connection reuse: a response given before its request's body was read says ``Connection: close``.

A refusal often comes before the body is read (415, 413 from the declared length, 401, 408). The server cannot take
another request on that connection (the rest of the body is still on its way), so hypercorn closes it after the
response; a client that was not told so sends its next request down a closing connection and gets "server
disconnected without sending a response". RFC 9112 §9.6: a server that does not read a whole body closes the
connection and says so. HTTP/2 streams are independent and forbid the header: only HTTP/1.x gets it.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CloseWhenBodyUnread:
    """Pure ASGI middleware: adds ``Connection: close`` to a response that starts before the body has all come."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("http_version") not in ("1.0", "1.1") or not _has_body(scope):
            await self.app(scope, receive, send)
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
