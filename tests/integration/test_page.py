"""The chat page at ``GET /``, in a real browser: headless Chromium (Debian's) driven by Playwright.

With the real model: a question streams in (the text is seen growing while the answer is still streaming), the
TTFT figure shows, and Stop ends the generation on the server. With the scripted engine, where orderings must be
exact: the network is cut mid-answer (a TCP proxy the test controls drops every connection and refuses new ones),
the server makes the rest of the answer while the browser is away, the network comes back, and the page finishes
the answer on its own — EventSource reconnects with Last-Event-ID and gets exactly what it missed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from starlette.applications import Starlette
from structlog.testing import capture_logs

from tests.support.browser import chromium
from tests.support.servers import StreamReader, eventually, running
from tests.support.tcpproxy import tcp_proxy
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

WAIT_MS = 60_000
# The newest answer's text length and state, read in one go so that both belong to the same instant.
LATEST = """() => {
    const answer = [...document.querySelectorAll('.turn.assistant')].pop();
    return [answer.querySelector('.text').textContent.length, answer.dataset.state];
}"""
GREW = "n => [...document.querySelectorAll('.turn.assistant')].pop().querySelector('.text').textContent.length > n"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    opened = context.new_page()
    opened.set_default_timeout(WAIT_MS)
    try:
        yield opened
    finally:
        context.close()


@contextmanager
def fake_server(engine: FakeEngine, **settings: Any) -> Iterator[tuple[str, Starlette]]:
    app = create_app(Settings(warmup=False, log_format="console", **settings), engine)
    with running(app) as base:
        yield base, app


def ask(page: Page, question: str) -> str:
    """Type ``question`` and press Enter; returns the id of the stream the page created for the answer."""
    page.fill("#prompt", question)
    with page.expect_response(lambda r: r.url.endswith("/streams") and r.request.method == "POST") as created:
        page.press("#prompt", "Enter")
    assert created.value.status == 201, created.value.text()
    stream_id: str = created.value.json()["id"]
    return stream_id


def latest(page: Page) -> Locator:
    return page.locator(".turn.assistant").last


def expect_state(page: Page, state: str) -> None:
    from playwright.sync_api import expect

    expect(latest(page)).to_have_attribute("data-state", state, timeout=WAIT_MS)


def test_a_question_streams_in_shows_its_ttft_and_stop_ends_the_generation_on_the_server(
    hf_server: str, hf_app: Starlette, page: Page
) -> None:
    from playwright.sync_api import expect

    engine = hf_app.state.runtime.engine
    page.goto(f"{hf_server}/")
    expect(page.locator("#model")).to_have_text("SmolLM2-135M-Instruct · cpu · float32")
    # An answer that outlasts the test's clicks: greedy, the model writes this story to the 2048-token cap (~70 s
    # here). The question this test asked before was answered in 11 tokens, and once in CI it ended before Stop
    # could be clicked.
    page.fill("#max-tokens", "2048")
    with capture_logs() as logs:
        stream_id = ask(page, "Write a long story about a dragon who learns to bake bread.")
        seen: list[tuple[int, str]] = []
        for _ in range(4):
            page.wait_for_function(GREW, arg=seen[-1][0] if seen else 0)
            seen.append(tuple(page.evaluate(LATEST)))  # type: ignore[arg-type]
        # Four ever longer texts, each seen while the answer was still streaming: it arrived piece by piece.
        lengths = [length for length, _ in seen]
        assert lengths == sorted(set(lengths)) and lengths[0] > 0
        assert [state for _, state in seen] == ["streaming"] * 4
        ttft = latest(page).locator(".ttft").text_content() or ""
        assert re.fullmatch(r"TTFT [1-9]\d* ms", ttft), ttft
        assert re.fullmatch(r"\d+ tokens · \d+\.\d tok/s", latest(page).locator(".rate").text_content() or "")
        assert engine.active == 1

        page.click("#stop")
        expect_state(page, "stopped")
        eventually(lambda: engine.active == 0)
        eventually(lambda: hf_app.state.runtime.gate.running == 0)  # given back as the handler unwinds, just after
    generation = [e for e in logs if e["event"] == "generation"]
    assert [(e["endpoint"], e["outcome"]) for e in generation] == [("streams", "cancelled")]
    assert [e["stream_id"] for e in logs if e["event"] == "stream_deleted"] == [stream_id]
    gone = httpx.get(f"{hf_server}/streams/{stream_id}")
    assert gone.status_code == 410 and gone.json()["error"]["message"].endswith("it was deleted")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


def test_with_the_network_cut_and_restored_the_page_finishes_the_answer(page: Page) -> None:
    words = [f" word{i}" for i in range(30)]
    engine = FakeEngine(words, hold_after=8, context_length=4096)
    with capture_logs() as logs, fake_server(engine) as (base, app), tcp_proxy(int(base.rsplit(":", 1)[1])) as net:
        page.goto(f"{net.base}/")
        stream_id = ask(page, "Say thirty words.")
        answer = latest(page)
        page.wait_for_function(f"() => ({LATEST})()[0] == {len(''.join(words[:8]))}")
        ttft = answer.locator(".ttft").text_content()
        stream = app.state.runtime.streams.get(stream_id)

        net.cut()
        expect_state(page, "reconnecting")
        eventually(lambda: not stream.attached)  # the server saw the connection go
        engine.release.set()  # the rest of the answer is made while nobody is connected
        eventually(lambda: stream.ended)
        assert (answer.locator(".text").text_content(), answer.get_attribute("data-state")) == (
            "".join(words[:8]),
            "reconnecting",
        )

        net.restore()
        expect_state(page, "done")
        shown = answer.locator(".text").text_content()
    assert shown == "".join(words)  # no gap, no duplicate
    assert answer.locator(".ttft").text_content() == ttft  # the same answer, resumed, not a new one
    assert answer.locator(".rate").text_content().startswith("30 tokens · ")  # type: ignore[union-attr]
    attached = [(e["start"], e["replay"]) for e in logs if e["event"] == "stream_attached"]
    # One reconnect, from Last-Event-ID <id>.7: the 22 tokens and the done event it missed, nothing more.
    assert attached[0][0] == 0 and attached[1:] == [(8, 23)]
    assert engine.generated == [30]
    assert [e["outcome"] for e in logs if e["event"] == "generation"] == ["ok"]


def test_model_output_is_shown_as_text_and_the_conversation_is_sent_whole(page: Page) -> None:
    pieces = ["<b>bold</b>", ' <img src="x" onerror="window.pwned = 1">', " &amp; <script>window.pwned = 2</script>"]
    engine = FakeEngine(pieces, context_length=4096)
    with fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        ask(page, "First question?")
        expect_state(page, "done")
        first = latest(page)
        with page.expect_request(lambda r: r.url.endswith("/streams") and r.method == "POST") as second:
            ask(page, "And a second one?")
        expect_state(page, "done")
        assert first.locator(".text").text_content() == "".join(pieces)
        assert first.locator(".text *").count() == 0  # not one element made from model output
        assert page.evaluate("window.pwned") is None
        assert first.locator(".state").text_content() == "done"
    assert second.value.post_data_json == {
        "messages": [
            {"role": "user", "content": "First question?"},
            {"role": "assistant", "content": "".join(pieces)},
            {"role": "user", "content": "And a second one?"},
        ]
    }


def test_the_page_shows_queued_then_the_error_that_ended_the_answer(page: Page) -> None:
    engine = FakeEngine(["one", " two", " three"], hold_after=1, fail_after=2, context_length=4096)
    with fake_server(engine, max_concurrency=1) as (base, _app):
        holder = StreamReader(f"{base}/stream?prompt=hi")  # takes the only slot and holds it
        assert holder.next() is not None
        page.goto(f"{base}/")
        ask(page, "Anyone there?")
        expect_state(page, "queued")
        assert latest(page).locator(".state").text_content() == "queued: position 1"
        engine.release.set()
        expect_state(page, "error")
        answer = latest(page)
        assert answer.locator(".text").text_content() == "one two"
        assert answer.locator(".error").text_content() == "generation failed: scripted engine failure"
        holder.rest()


def test_with_api_keys_on_the_page_asks_for_a_key_and_sends_it(page: Page) -> None:
    from playwright.sync_api import expect

    engine = FakeEngine(["Hi", " there"], context_length=4096)
    with fake_server(engine, api_keys="sekrit-key-1") as (base, _app):
        page.goto(f"{base}/")
        expect(page.locator("#api-key")).to_be_hidden()
        page.fill("#prompt", "First?")
        with page.expect_response(lambda r: r.url.endswith("/streams")) as refused:
            page.press("#prompt", "Enter")
        assert refused.value.status == 401
        expect_state(page, "error")
        assert latest(page).locator(".error").text_content() == (
            "an API key is required: send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>': "
            "enter it below and ask again"
        )
        expect(page.locator("#api-key")).to_be_visible()
        page.fill("#api-key", "sekrit-key-1")
        with page.expect_request(lambda r: r.url.endswith("/streams") and r.method == "POST") as sent:
            ask(page, "Second?")
        expect_state(page, "done")
        assert latest(page).locator(".text").text_content() == "Hi there"
    assert sent.value.headers["authorization"] == "Bearer sekrit-key-1"
    # The refused question left the conversation; the stream itself was read without a key (EventSource sends
    # none): its unguessable url is the credential.
    assert sent.value.post_data_json == {"messages": [{"role": "user", "content": "Second?"}]}
    assert engine.generated == [2]


def test_the_page_is_served_from_the_package_with_a_strict_content_security_policy() -> None:
    with fake_server(FakeEngine()) as (base, _app):
        index = httpx.get(f"{base}/")
        assets = {path: httpx.get(f"{base}/static/{path}") for path in ("chat.js", "chat.css", "favicon.svg")}
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in index.headers["content-security-policy"]
    assert "default-src 'none'" in index.headers["content-security-policy"]
    assert all(r.status_code == 200 for r in assets.values())
    # Nothing remote: the page works offline (the SVG's xmlns is a name, not a fetch).
    for text in (index.text, assets["chat.js"].text, assets["chat.css"].text):
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text)
    assert "innerHTML" not in assets["chat.js"].text
