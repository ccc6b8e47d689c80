"""The chat page at ``GET /``, in a real browser: headless Chromium (Debian's) driven by Playwright.

With the real model: a question streams in (the text is seen growing while the answer is still streaming), the
TTFT figure shows, and Stop ends the generation on the server. With the scripted engine, where orderings must be
exact: the network is cut mid-answer (a TCP proxy the test controls drops every connection and refuses new ones),
the server makes the rest of the answer while the browser is away, the network comes back, and the page finishes
the answer on its own — EventSource reconnects with Last-Event-ID and gets exactly what it missed.

Answers are drawn as Markdown (markdown-it, then DOMPurify; ``static/vendor/``): every element Markdown makes shows
as its element, while a hostile answer (raw HTML, ``javascript:`` links) stays inert text. The conversation
survives a reload — an answer still streaming then resumes from its stream — until New chat clears it.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from starlette.applications import Starlette
from structlog.testing import capture_logs

from tests.support.browser import WAIT_MS
from tests.support.servers import StreamReader, eventually, running
from tests.support.tcpproxy import tcp_proxy
from ttft_sse.admission.grants import digest as stream_digest
from ttft_sse.api.page import STATIC
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

# The newest answer's text length and state, read in one go so that both belong to the same instant. The text is
# the rendered Markdown's (a paragraph drops the answer's leading space; block elements end with a newline).
LATEST = """() => {
    const answer = [...document.querySelectorAll('.turn.assistant')].pop();
    return [answer.querySelector('.text').textContent.trim().length, answer.dataset.state];
}"""
GREW = (
    "n => [...document.querySelectorAll('.turn.assistant')].pop().querySelector('.text').textContent.trim().length > n"
)
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


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


def shown(answer: Locator) -> str:
    """An answer's text as drawn (Markdown rendered), without the newlines around its blocks."""
    return (answer.locator(".text").text_content() or "").strip()


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
    assert [e["stream"] for e in logs if e["event"] == "stream_deleted"] == [stream_digest(stream_id)]
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
        page.wait_for_function(f"() => ({LATEST})()[0] == {len(''.join(words[:8]).strip())}")
        ttft = answer.locator(".ttft").text_content()
        stream = app.state.runtime.streams.get(stream_id)

        net.cut()
        expect_state(page, "reconnecting")
        eventually(lambda: not stream.attached)  # the server saw the connection go
        engine.release.set()  # the rest of the answer is made while nobody is connected
        eventually(lambda: stream.ended)
        assert (shown(answer), answer.get_attribute("data-state")) == ("".join(words[:8]).strip(), "reconnecting")

        net.restore()
        expect_state(page, "done")
        text = shown(answer)
    assert text == "".join(words).strip()  # no gap, no duplicate
    assert answer.locator(".ttft").text_content() == ttft  # the same answer, resumed, not a new one
    assert answer.locator(".rate").text_content().startswith("30 tokens · ")  # type: ignore[union-attr]
    attached = [(e["start"], e["replay"]) for e in logs if e["event"] == "stream_attached"]
    # One reconnect, from Last-Event-ID <id>.7: the 22 tokens and the done event it missed, nothing more.
    assert attached[0][0] == 0 and attached[1:] == [(8, 23)]
    assert engine.generated == [30]
    assert [e["outcome"] for e in logs if e["event"] == "generation"] == ["ok"]


# One scripted answer with every element the page draws; the engine holds after the code block's opening lines.
MARKDOWN = [
    "# Heading one\n\n",
    "## Heading two\n\n",
    "### Heading three\n\n",
    "Some **strong** and *emphasised* words, `inline code` and [a link](https://example.com/docs).\n\n",
    "- apples\n- pears\n\n",
    "1. first\n2. second\n\n",
    "```python\n",
    "print('<hi>')\n",
    "```\n",
]
CODE_OPENED = 8  # pieces of MARKDOWN up to the code block's unclosed fence and first line


