"""``GET /``: the browser chat page (``ttft_sse/static/``: plain HTML, CSS and JS, no build step, nothing remote).

Answers are drawn as Markdown by two libraries vendored beside the page (``static/vendor/``, pinned, with their
licences). The page learns from this handler whether the server wants API keys: a ``<meta>`` it fills in.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

from ttft_sse.api.body import runtime_of

STATIC = Path(__file__).resolve().parent.parent / "static"
KEYS_OPEN = '<meta name="ttft-api-keys" content="open">'
KEYS_REQUIRED = '<meta name="ttft-api-keys" content="required">'

# Everything the page uses comes from this server: no CDN, no inline script, nothing to inject into. Model output
# reaches the page only as text or as DOMPurify's sanitised DOM; this policy is the line of defence behind that:
# no script but the page's own files, nothing fetched from elsewhere, and (Trusted Types) no HTML string written
# into the page except through DOMPurify's policy.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; "
        "require-trusted-types-for 'script'; trusted-types dompurify"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def _index() -> str:
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    if html.count(KEYS_OPEN) != 1:
        raise RuntimeError(f"static/index.html must hold {KEYS_OPEN!r} exactly once: the page reads the key mode there")
    return html


async def page(request: Request) -> Response:
    html = _index()
    if runtime_of(request).keyring.enabled:
        html = html.replace(KEYS_OPEN, KEYS_REQUIRED)
    return HTMLResponse(html, headers=PAGE_HEADERS)


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC)
