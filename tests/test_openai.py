"""The OpenAI surface with the scripted engine, in-process: request mapping, refusals, reply shapes and framing.

Nothing here watches time or a live stream (an in-process client buffers the whole body); the real-server tests are
in tests/integration/test_openai.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from tests.support.servers import parse_sse
from ttft_sse.api.openai_requests import DEFAULT_TEMPERATURE, parse_chat, parse_completion
from ttft_sse.app import create_app
from ttft_sse.engine.base import ChatMessage
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import Settings

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
HELLO = [{"role": "user", "content": "say hello"}]  # three words: three prompt "tokens" for the fake engine


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 10
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the fake engine did not become ready"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = Settings(max_tokens_cap=100, default_max_tokens=10, max_body_bytes=10_000)
    with TestClient(create_app(settings, FakeEngine(context_length=20)), raise_server_exceptions=False) as c:
        wait_ready(c)
        yield c


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def chunks_of(response: Any) -> list[Any]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "\r" not in response.text  # events are framed with "\n" as OpenAI frames them
    events = list(parse_sse(iter(response.text.split("\n"))))
    assert all(e.event == "message" and e.id is None for e in events)  # data: lines only
    return [e.data for e in events]


# -- mapping -----------------------------------------------------------------------------------------------------


def test_chat_body_maps_onto_a_generation_request_with_openai_defaults() -> None:
    parsed = parse_chat({"model": "gpt-4o", "messages": HELLO}, max_tokens_cap=100)
    assert parsed.generation == GenerationRequest(
        prompt=None, messages=(ChatMessage("user", "say hello"),), temperature=DEFAULT_TEMPERATURE
    )
    assert DEFAULT_TEMPERATURE == 1.0
    assert (parsed.stream, parsed.include_usage, parsed.user, parsed.ignored) == (False, False, None, ())


def test_honoured_fields_are_mapped_and_null_means_not_given() -> None:
    body = {
        "messages": HELLO,
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "x",
        "seed": 3,
        "user": "alice",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = parse_chat(body, max_tokens_cap=100)
    assert parsed.generation == GenerationRequest(
        prompt=None, messages=(ChatMessage("user", "say hello"),), max_tokens=7, top_p=0.5, stop=("x",), seed=3
    )
    assert (parsed.stream, parsed.include_usage, parsed.user) == (True, True, "alice")
    nulls = {"temperature": None, "top_p": None, "stop": None, "seed": None, "max_tokens": None, "n": None}
    assert parse_chat({"messages": HELLO, **nulls}, max_tokens_cap=100).generation == GenerationRequest(
        prompt=None, messages=(ChatMessage("user", "say hello"),), temperature=DEFAULT_TEMPERATURE
    )


def test_max_completion_tokens_is_max_tokens_under_its_newer_name() -> None:
    parsed = parse_chat({"messages": HELLO, "max_completion_tokens": 5}, max_tokens_cap=100)
    assert (parsed.generation.max_tokens, parsed.max_tokens_field) == (5, "max_completion_tokens")
    same = parse_chat({"messages": HELLO, "max_tokens": 5, "max_completion_tokens": 5}, max_tokens_cap=100)
    assert same.generation.max_tokens == 5


def test_completions_use_the_raw_prompt_and_accept_a_list_of_one() -> None:
    for prompt in ("Once upon a time", ["Once upon a time"]):
        parsed = parse_completion({"model": "m", "prompt": prompt}, max_tokens_cap=100)
        assert parsed.generation == GenerationRequest(
            prompt="Once upon a time", messages=None, raw=True, temperature=DEFAULT_TEMPERATURE
        )


def test_text_content_parts_are_joined_developer_is_system_and_empty_fields_are_dropped() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        # An earlier reply sent back as the SDK's model dumps it.
        {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": [], "function_call": None},
        {"role": "user", "content": "Again", "name": "bob"},
    ]
    assert parse_chat({"messages": messages}, max_tokens_cap=100).generation.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi\nthere"),
        ChatMessage("assistant", "Hello"),
        ChatMessage("user", "Again"),
    )


@pytest.mark.parametrize(
    "neutral",
    [
        {"n": 1},
        {"logprobs": False},
        {"top_logprobs": 0},
        {"presence_penalty": 0},
        {"frequency_penalty": 0.0},
        {"logit_bias": {}},
        {"tools": []},
        {"tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"modalities": ["text"]},
        {"best_of": 1, "echo": False, "suffix": ""},
        {"top_k": -1, "repetition_penalty": 1.0},
        {"stream": True, "stream_options": {"include_usage": False, "include_obfuscation": False}},
    ],
)
def test_neutral_values_of_unsupported_features_are_accepted(neutral: dict[str, Any]) -> None:
    parsed = parse_completion({"prompt": "hi", **neutral}, max_tokens_cap=100)
    assert parsed.generation.prompt == "hi" and parsed.ignored == ()


def test_a_tool_message_with_its_tool_call_id_is_taken_as_openai_clients_send_it(client: TestClient) -> None:
    """The probe's: the tool_call_id of a tool message was an unknown field (400)."""
    messages = [*HELLO, {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": None}]
    parsed = parse_chat({"messages": messages}, max_tokens_cap=100)
    assert parsed.generation.messages == (ChatMessage("user", "say hello"), ChatMessage("tool", "42", "call_1"))
    assert client.post(CHAT, json={"model": "m", "messages": messages}).status_code == 200


def test_a_completion_parses_special_strings_unless_told_not_to() -> None:
    assert parse_completion({"prompt": "hi"}, max_tokens_cap=100).generation.parse_special is True
    told = parse_completion({"prompt": "hi", "parse_special": False}, max_tokens_cap=100)
    assert (told.generation.raw, told.generation.parse_special, told.ignored) == (True, False, ())


def test_the_line_that_reports_ignored_fields_is_bounded_however_many_and_long_they_are() -> None:
    """The probe's: 2,000 unknown fields of 200-character names wrote one 415,050-character warning."""
    names = [f"{i:04d}" + "f" * 196 for i in range(2000)]
    app = create_app(Settings(max_tokens_cap=100, default_max_tokens=10), FakeEngine(context_length=20))
    with TestClient(app) as c, capture_logs() as logs:
        wait_ready(c)
        reply = c.post(CHAT, json={"model": "m", "messages": HELLO, **dict.fromkeys(names, 1)})
    assert reply.status_code == 200
    (line,) = [e for e in logs if e["event"] == "openai_fields_ignored"]
    assert line["count"] == 2000
    assert line["fields"].endswith(" and 1995 more") and line["fields"].startswith("0000ffff")
    assert len(repr(line)) < 500


def test_unknown_fields_are_ignored_and_reported_inert_ones_silently() -> None:
    body = {"messages": HELLO, "store": False, "metadata": {"a": "b"}, "service_tier": "auto", "frobnicate": 1}
    assert parse_chat(body, max_tokens_cap=100).ignored == ("frobnicate",)


# -- refusals ----------------------------------------------------------------------------------------------------

UNSUPPORTED = "unsupported_parameter"


@pytest.mark.parametrize(
    ("body", "param", "message", "code"),
    [
        ({"n": 2}, "n", "n is not supported by this server: one choice is generated per request", UNSUPPORTED),
        # The probe's: a value of the wrong type is named as such, not as a feature this server lacks.
        ({"n": True}, "n", "n must be a number, not a boolean", None),
        ({"n": "1"}, "n", "n must be a number, not a string", None),
        ({"logprobs": "false"}, "logprobs", "logprobs must be a boolean, not a string", None),
        ({"tools": {}}, "tools", "tools must be an array, not an object", None),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "without tool calling", UNSUPPORTED),
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice is not supported", UNSUPPORTED),
        ({"functions": [{"name": "f"}]}, "functions", "functions is not supported", UNSUPPORTED),
        ({"logprobs": True}, "logprobs", "log probabilities are not returned", UNSUPPORTED),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs is not supported", UNSUPPORTED),
        ({"response_format": {"type": "json_object"}}, "response_format", "no JSON mode", UNSUPPORTED),
        ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty is not supported", UNSUPPORTED),
        ({"logit_bias": {"42": 10}}, "logit_bias", "logit_bias is not supported", UNSUPPORTED),
        ({"top_k": 40}, "top_k", "top_k is not supported", UNSUPPORTED),
        ({"reasoning_effort": "high"}, "reasoning_effort", "reasoning_effort is not supported", UNSUPPORTED),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true", None),
        (
            {"stream": True, "stream_options": {"x": 1}},
            "stream_options.x",
            "stream_options.x is not supported",
            UNSUPPORTED,
        ),
        ({"stream": "yes"}, "stream", "stream must be true or false", None),
        ({"model": 4}, "model", "model must be a string", None),
        ({"user": 4}, "user", "user must be a string", None),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be between 1 and 100, got 0", None),
        (
            {"max_completion_tokens": 0},
            "max_completion_tokens",
            "max_completion_tokens must be between 1 and 100",
            None,
        ),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "disagree", None),
        ({"temperature": 2.5}, "temperature", "temperature must be between 0 and 2", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop takes at most 4 sequences", None),
    ],
)
@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_unsupported_or_bad_fields_get_400_naming_the_field(
    client: TestClient, path: str, body: dict[str, Any], param: str, message: str, code: str | None
) -> None:
    base: dict[str, Any] = {"model": "m", "messages": HELLO} if path == CHAT else {"model": "m", "prompt": "hi"}
    error = error_of(client.post(path, json={**base, **body}), 400)
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", code)
    assert message in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "messages", "messages is required"),
        ({"messages": []}, "messages", "messages is empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", 'got "wizard"'),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "must be a string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
            'only text content parts are supported, got type "image_url"',
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            'messages[0].content[0] is a text part and has no text field: a text part is {"type": "text", "text": '
            "<string>}",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
            "messages[0].content[0] is a text part and has text a number",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]},
            "messages[0].tool_call_id",
            "messages[0].tool_call_id belongs to a tool message, not a user one",
        ),
        ({"messages": HELLO, "parse_special": True}, "parse_special", "parse_special applies to raw prompts only"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls",
            "tool calls are not supported",
        ),
        (
            {"messages": HELLO, "prompt": "hi"},
            "prompt",
            "prompt belongs to /v1/completions; this endpoint takes messages",
        ),
    ],
)
def test_bad_chat_messages_get_400(client: TestClient, body: dict[str, Any], param: str, message: str) -> None:
    error = error_of(client.post(CHAT, json={"model": "m", **body}), 400)
    assert error["param"] == param
    assert message in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "prompt", "prompt is required"),
        ({"prompt": ""}, "prompt", "prompt is empty"),
        ({"prompt": []}, "prompt", "prompt is empty"),
        ({"prompt": ["a", "b"]}, "prompt", "prompt is a list of 2 prompts; this server completes one prompt"),
        ({"prompt": [1, 2, 3]}, "prompt", "prompt as token ids is not supported"),
        ({"prompt": [[1, 2], [3]]}, "prompt", "prompt as token ids is not supported"),
        ({"prompt": {"text": "hi"}}, "prompt", "prompt must be a string, not an object"),
        ({"prompt": "hi", "messages": HELLO}, "messages", "messages belongs to /v1/chat/completions"),
        ({"prompt": "hi", "best_of": 3}, "best_of", "best_of is not supported"),
        ({"prompt": "hi", "echo": True}, "echo", "does not repeat the prompt"),
        ({"prompt": "hi", "suffix": "end"}, "suffix", "no fill-in-the-middle"),
        ({"prompt": " ".join(["w"] * 25)}, "prompt", "the prompt is 25 tokens; the model's context is 20"),
    ],
)
def test_bad_completion_prompts_get_400(client: TestClient, body: dict[str, Any], param: str, message: str) -> None:
    error = error_of(client.post(TEXT, json={"model": "m", **body}), 400)
    assert error["param"] == param
    assert message in error["message"]


