"""Every bad input gets a 4xx JSON error that names the problem. In-process (no streaming is observed here)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from tests.support.servers import eventually
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = Settings(max_tokens_cap=100, default_max_tokens=10, max_body_bytes=10_000)
    with TestClient(create_app(settings, FakeEngine(context_length=20)), raise_server_exceptions=False) as c:
        yield c


def error_of(response: object, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    body = response.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text  # type: ignore[attr-defined]
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "prompt", "prompt or messages is required"),
        ({"prompt": ""}, "prompt", "prompt is empty"),
        ({"prompt": "   "}, "prompt", "prompt is empty"),
        ({"prompt": 5}, "prompt", "prompt must be a string, not a number"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages", "not both"),
        ({"messages": []}, "messages", "messages is empty"),
        ({"messages": "hi"}, "messages", "messages must be a list"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", 'got "wizard"'),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "must be a string"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra", "unknown field"),
        ({"messages": ["hi"]}, "messages[0]", "must be an object"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "between 1 and 100, got 0"),
        ({"prompt": "hi", "max_tokens": 101}, "max_tokens", "between 1 and 100, got 101"),
        ({"prompt": "hi", "max_tokens": "10"}, "max_tokens", "must be an integer, not a string"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens", "must be an integer"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens", "must be an integer, not a boolean"),
        ({"prompt": "hi", "temperature": 3}, "temperature", "between 0 and 2"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature", "must be a number"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "more than 0"),
        ({"prompt": "hi", "stop": 5}, "stop", "string or a list of strings"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"prompt": "hi", "stop": [""]}, "stop", "must not be empty"),
        ({"prompt": "hi", "seed": -1}, "seed", "between 0"),
        ({"prompt": "hi", "raw": "yes"}, "raw", "true or false"),
        ({"messages": [{"role": "user", "content": "x"}], "raw": True}, "raw", "prompt only"),
        ({"prompt": "hi", "max_token": 5}, "max_token", "unknown field(s): max_token"),
        ({"prompt": " ".join(["w"] * 25)}, "prompt", "the prompt is 25 tokens; the model's context is 20"),
        ({"prompt": " ".join(["w"] * 15), "max_tokens": 10}, "max_tokens", "lower max_tokens to 5"),
    ],
)
@pytest.mark.parametrize("path", ["/stream", "/complete"])
def test_bad_json_fields_get_400_naming_the_field(
    client: TestClient, path: str, body: dict[str, object], param: str, message: str
) -> None:
    error = error_of(client.post(path, json=body), 400)
    assert error["param"] == param
    assert message in str(error["message"])
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("query", "param", "message"),
    [
        ("", "prompt", "prompt or messages is required"),
        ("prompt=hi&max_tokens=ten", "max_tokens", "max_tokens must be an integer, got 'ten'"),
        ("prompt=hi&temperature=warm", "temperature", "must be a number"),
        ("prompt=hi&raw=perhaps", "raw", "true or false"),
        ("prompt=hi&prompt=ho", "prompt", "more than once"),
        ("messages=not-json", "messages", "JSON array"),
        ("prompt=hi&colour=red", "colour", "unknown query parameter(s): colour"),
        # The probe's: invalid UTF-8 was replaced silently (a JSON body with it gets 400).
        ("prompt=hi%FF%FEthere", None, "the query string is not valid UTF-8"),
        ("prompt=%ED%A0%80", None, "the query string is not valid UTF-8"),  # a lone surrogate, as UTF-8 bytes
        ("prompt=hi&parse_special=true", "parse_special", "parse_special applies to raw prompts only"),
        ("prompt=hi&raw=1&parse_special=maybe", "parse_special", "true or false"),
    ],
)
def test_bad_query_strings_get_400(client: TestClient, query: str, param: str, message: str) -> None:
    error = error_of(client.get(f"/stream?{query}"), 400)
    assert error["param"] == param
    assert message in str(error["message"])


def test_malformed_json_empty_body_and_non_object(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    assert "not valid JSON" in str(
        error_of(client.post("/complete", content=b"{nope", headers=headers), 400)["message"]
    )
    assert "body is empty" in str(error_of(client.post("/complete", content=b"", headers=headers), 400)["message"])
    msg = error_of(client.post("/complete", content=b"[1,2]", headers=headers), 400)["message"]
    assert msg == "the request body must be a JSON object, not an array"
    bad_utf8 = error_of(client.post("/complete", content=b'{"prompt": "\xff"}', headers=headers), 400)
    assert "not valid JSON" in str(bad_utf8["message"])


def test_oversized_body_is_413(client: TestClient) -> None:
    error = error_of(client.post("/complete", json={"prompt": "x" * 20_000}), 413)
    assert error["message"] == "the request body is 20013 bytes; the limit is 10000"


def test_wrong_content_type_is_415_and_a_json_body_under_curls_form_type_too(client: TestClient) -> None:
    error = error_of(client.post("/complete", content=b"<xml/>", headers={"content-type": "application/xml"}), 415)
    assert "application/json" in str(error["message"])
    form = {"content-type": "application/x-www-form-urlencoded"}  # what curl -d sends, and a cross-site form
    refused = client.post("/complete", content=json.dumps({"prompt": "hi"}), headers=form)
    assert error_of(refused, 415)["param"] == "Content-Type"


def test_unknown_route_and_method_are_json(client: TestClient) -> None:
    assert error_of(client.get("/nope"), 404)["message"] == "no route for GET /nope"
    assert error_of(client.get("/complete"), 405)["message"] == "method GET is not allowed on /complete"


def test_complete_returns_text_usage_timings_and_server_timing(client: TestClient) -> None:
    response = client.post("/complete", json={"prompt": "say hello"})
    assert response.status_code == 200
    body = response.json()
    assert body["text"] == "Hello, world!"
    assert body["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6, "cached_tokens": 0}
    assert {"queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "total_ms"} <= set(body["timings"])
    assert response.headers["server-timing"].startswith("queue;dur=")
    assert response.headers["x-request-id"]


def test_stop_and_max_tokens_through_the_fake(client: TestClient) -> None:
    assert client.post("/complete", json={"prompt": "x", "stop": " wor"}).json()["text"] == "Hello,"
    body = client.post("/complete", json={"prompt": "x", "max_tokens": 2}).json()
    assert (body["text"], body["finish_reason"], body["usage"]["completion_tokens"]) == ("Hello,", "length", 2)


def test_generation_is_503_with_retry_after_until_the_model_is_ready() -> None:
    engine = FakeEngine(hold_load=True)  # loading until the test says
    with TestClient(create_app(Settings(), engine)) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["status"] == "starting"
        assert c.get("/healthz").json() == {"status": "ok", "state": "starting"}
        response = c.post("/complete", json={"prompt": "hi"})
        error = error_of(response, 503)
        assert "still loading" in str(error["message"])
        assert response.headers["retry-after"] == "5"
        engine.loaded.set()
        eventually(lambda: c.get("/readyz").status_code == 200)
        assert c.get("/readyz").json()["weights_by_type"] == {}  # no GGUF on the block kernel
        assert c.post("/complete", json={"prompt": "hi"}).status_code == 200


def test_a_prompt_over_the_servers_cap_is_a_400_naming_it() -> None:
    """TTFT_MAX_PROMPT_TOKENS bounds one request's prompt below the model's context, on every surface."""
    app = create_app(Settings(warmup=False, max_prompt_tokens=4), FakeEngine(context_length=100))
    with TestClient(app, raise_server_exceptions=False) as c:
        eventually(lambda: c.get("/readyz").status_code == 200)
        ok = c.post("/complete", json={"prompt": "one two three four"})
        assert ok.status_code == 200, ok.text
        error = error_of(c.post("/complete", json={"prompt": "one two three four five"}), 400)
        assert (error["param"], error["code"]) == ("prompt", "prompt_too_long")
        assert "the prompt is 5 tokens; this server takes at most 4 prompt tokens a request" in str(error["message"])
        chat = {"messages": [{"role": "user", "content": "one two three four five six"}]}
        error = error_of(c.post("/v1/chat/completions", json=chat), 400)
        assert (error["param"], error["code"]) == ("messages", "prompt_too_long")