def test_an_answer_is_drawn_as_markdown_as_it_streams_and_a_code_block_copies(page: Page) -> None:
    from playwright.sync_api import expect

    engine = FakeEngine(MARKDOWN, hold_after=CODE_OPENED, context_length=4096)
    with fake_server(engine) as (base, _app):
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
        page.goto(f"{base}/")
        ask(page, "Show me some Markdown.")
        text = latest(page).locator(".text")
        # Mid-answer the fence is still open: the code block is drawn already, as far as it goes.
        expect(text.locator("pre > code")).to_have_text("print('<hi>')\n")
        assert latest(page).get_attribute("data-state") == "streaming"
        engine.release.set()
        expect_state(page, "done")

        assert [text.locator(f"h{n}").text_content() for n in (1, 2, 3)] == [
            "Heading one",
            "Heading two",
            "Heading three",
        ]
        assert (text.locator("strong").text_content(), text.locator("em").text_content()) == ("strong", "emphasised")
        assert text.locator("p > code").text_content() == "inline code"
        link = text.locator("a")
        assert [link.text_content(), *(link.get_attribute(name) for name in ("href", "target", "rel"))] == [
            "a link",
            "https://example.com/docs",
            "_blank",  # a link never replaces the conversation
            "noopener noreferrer nofollow",
        ]
        assert text.locator("ul > li").all_text_contents() == ["apples", "pears"]
        assert text.locator("ol > li").all_text_contents() == ["first", "second"]
        block = text.locator(".codeblock")
        assert block.locator("pre > code").text_content() == "print('<hi>')\n"
        assert block.locator(".language").text_content() == "python"
        assert "monospace" in block.locator("pre > code").evaluate("e => getComputedStyle(e).fontFamily")
        assert text.locator("p > code").evaluate("e => getComputedStyle(e).fontFamily") == block.locator(
            "pre > code"
        ).evaluate("e => getComputedStyle(e).fontFamily")

        block.locator("button.copy").click()
        expect(block.locator("button.copy")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == "print('<hi>')\n"


# Each line tries a way for answer text to become markup, a script, a fetch or a javascript: link.
HOSTILE = [
    '<img src=x onerror="window.pwned = 1">\n',
    "[click](javascript:window.pwned=2) [shout](JAVASCRIPT:window.pwned=3) <javascript:window.pwned=4>\n",
    '<script>window.pwned = 5</script> <b>bold</b> <a href="javascript:window.pwned=6">raw link</a>\n',
    "[data](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==) ![pic](https://example.com/x.png)\n\n",
    '<iframe src="javascript:window.pwned=7"></iframe>\n\n',
    '```\n</code></pre><img src=x onerror="window.pwned = 8">\n```\n',
]


def test_a_hostile_answer_stays_inert_text_and_the_conversation_is_sent_whole(page: Page) -> None:
    engine = FakeEngine(HOSTILE, context_length=4096)
    question = '<b>First</b> **question**? <img src=x onerror="window.pwned = 9">'
    with fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        ask(page, question)
        expect_state(page, "done")
        first = latest(page)
        with page.expect_request(lambda r: r.url.endswith("/streams") and r.method == "POST") as second:
            ask(page, "And a second one?")
        expect_state(page, "done")
        text = first.locator(".text")
        assert page.locator("main img, main script, main iframe, main b, main [onerror]").count() == 0
        assert page.locator('main a[href^="javascript:" i], main a[href^="data:" i]').count() == 0
        # The one link left is the image's url, shown as a link the reader can see (no image is fetched).
        assert [a.get_attribute("href") for a in text.locator("a").all()] == ["https://example.com/x.png"]
        assert page.evaluate("window.pwned") is None
        drawn = shown(first)
        for literal in (
            '<img src=x onerror="window.pwned = 1">',
            "<script>window.pwned = 5</script> <b>bold</b>",
            '<iframe src="javascript:window.pwned=7"></iframe>',
            '</code></pre><img src=x onerror="window.pwned = 8">',
        ):
            assert literal in drawn
        # A question is never Markdown, let alone HTML: it shows exactly as typed.
        asked = page.locator(".turn.user").first.locator(".text")
        assert (asked.text_content(), asked.locator("*").count()) == (question, 0)
        assert first.locator(".state").text_content() == "done"
    assert second.value.post_data_json == {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "".join(HOSTILE)},
            {"role": "user", "content": "And a second one?"},
        ]
    }