def test_a_max_tokens_that_does_not_fit_names_the_field_the_client_used(client: TestClient) -> None:
    prompt = " ".join(["w"] * 15)
    for field in ("max_tokens", "max_completion_tokens"):
        error = error_of(client.post(TEXT, json={"prompt": prompt, field: 10}), 400)
        assert (error["param"], error["code"]) == (field, "context_length_exceeded")
        assert f"lower {field} to 5" in error["message"]


def test_body_errors_come_through_the_same_exception_tree(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    assert "not valid JSON" in error_of(client.post(CHAT, content=b"{nope", headers=headers), 400)["message"]
    assert error_of(client.post(CHAT, content=b"[1]", headers=headers), 400)["message"] == (
        "the request body must be a JSON object"
    )
    assert error_of(client.post(CHAT, json={"messages": HELLO, "x": "y" * 20_000}), 413)["type"] == (
        "invalid_request_error"
    )
    assert error_of(client.get(CHAT), 405)["message"] == f"method GET is not allowed on {CHAT}"


# -- replies -----------------------------------------------------------------------------------------------------


def test_chat_reply_has_openais_shape_usage_and_our_timings(client: TestClient) -> None:
    # A salt of its own: the module's client has answered HELLO before, and its cache would give cached tokens.
    body = {"model": "whatever", "messages": HELLO, "cache_salt": "shape"}
    response = client.post(CHAT, json=body, headers={"x-request-id": "r-1"})
    assert response.status_code == 200
    body = response.json()
    timings = body.pop("timings")
    assert {"queue_ms", "prefill_ms", "ttft_ms", "total_ms"} <= set(timings)
    assert body.pop("degraded") is False  # beside our timings: made in the engine's normal mode
    assert isinstance(body.pop("created"), int)
    assert body == {
        "id": "chatcmpl-r-1",
        "object": "chat.completion",
        "model": "fake",  # the served model, whatever the request named
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello, world!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert response.headers["server-timing"].startswith("queue;dur=")


def test_completion_reply_with_stop_and_length(client: TestClient) -> None:
    stopped = client.post(TEXT, json={"prompt": "hi", "stop": [" wor"]}).json()
    assert stopped["object"] == "text_completion"
    assert stopped["choices"] == [{"index": 0, "text": "Hello,", "logprobs": None, "finish_reason": "stop"}]
    cut = client.post(TEXT, json={"prompt": "hi", "max_tokens": 2, "cache_salt": "cut"}).json()
    assert (cut["choices"][0]["text"], cut["choices"][0]["finish_reason"]) == ("Hello,", "length")
    assert cut["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_stream_framing(client: TestClient) -> None:
    response = client.post(CHAT, json={"messages": HELLO, "stream": True}, headers={"x-request-id": "r-2"})
    chunks = chunks_of(response)
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {("chatcmpl-r-2", "chat.completion.chunk", "fake")}
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
        {"content": ","},
        {"content": " world"},
        {"content": "!"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["stop"]
    assert [sorted(set(c) - {"id", "object", "created", "model", "choices"}) for c in chunks] == [[]] * 5 + [
        ["degraded", "timings"]
    ]
    assert chunks[-1]["degraded"] is False
    assert {"queue_ms", "prefill_ms", "ttft_ms", "total_ms"} <= set(chunks[-1]["timings"])


def test_stream_usage_chunk_only_when_asked(client: TestClient) -> None:
    body = {"prompt": "hi there", "stream": True, "stream_options": {"include_usage": True}}
    chunks = chunks_of(client.post(TEXT, json=body))
    assert chunks[-1] == "[DONE]"
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == []
    usage = dict(usage_chunk["usage"])
    # The scripted engine's cache may hold this prompt from an earlier test's request: at most all but its last token.
    assert usage.pop("prompt_tokens_details")["cached_tokens"] in (0, 1)
    assert usage == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert [c["choices"][0]["text"] for c in chunks[:-2]] == ["Hello", ",", " world", "!", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]] == [None] * 4 + ["stop"]
    assert all(c["usage"] is None for c in chunks[:-2])  # as OpenAI: null on every other chunk
    without = chunks_of(client.post(TEXT, json={"prompt": "hi there", "stream": True}))
    assert without[-1] == "[DONE]" and all("usage" not in c for c in without[:-1])


def test_user_is_logged_with_the_generation_but_never_echoed(client: TestClient) -> None:
    with capture_logs(processors=[merge_contextvars]) as logs:
        response = client.post(CHAT, json={"messages": HELLO, "user": "alice-42"})
    assert "alice-42" not in response.text
    [generation] = [e for e in logs if e["event"] == "generation"]
    assert (generation["user"], generation["endpoint"]) == ("alice-42", "chat_completions")


# -- models and readiness ----------------------------------------------------------------------------------------


def test_models_lists_and_retrieves_the_served_model(client: TestClient) -> None:
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == ("fake", "model", "ttft-sse", 20)
    assert isinstance(card["created"], int)
    assert client.get("/v1/models/fake").json()["id"] == "fake"
    error = error_of(client.get("/v1/models/org/other"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error["message"] == "model 'org/other' is not served here; this server serves 'fake'"


def test_everything_is_503_in_the_error_shape_until_the_model_is_ready() -> None:
    engine = FakeEngine(hold_load=True)  # loading until the test says
    with TestClient(create_app(Settings(), engine)) as c:
        for response in (
            c.post(CHAT, json={"messages": HELLO}),
            c.post(TEXT, json={"prompt": "hi"}),
            c.get("/v1/models"),
        ):
            error = error_of(response, 503)
            assert "still loading" in error["message"]
            assert error["type"] == "unavailable_error"
            assert response.headers["retry-after"] == "5"
        engine.loaded.set()
