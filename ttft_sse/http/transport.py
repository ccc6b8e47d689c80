"""The HTTP transport's own limits, on hypercorn: the one module that reaches into hypercorn's internals.

Two things hypercorn (0.17, 0.18) has no setting for:

* **Releasing a closed connection.** When a client closes an idle keep-alive connection, hypercorn's reader sees the
  end of the stream and stops, but the connection's task group still waits for the keep-alive timer before the
  socket is closed: left alone, every connection a client closes stays in CLOSE-WAIT for ``TTFT_KEEP_ALIVE_SECONDS``
  (75 s), holding a file descriptor. Here the timer is stopped as soon as the reader stops.
* **A deadline for a request's head** (``TTFT_HEADER_TIMEOUT_SECONDS``, HTTP/1.1): from the first byte of a request
  until its blank line. A client that sends half a head and waits (slowloris) is closed then, not when the keep-alive
  timer ends. Do not "fix" this with hypercorn's ``read_timeout``: it bounds *every* read, those while the server
  writes a response too, and an SSE client sends nothing while it listens. Measured: ``read_timeout = 2`` ends a
  stream that pauses 4 s between tokens.

:func:`install` puts :func:`_read_data` in place of ``TCPServer._read_data`` (asyncio worker): hypercorn's loop, the
same reads and events, plus the two above. It checks that what it replaces is there and otherwise leaves hypercorn
as it is, with a warning (``transport_unpatched``): the server still works, with hypercorn's own behaviour.

A body's deadline is not kept here but by the app (``TTFT_BODY_TIMEOUT_SECONDS``, ``api/body.py``), which can
answer it with a JSON 408.
"""

from __future__ import annotations

import asyncio
from ssl import SSLError
from typing import Any

import h11
import structlog
from hypercorn.config import Config
from hypercorn.events import Closed, RawData

log = structlog.get_logger("ttft_sse.transport")


class ServerConfig(Config):
    """hypercorn's ``Config`` plus the request-head deadline that :func:`_read_data` keeps (None: none)."""

    header_timeout: float | None = None


def config(*, keep_alive_seconds: float, max_header_bytes: int, header_timeout_seconds: float | None) -> ServerConfig:
    """A hypercorn config with these transport limits (``TTFT_KEEP_ALIVE_SECONDS``, ``TTFT_MAX_HEADER_BYTES``,
    ``TTFT_HEADER_TIMEOUT_SECONDS``); installs :func:`_read_data` (once)."""
    install()
    server = ServerConfig()
    server.keep_alive_timeout = keep_alive_seconds
    server.h11_max_incomplete_size = max_header_bytes  # a head past it is a 431/400 and a closed connection
    server.header_timeout = header_timeout_seconds
    return server


def install() -> bool:
    """Replace ``TCPServer._read_data`` by :func:`_read_data`; True when in place (now or before)."""
    from hypercorn.asyncio import tcp_server

    server: Any = tcp_server.TCPServer
    if getattr(server, "_read_data", None) is _read_data:
        return True
    if not (hasattr(server, "_read_data") and hasattr(server, "_idle_timeout") and hasattr(tcp_server, "MAX_RECV")):
        log.warning("transport_unpatched", reason="hypercorn's TCPServer is not the one this module was written for")
        return False
    server._read_data = _read_data
    return True


async def _read_data(self: Any) -> None:
    """hypercorn's ``TCPServer._read_data`` (0.18), plus a request-head deadline and an at-once release."""
    from hypercorn.asyncio.tcp_server import MAX_RECV

    loop = asyncio.get_running_loop()
    head_timeout: float | None = getattr(self.config, "header_timeout", None)
    head_since: float | None = None  # when the first byte of a request's head came, while it is incomplete
    while not self.reader.at_eof():
        timeout = self.config.read_timeout
        if head_timeout is not None and head_since is not None:
            left = head_since + head_timeout - loop.time()
            timeout = left if timeout is None else min(timeout, left)
        try:
            data = await asyncio.wait_for(self.reader.read(MAX_RECV), timeout)
        except (ConnectionError, OSError, TimeoutError, SSLError):
            break
        await self.protocol.handle(RawData(data))
        if head_timeout is not None:
            if not _head_pending(self.protocol):
                head_since = None
            elif head_since is None:
                head_since = loop.time()
    await self.protocol.handle(Closed())
    # The addition: without it the connection's task group waits out the keep-alive timer (CLOSE-WAIT meanwhile).
    await self.idle_task.stop()


def _head_pending(wrapper: Any) -> bool:
    """True while an HTTP/1.1 connection holds part of a request's head: bytes came, the request has not begun."""
    connection = getattr(getattr(wrapper, "protocol", None), "connection", None)
    if not isinstance(connection, h11.Connection) or connection.their_state is not h11.IDLE:
        return False
    return bool(connection.trailing_data[0])
