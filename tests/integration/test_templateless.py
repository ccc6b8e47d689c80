"""A model without a chat template, served for real by both engines: every endpoint counts the prompt the model's
tokenizer makes by default, its BOS included, and a chat request is served by the documented fallback (the
messages' contents one a line, roles dropped).

The model is tests/support/tinymodels.py's tiny random-weight Llama: its answers are noise, its prompt counts exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.paths import CACHE_DIR
from tests.support.servers import running, stream_events
from ttft_sse.app import create_app
from ttft_sse.settings import Settings

PROMPT = "what is the capital of france ?"
MESSAGES = [
    {"role": "system", "content": "answer short ."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi !"},
    {"role": "user", "content": "what is the capital of france ?"},
]
FALLBACK = "answer short .\nhello\nhi !\nwhat is the capital of france ?"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tiny_models: Callable[[str], Path]) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(model_dir))
    assert loaded.chat_template is None
    return loaded


@pytest.fixture(scope="module", params=["batched", "single"])
def server(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[str]:
    settings = Settings(
        model=str(model_dir),
        engine=request.param,
        threads=1,
        cache_dir=CACHE_DIR,
        prefill_process=False,
        log_format="console",
    )
    with running(create_app(settings)) as base:
        yield base


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as c:
        yield c


def tokens_of(tokenizer: Any, text: str) -> int:
    """How many tokens the tokenizer makes of ``text`` by default: its words and the BOS."""
    ids = tokenizer(text)["input_ids"]
    words = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [tokenizer.bos_token_id, *words]
    return len(ids)


def test_complete_counts_the_bos(server: str, client: httpx.Client, tokenizer: Any) -> None:
    response = client.post(f"{server}/complete", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == tokens_of(tokenizer, PROMPT)


def test_get_stream_counts_the_bos(server: str, client: httpx.Client, tokenizer: Any) -> None:
    events = stream_events(client, "GET", f"{server}/stream", params={"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    assert events[-1].event == "done"
    assert events[-1].data["usage"]["prompt_tokens"] == tokens_of(tokenizer, PROMPT)


def test_post_stream_serves_messages_by_the_fallback(server: str, client: httpx.Client, tokenizer: Any) -> None:
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS}
    events = stream_events(client, "POST", f"{server}/stream", json=body)
    assert events[-1].event == "done"
    assert events[-1].data["usage"]["prompt_tokens"] == tokens_of(tokenizer, FALLBACK)


def test_openai_completions_count_the_bos(server: str, client: httpx.Client, tokenizer: Any, model_dir: Path) -> None:
    body = {"model": model_dir.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = client.post(f"{server}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == tokens_of(tokenizer, PROMPT)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_chat_serves_messages_by_the_fallback(
    server: str, client: httpx.Client, tokenizer: Any, model_dir: Path, stream: bool
) -> None:
    body: dict[str, Any] = {"model": model_dir.name, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        events = stream_events(client, "POST", f"{server}/v1/chat/completions", json=body)
        assert events[-1].data == "[DONE]"
        usage = events[-2].data["usage"]
    else:
        response = client.post(f"{server}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
    assert usage["prompt_tokens"] == tokens_of(tokenizer, FALLBACK)
