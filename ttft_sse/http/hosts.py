"""The ``Host`` allow-list (``TTFT_ALLOWED_HOSTS``): which names this server answers to.

A page on another site can reach a server on its visitor's machine by DNS rebinding: its name is made to resolve to
127.0.0.1, and the browser, which sees one origin, lets the page read the answers and start generations. The
browser still sends the page's own name as ``Host``; a server that answers only its own names refuses it. So:

* ``TTFT_ALLOWED_HOSTS``: names, comma-separated (``*.example.com`` for a domain and its subdomains; IPv6 addresses
  in brackets; ``*`` for any). ``ttft-sse serve`` without it takes the loopback names (``localhost``,
  ``127.0.0.1``, ``[::1]``, and the address itself) when it listens on a loopback address, else any name: a server
  that listens on every interface is reached by names this process cannot know (a pod's IP, a load balancer's).
* The probes (``/healthz``, ``/readyz``, ``/metrics``) answer any ``Host`` that is an IP address, as Kubernetes'
  probes and Prometheus' scrapes send the pod's: rebinding always presents a name, never an address.
* Anything else gets a JSON 400 (``invalid_host``); a WebSocket, a close before it opens (1008).

The decision is Starlette's ``TrustedHostMiddleware`` (its patterns and its reading of the header); this module
gives it the settings' list, the probes' exception and the service's error shape.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from ttft_sse.log import PROBE_PATHS

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
INVALID_HOST = {
    "error": {
        "message": "this server does not answer to the name in the Host header (TTFT_ALLOWED_HOSTS)",
        "type": "invalid_request_error",
        "param": "Host",
        "code": "invalid_host",
    }
}


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` (an address, or ``localhost``) is listening on the loopback interface only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(host: str) -> str:
    """``TTFT_ALLOWED_HOSTS`` for a server listening on ``host`` that was given none (see the module's words)."""
    if not is_loopback(host):
        return "*"
    names = list(LOOPBACK_NAMES)
    own = f"[{host.strip('[]')}]" if ":" in host else host.lower()
    if own not in names:
        names.append(own)
    return ",".join(names)


def parse_hosts(spec: str) -> tuple[str, ...]:
    """``name,*.domain,[::1],…`` → the patterns, lower case. Raises ``ValueError`` with a sentence."""
    patterns = tuple(part.strip().lower() for part in spec.split(",") if part.strip())
    if not patterns:
        raise ValueError("TTFT_ALLOWED_HOSTS names no host; leave it unset for the default, or * for any")
    for pattern in patterns:
        if "*" in pattern[1:] or (pattern.startswith("*") and pattern != "*" and not pattern.startswith("*.")):
            raise ValueError(f"TTFT_ALLOWED_HOSTS: {pattern!r} is not a name, *.domain or *")
        if ":" in pattern and not pattern.startswith("["):
            raise ValueError(f"TTFT_ALLOWED_HOSTS: write an IPv6 address in brackets ([::1]), not {pattern!r}")
    return patterns


class HostCheck:
    """Pure ASGI middleware: the allow-list (``allowed``, patterns), with the probes' exception for addresses."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = tuple(allowed)
        self.any = "*" in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.any or scope["type"] not in ("http", "websocket") or self._probe_by_address(scope):
            await self.app(scope, receive, send)
            return
        admitted = False

        async def admit(scope: Scope, receive: Receive, _: Send) -> None:
            nonlocal admitted
            admitted = True
            await self.app(scope, receive, send)

        async def drop(_: object) -> None:  # Starlette's own refusal is plain text; ours is below
            return None

        await TrustedHostMiddleware(admit, allowed_hosts=self.allowed, www_redirect=False)(scope, receive, drop)
        if admitted:
            return
        if scope["type"] == "websocket":
            await WebSocketClose(code=1008)(scope, receive, send)
        else:
            await JSONResponse(INVALID_HOST, status_code=400)(scope, receive, send)

    def _probe_by_address(self, scope: Scope) -> bool:
        path: str = scope["path"]
        if path.removeprefix(scope.get("root_path", "")) not in PROBE_PATHS:
            return False
        host = Headers(scope=scope).get("host", "")
        name = host[1 : host.find("]")] if host.startswith("[") else host.rpartition(":")[0] or host
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True
