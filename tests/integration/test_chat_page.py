"""``/chat`` from a page in headless Chromium, through the browser's own ``WebSocket``, as the seed design's reference
client speaks it: open ``/chat``, send one JSON frame, append every frame that is not ``[DONE]`` to the page.

The page comes from a static server of its own on loopback, as that client is hosted apart from this server (a
page that Playwright answers itself has no address, and Chromium's local network access checks then block its
WebSocket to loopback). What the page shows is what a user of that client sees: the answer, or the ``[ERROR]``
sentence.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.support.servers import fake_app, running
from ttft_sse.engine.fake import FakeEngine

if TYPE_CHECKING:
    from playwright.sync_api import Page

KEY = "browser-key-1234"
# The reference client's shape: every frame that is not [DONE] is appended to the page. ``ask`` takes the URL's query
# and the protocols ``new WebSocket`` is given, so that the tests can pass a key the ways a browser can.
SEED_CLIENT = """<!doctype html>
<html><body>
<div id="answer"></div>
<script>
function ask(prompt, maxTokens, query, protocols) {
  const answer = document.getElementById("answer");
  const server = new URLSearchParams(location.search).get("server");
  const socket = new WebSocket(`ws://${server}/chat${query}`, protocols);
  socket.onopen = () => socket.send(JSON.stringify({prompt: prompt, max_tokens: maxTokens}));
  socket.onmessage = (event) => {
    if (event.data === "[DONE]") { document.body.dataset.state = "done"; return; }
    answer.textContent += event.data;
  };
  socket.onclose = (event) => { document.body.dataset.closed = String(event.code); };
}
</script>
</body></html>"""


@pytest.fixture(scope="module")
def client_site() -> Iterator[str]:
    """The reference client's page, from a static server of its own on loopback (as that client is hosted apart
    from this server); its base URL. Chromium lets a loopback page open a loopback WebSocket."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = SEED_CLIENT.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=site.serve_forever, name="test-seed-client", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


def open_client(page: Page, site: str, base: str) -> None:
    """The client's page, pointed at the server of ``base`` (the seed's client reads its server from its URL)."""
    page.goto(f"{site}/?server={base.removeprefix('http://')}")


def ask(page: Page, prompt: str, max_tokens: int, *, query: str = "", protocols: Any = None) -> str:
    """Ask as the reference client does; the page's text once the answer is done (or the server has closed)."""
    args = json.dumps([prompt, max_tokens, query, protocols])
    page.evaluate("args => (args[3] === null ? ask(...args.slice(0, 3)) : ask(...args))", json.loads(args))
    page.wait_for_function("document.body.dataset.state === 'done' || document.body.dataset.closed !== undefined")
    return page.locator("#answer").text_content() or ""


def test_the_reference_client_shows_the_greedy_answer_that_complete_gives(
    hf_server: str, client_site: str, page: Page
) -> None:
    prompt, max_tokens = "Name three colours of the rainbow.", 20
    open_client(page, client_site, hf_server)
    shown = ask(page, prompt, max_tokens)
    assert page.evaluate("document.body.dataset.state") == "done"
    complete = httpx.post(f"{hf_server}/complete", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=120)
    assert shown == complete.json()["text"] != ""


def test_with_keys_the_page_shows_why_it_was_refused_and_a_key_it_can_pass_is_taken(
    client_site: str, page: Page
) -> None:
    with running(fake_app(FakeEngine(), api_keys=KEY)) as base:
        open_client(page, client_site, base)
        assert ask(page, "hi", 8) == (
            "[ERROR] an API key is required: a browser passes it as /chat?api_key=<key> or as the WebSocket protocol "
            "'bearer.<key>'; other clients may send 'Authorization: Bearer <key>'"
        )
        assert page.evaluate("document.body.dataset.closed") == "3000"

        for query, protocols in ((f"?api_key={KEY}", None), ("", [f"bearer.{KEY}"]), ("", ["chat", f"bearer.{KEY}"])):
            open_client(page, client_site, base)
            assert ask(page, "hi", 8, query=query, protocols=protocols) == "Hello, world!"
            assert page.evaluate("document.body.dataset.state") == "done"