def test_a_reload_keeps_the_conversation_and_new_chat_clears_it(page: Page) -> None:
    from playwright.sync_api import expect

    engine = FakeEngine(["Hello", " **there**"], context_length=4096)
    with fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        ask(page, "First?")
        expect_state(page, "done")
        before = [page.locator(".turn").all_inner_texts(), latest(page).locator(".ttft").text_content()]

        page.reload()
        expect(page.locator(".turn")).to_have_count(2)
        assert [page.locator(".turn").all_inner_texts(), latest(page).locator(".ttft").text_content()] == before
        assert latest(page).locator(".text strong").text_content() == "there"
        assert latest(page).get_attribute("data-state") == "done"
        with page.expect_request(lambda r: r.url.endswith("/streams") and r.method == "POST") as second:
            ask(page, "Second?")
        expect_state(page, "done")

        page.click("#new-chat")
        expect(page.locator(".turn")).to_have_count(0)
        expect(page.locator(".hint")).to_be_visible()
        page.reload()
        expect(page.locator(".hint")).to_be_visible()
        assert page.locator(".turn").count() == 0
        with page.expect_request(lambda r: r.url.endswith("/streams") and r.method == "POST") as fresh:
            ask(page, "Fresh?")
        expect_state(page, "done")
    assert second.value.post_data_json == {
        "messages": [
            {"role": "user", "content": "First?"},
            {"role": "assistant", "content": "Hello **there**"},
            {"role": "user", "content": "Second?"},
        ]
    }
    assert fresh.value.post_data_json == {"messages": [{"role": "user", "content": "Fresh?"}]}


def test_an_answer_streaming_when_the_page_reloads_resumes_from_its_stream(page: Page) -> None:
    words = [f" word{i}" for i in range(12)]
    engine = FakeEngine(words, hold_after=5, context_length=4096)
    with capture_logs() as logs, fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        stream_id = ask(page, "Twelve words?")
        page.wait_for_function(f"() => ({LATEST})()[0] == {len(''.join(words[:5]).strip())}")
        ttft = latest(page).locator(".ttft").text_content()

        page.reload()
        expect_state(page, "streaming")  # attached again: the server still has the stream
        assert shown(latest(page)) == "".join(words[:5]).strip()
        engine.release.set()  # the rest is made now, and reaches the reloaded page
        expect_state(page, "done")
        assert shown(latest(page)) == "".join(words).strip()
        assert latest(page).locator(".ttft").text_content() == ttft  # the same answer, resumed, not a new one
        assert latest(page).locator(".rate").text_content().startswith("12 tokens · ")  # type: ignore[union-attr]
    # The reloaded page resumed from <id>.4 (it had the first five tokens), and leaving the page stopped nothing.
    attached = [(e["stream"], e["start"]) for e in logs if e["event"] == "stream_attached"]
    assert attached == [(stream_digest(stream_id), 0), (stream_digest(stream_id), 5)]
    assert not [e for e in logs if e["event"] == "stream_deleted"]
    assert engine.generated == [12]
    assert [e["outcome"] for e in logs if e["event"] == "generation"] == ["ok"]


