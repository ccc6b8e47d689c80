"""``GET /``: the browser chat page (``ttft_sse/static/``: plain HTML, CSS and JS, no build step, nothing remote)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"

# Everything the page uses comes from this server: no CDN, no inline script, nothing to inject into. Model output
# is written with textContent; this policy is the second line of defence if that ever changes.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC)
