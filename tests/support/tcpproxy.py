"""Test helper: a TCP proxy on loopback whose network the test can cut and restore.

``cut()`` closes every connection through it and stops listening, so clients see their connections drop and new
ones refused, exactly as when a network goes away; the server behind it sees its connections close. ``restore()``
listens again on the same port. Threads and sockets only; everything it starts, it stops.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.servers import free_port


class TCPProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    def restore(self) -> None:
        """Listen (again) on ``port``."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._spawn(self._accept, listener)

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`restore`."""
        listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _close(sock)

    def close(self) -> None:
        self.cut()
        for thread in self._threads:
            thread.join(10)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name="test-tcp-proxy", daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
            self._spawn(self._pipe, client, upstream)
            self._spawn(self._pipe, upstream, client)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.difference_update((source, sink))
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@contextmanager
def tcp_proxy(upstream_port: int) -> Iterator[TCPProxy]:
    proxy = TCPProxy(upstream_port)
    proxy.restore()
    try:
        yield proxy
    finally:
        proxy.close()