def test_an_answer_the_server_no_longer_has_ends_in_an_error_after_the_reload(page: Page) -> None:
    engine = FakeEngine(["Hold", " on", " there"], hold_after=2, context_length=4096)
    with fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        stream_id = ask(page, "Still there?")
        page.wait_for_function(f"() => ({LATEST})()[0] == {len('Hold on')}")
        page.goto("about:blank")
        assert httpx.delete(f"{base}/streams/{stream_id}").status_code == 204  # gone while the page was away
        page.goto(f"{base}/")
        expect_state(page, "error")
        answer = latest(page)
        assert shown(answer) == "Hold on"  # what had arrived stays, and stays in the conversation
        assert answer.locator(".error").text_content() == (
            "the connection was lost and the server no longer has this answer (it expired)"
        )
        assert page.locator("#send").is_enabled()


def test_temperature_max_tokens_and_the_system_prompt_are_sent_and_kept(page: Page) -> None:
    from playwright.sync_api import expect

    engine = FakeEngine(["One", " two", " three", " four"], context_length=4096)
    with fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        expect(page.locator("#model")).to_have_text("fake · cpu · none")
        expect(page.locator("#access")).to_have_text("open server · normal lane")
        expect(page.locator("#api-key")).to_be_hidden()
        expect(page.locator("#temperature")).to_have_value("0")  # greedy unless asked otherwise
        page.fill("#temperature", "0.7")
        page.fill("#max-tokens", "3")
        page.click("#system-summary")
        page.fill("#system-prompt", "Answer briefly.")
        expect(page.locator("#system-summary")).to_have_text("System prompt · set")
        # Shift+Enter starts a new line and sends nothing; Enter sends.
        page.fill("#prompt", "line one")
        page.press("#prompt", "Shift+Enter")
        page.keyboard.type("line two")
        assert page.input_value("#prompt") == "line one\nline two"
        assert page.locator(".turn").count() == 0
        with page.expect_request(lambda r: r.url.endswith("/streams") and r.method == "POST") as sent:
            page.press("#prompt", "Enter")
        expect_state(page, "done")
        assert latest(page).locator(".state").text_content() == "done: max tokens reached"

        page.reload()
        assert [page.input_value(f"#{field}") for field in ("temperature", "max-tokens", "system-prompt")] == [
            "0.7",
            "3",
            "Answer briefly.",
        ]
    assert sent.value.post_data_json == {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "line one\nline two"},
        ],
        "max_tokens": 3,
        "temperature": 0.7,
    }


def test_escape_stops_the_answer_on_the_server(page: Page) -> None:
    engine = FakeEngine(["Hold", " on", " there"], hold_after=1, context_length=4096)
    with fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        stream_id = ask(page, "Wait?")
        expect_state(page, "streaming")
        with page.expect_request(lambda r: r.method == "DELETE") as deleted:
            page.keyboard.press("Escape")
        expect_state(page, "stopped")
        assert deleted.value.url == f"{base}/streams/{stream_id}"
        eventually(lambda: engine.active == 0)
        assert engine.generated == [1]


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
        assert shown(answer) == "one two"
        assert answer.locator(".error").text_content() == "generation failed: scripted engine failure"
        holder.rest()


def test_the_page_shows_a_long_prompts_progress_until_the_first_token(page: Page) -> None:
    # 1,100 words a question (1,101 scripted tokens with the "user:" before it), 8 a step at 2 ms a token.
    question = " ".join(f"q{i}" for i in range(1100))
    engine = FakeEngine(["one", " two"], hold_after=1, prompt_delay=0.002, context_length=4096)
    with fake_server(engine) as (base, _app):
        page.goto(f"{base}/")
        ask(page, question)
        # The label while the state is "computing", read in the same instant as the state.
        computing = """() => {
            const answer = [...document.querySelectorAll('.turn.assistant')].pop();
            return answer.dataset.state === 'computing' && answer.querySelector('.state').textContent;
        }"""
        label = page.wait_for_function(computing).json_value()
        expect_state(page, "streaming")  # the first token, held there: the progress is gone
        after = latest(page).locator(".state").text_content()
        engine.release.set()
        expect_state(page, "done")
    shown_progress = re.fullmatch(r"computing the prompt: (\d{1,3}(?:,\d{3})*) / 1,101 tokens", label)
    assert shown_progress, label
    assert 0 <= int(shown_progress[1].replace(",", "")) <= 1101
    assert after == "streaming"


