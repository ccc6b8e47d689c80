"""The OpenAI surface, proven with the official ``openai`` client (sync and async) against a real server and model.

Every comparison is at temperature 0, where the model is deterministic: the same request gives the same tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.servers import running
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.engine.loading import sources
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

MODEL = sources.BUNDLED_NAME
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
STORY_TOKENS = 24  # far too few for a long story: every STORY request below ends on its limit
TIMINGS = {"queue_ms", "prefill_ms", "ttft_ms", "total_ms"}


@pytest.fixture(scope="module")
def client(hf_server: str) -> Iterator[openai.OpenAI]:
    # No retries: a refused request must surface at once, as the error it is.
    with openai.OpenAI(base_url=f"{hf_server}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def story(client: openai.OpenAI) -> Any:
    """The non-streamed greedy reply to STORY, which several tests compare against."""
    return client.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=STORY_TOKENS)


def test_chat_streamed_text_equals_non_streamed_text_and_usage_adds_up(client: openai.OpenAI, story: Any) -> None:
    [choice] = story.choices
    assert (story.object, story.model, choice.message.role) == ("chat.completion", MODEL, "assistant")
    assert choice.finish_reason == "length"
    assert story.usage.completion_tokens == STORY_TOKENS
    assert story.usage.prompt_tokens + story.usage.completion_tokens == story.usage.total_tokens
    assert set(story.to_dict()["timings"]) >= TIMINGS

    stream = client.chat.completions.create(
        model=MODEL,
        messages=STORY,
        temperature=0,
        max_tokens=STORY_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    *chunks, usage_chunk = list(stream)
    first, *middle, last = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    contents = [c.choices[0].delta.content for c in middle]
    assert all(contents), "no empty content deltas"
    assert "".join(contents) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert last.choices[0].delta.content is None
    assert set(last.to_dict()["timings"]) >= TIMINGS
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and story.usage is not None
    # The same prompt again: its whole blocks come from the prefix cache this time.
    assert usage_chunk.usage.model_copy(update={"prompt_tokens_details": None}) == story.usage.model_copy(
        update={"prompt_tokens_details": None}
    )
    details = usage_chunk.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == (story.usage.prompt_tokens - 1) // 4 * 4
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in [*chunks, usage_chunk]}) == 1


async def test_completions_streamed_text_equals_non_streamed_text_with_the_async_client(
    hf_server: str, settings: Settings
) -> None:
    prompt = "The three primary colors are"
    async with openai.AsyncOpenAI(base_url=f"{hf_server}/v1", api_key="x", max_retries=0, timeout=120) as client:
        whole = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
        stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True)
        chunks = [chunk async for chunk in stream]
    [choice] = whole.choices
    assert whole.object == "text_completion"
    texts = [c.choices[0].text for c in chunks]
    assert all(texts[:-1]) and texts[-1] == ""  # the finishing chunk carries no text
    assert "".join(texts) == choice.text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [choice.finish_reason]
    assert whole.usage is not None
    assert whole.usage.prompt_tokens + whole.usage.completion_tokens == whole.usage.total_tokens
    # The prompt went in as is: no chat template around it.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        sources.materialize(sources.resolve("bundled"), settings.cache_dir, StageClock())
    )
    assert whole.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])


def test_a_stop_sequence_ends_generation_and_is_not_returned(client: openai.OpenAI, story: Any) -> None:
    text = story.choices[0].message.content
    stop = text.split()[3]
    expected = text[: text.index(stop)]
    assert expected.strip()
    kwargs: dict[str, Any] = {"model": MODEL, "messages": STORY, "temperature": 0, "max_tokens": STORY_TOKENS}
    stopped = client.chat.completions.create(**kwargs, stop=[stop, "never seen"])
    assert stopped.choices[0].message.content == expected
    assert stop not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens < STORY_TOKENS
    chunks = list(client.chat.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_max_completion_tokens_limits_like_max_tokens(client: openai.OpenAI, story: Any) -> None:
    short = client.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_completion_tokens=5)
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 5
    assert story.choices[0].message.content.startswith(short.choices[0].message.content)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 2}, "n"),
        ({"n": 2, "stream": True}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"temperature": 5}, "temperature"),
    ],
)
def test_bad_chat_requests_raise_bad_request_naming_the_field(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    request: dict[str, Any] = {"model": MODEL, "messages": STORY, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert param.split("[")[0] in info.value.message
    assert info.value.type == "invalid_request_error"


def test_bad_completion_requests_raise_bad_request_naming_the_field(client: openai.OpenAI) -> None:
    for kwargs, param in (({"prompt": ["one", "two"]}, "prompt"), ({"prompt": "hi", "echo": True}, "echo")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, **kwargs)
        assert info.value.param == param
        assert param in info.value.message


def test_models_list_and_retrieve_the_loaded_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "ttft-sse")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_raw_stream_is_data_lines_ending_with_done(hf_server: str) -> None:
    body = {"model": MODEL, "messages": STORY, "temperature": 0, "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{hf_server}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "connection" not in r.headers
        raw = r.read().decode()
    assert "\r" not in raw
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") or e.startswith(":") for e in events)  # ":" would be a keep-alive ping
    data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("usage" not in c for c in chunks)  # not asked for
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes == [None] * (len(chunks) - 1) + ["length"]
    timings = chunks[-1]["timings"]
    assert set(timings) >= TIMINGS
    assert timings["ttft_ms"] <= timings["total_ms"]


def test_an_engine_failure_after_the_stream_started_is_one_error_chunk_then_done() -> None:
    engine = FakeEngine(fail_after=1)  # "Hello", then the worker thread raises
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with running(create_app(Settings(warmup=False), engine)) as base:
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        seen: list[str | None] = []
        with pytest.raises(openai.APIError, match="generation failed: scripted engine failure"):
            for chunk in client.chat.completions.create(model="m", messages=body["messages"], stream=True):
                seen.append(chunk.choices[0].delta.content)
        with pytest.raises(openai.InternalServerError):  # not streamed: the failure is the status
            client.chat.completions.create(model="m", messages=body["messages"])
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
    ]
    assert chunks[2:] == [
        {
            "error": {
                "message": "generation failed: scripted engine failure",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    ]
    assert data[-1] == "[DONE]"
    assert seen == ["", "Hello"]


def test_a_client_leaving_a_v1_stream_cancels_its_generation() -> None:
    engine = FakeEngine(["first", " second", " third"], hold_after=1)  # one piece, then it waits for release
    body = {"model": "m", "prompt": "hi", "stream": True}
    with running(create_app(Settings(warmup=False), engine)) as base:
        with httpx.Client(timeout=10) as http, http.stream("POST", f"{base}/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"] == "first"
            assert engine.active == 1
        # The connection is closed; the server notices, cancels, and the worker thread ends.
        deadline = time.monotonic() + 10
        while (engine.active or not engine.generated) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.active == 0
        assert engine.generated == [1]  # it never went past the piece it held on
        assert httpx.get(f"{base}/readyz").json()["running"] == 0  # and its slot is free again