def test_with_api_keys_on_the_page_asks_for_a_key_and_sends_it(page: Page) -> None:
    from playwright.sync_api import expect

    engine = FakeEngine(["Hi", " there"], context_length=4096)
    with fake_server(engine, api_keys="sekrit-key-1:high") as (base, _app):
        page.goto(f"{base}/")
        # The page knows from the server that keys are on: the field shows before anything is refused.
        expect(page.locator("#api-key")).to_be_visible()
        expect(page.locator("#access")).to_have_text("API key required")
        page.fill("#prompt", "First?")
        with page.expect_response(lambda r: r.url.endswith("/streams")) as refused:
            page.press("#prompt", "Enter")
        assert refused.value.status == 401
        expect_state(page, "error")
        assert latest(page).locator(".error").text_content() == (
            "an API key is required: send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>': "
            "enter it below and ask again"
        )
        page.fill("#api-key", "not-the-key")
        expect(page.locator("#access")).to_have_text("API key entered")
        page.fill("#prompt", "Again?")
        with page.expect_response(lambda r: r.url.endswith("/streams")) as refused:
            page.press("#prompt", "Enter")
        assert refused.value.status == 401
        expect(page.locator("#access")).to_have_text("API key refused")
        page.fill("#api-key", "sekrit-key-1")
        with page.expect_request(lambda r: r.url.endswith("/streams") and r.method == "POST") as sent:
            ask(page, "Third?")
        expect_state(page, "done")
        expect(page.locator("#access")).to_have_text("API key accepted · high lane")
        assert shown(latest(page)) == "Hi there"
        assert page.locator(".turn.user.refused").count() == 2
    assert sent.value.headers["authorization"] == "Bearer sekrit-key-1"
    # The refused questions left the conversation; the stream itself was read without a key (EventSource sends
    # none): its url carries the stream's grant.
    assert sent.value.post_data_json == {"messages": [{"role": "user", "content": "Third?"}]}
    assert engine.generated == [2]


# Text against what is behind it, in both schemes: the answer, its meta line, a link, code, a question, Send.
READABLE = [
    ".turn.assistant .text p",
    ".turn.assistant .meta .rate",
    ".turn.assistant .text a",
    ".turn.assistant .text p > code",
    ".codeblock pre > code",
    ".turn.user .text",
    "header .model",
    "#send",
]
COLOURS = """selectors => selectors.map(selector => {
    const node = document.querySelector(selector);
    let behind = node;
    while (getComputedStyle(behind).backgroundColor === 'rgba(0, 0, 0, 0)' && behind.parentElement) {
        behind = behind.parentElement;
    }
    return [selector, getComputedStyle(node).color, getComputedStyle(behind).backgroundColor];
})"""


def _luminance(colour: str) -> float:
    """WCAG relative luminance of a computed ``rgb(r, g, b)`` colour."""
    channels = [int(c) / 255 for c in re.findall(r"\d+", colour)[:3]]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(foreground: str, background: str) -> float:
    light, dark = sorted((_luminance(foreground), _luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def test_light_and_dark_follow_the_system_and_both_stay_readable(browser: Browser, tmp_path: Path) -> None:
    engine = FakeEngine(MARKDOWN, context_length=4096)
    with fake_server(engine) as (base, _app):
        backgrounds = {}
        for scheme in ("light", "dark"):
            context = browser.new_context(color_scheme=scheme, viewport={"width": 1100, "height": 900})
            try:
                page = context.new_page()
                page.set_default_timeout(WAIT_MS)
                page.goto(f"{base}/")
                ask(page, "Show me some **Markdown**, please.")
                expect_state(page, "done")
                for selector, foreground, background in page.evaluate(COLOURS, READABLE):
                    assert _contrast(foreground, background) >= 4.5, (scheme, selector, foreground, background)
                backgrounds[scheme] = _luminance(page.evaluate("getComputedStyle(document.body).backgroundColor"))
                page.screenshot(path=tmp_path / f"page-{scheme}.png")
            finally:
                context.close()
    assert backgrounds["light"] > 0.8 and backgrounds["dark"] < 0.05


OWN_FILES = ("chat.js", "markdown.js", "prefill.js", "store.js", "chat.css", "favicon.svg")
VENDORED = ("markdown-it.min.js", "purify.min.js", "markdown-it.LICENSE", "dompurify.LICENSE", "README.md")


def test_the_page_is_served_from_the_package_with_a_strict_content_security_policy() -> None:
    with fake_server(FakeEngine()) as (base, _app):
        index = httpx.get(f"{base}/")
        assets = {path: httpx.get(f"{base}/static/{path}") for path in OWN_FILES}
        vendored = {path: httpx.get(f"{base}/static/vendor/{path}") for path in VENDORED}
    policy = index.headers["content-security-policy"]
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    # Trusted Types: no HTML string reaches the page except through DOMPurify's policy.
    assert "require-trusted-types-for 'script'" in policy and "trusted-types dompurify" in policy
    assert '<meta name="ttft-api-keys" content="open">' in index.text
    assert all(r.status_code == 200 for r in [*assets.values(), *vendored.values()])
    # Nothing remote: the page works offline (the SVG's xmlns is a name, not a fetch).
    for text in (index.text, *(r.text for path, r in assets.items() if path != "favicon.svg")):
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text)
    for path in ("chat.js", "markdown.js", "prefill.js", "store.js"):
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", assets[path].text)


def test_the_vendored_libraries_are_the_pinned_files_with_their_licences_and_ship_in_the_package() -> None:
    vendor = STATIC / "vendor"
    rows = re.findall(
        r"^\| `([^`]+)` \| .+? \| ([\d.]+) \| .+?`([\w.-]+\.LICENSE)` \| `([0-9a-f]{64})` \|$",
        (vendor / "README.md").read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    assert sorted(name for name, *_ in rows) == ["markdown-it.min.js", "purify.min.js"]
    for name, _version, licence, digest in rows:
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
        assert "Permission is hereby granted" in (vendor / licence).read_text(encoding="utf-8") or (
            "Apache License" in (vendor / licence).read_text(encoding="utf-8")
        )
    # Every file of the page is in the wheel: setuptools globs package-data one folder deep per pattern.
    patterns = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]["ttft_sse"]
    packaged = {path for pattern in patterns for path in STATIC.parent.glob(pattern) if path.is_file()}
    assert {path for path in STATIC.rglob("*") if path.is_file()} <= packaged


def test_the_page_prefills_the_conversation_while_the_user_types(page: Page) -> None:
    engine = FakeEngine(("Hi",))
    with fake_server(engine) as (base, _):
        page.goto(f"{base}/")

        def prefill(request: Any) -> bool:
            return bool(request.url.endswith("/prefill") and request.method == "POST")

        with page.expect_request(prefill) as typed:
            page.locator("#prompt").press_sequentially("Why is the sky", delay=20)
        request = typed.value
        assert request.post_data_json == {"messages": [{"role": "user", "content": "Why is the sky"}]}
        session = request.headers["x-prefill-session"]
        assert session
        assert request.response() is not None and request.response().status == 202
        # A pause after more typing sends the newer draft, from the same tab's session.
        with page.expect_request(prefill) as more:
            page.locator("#prompt").press_sequentially(" blue?", delay=20)
        assert more.value.post_data_json == {"messages": [{"role": "user", "content": "Why is the sky blue?"}]}
        assert more.value.headers["x-prefill-session"] == session
