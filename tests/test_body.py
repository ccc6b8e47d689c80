"""Hostile bodies get a 400 naming the field, never a 500; a body must be labelled as JSON. In-process, scripted engine.

Each hazard here was a 500 once: nesting 2,000 deep (RecursionError in json.loads), an integer of 5,000 digits
(ValueError, the int-string limit), a lone surrogate (TypeError in the tokenizer), Infinity/NaN/1e999 as
max_tokens or seed (OverflowError, ValueError).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from tests.test_api_errors import error_of
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.json_input import MAX_DEPTH
from ttft_sse.settings import Settings

JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"
# Every surface that reads a JSON body, with a body it accepts.
SURFACES = {
    "/stream": {"prompt": "hi"},
    "/complete": {"prompt": "hi"},
    "/streams": {"prompt": "hi"},
    "/jobs": {"prompt": "hi"},
    CHAT: {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(warmup=False), FakeEngine()), raise_server_exceptions=False) as c:
        ready(c)
        yield c


def ready(client: TestClient) -> None:
    """Wait for the lifespan's start-up task (the engine's load) to have run: until then a generation is a 503."""
    for _ in range(200):
        if client.get("/readyz").status_code == 200:
            return
        time.sleep(0.01)
    raise AssertionError("the app did not become ready")


def post_raw(client: TestClient, path: str, text: str, headers: dict[str, str] = JSON) -> object:
    return client.post(path, content=text.encode("utf-8", "surrogatepass"), headers=headers)


def with_field(path: str, field: str, literal: str) -> str:
    """The surface's good body with ``field`` set to the JSON text ``literal`` (which json.dumps cannot write)."""
    body = dict(SURFACES[path])
    body[field] = "@@"
    return json.dumps(body).replace('"@@"', literal)


@pytest.mark.parametrize("path", SURFACES)
def test_nesting_2000_deep_is_400_too_deep(client: TestClient, path: str) -> None:
    error = error_of(post_raw(client, path, "[" * 2000 + "]" * 2000), 400)
    assert error["code"] == "too_deep"
    assert f"2000 deep; the limit is {MAX_DEPTH}" in str(error["message"])
    # Deep inside a field too; brackets inside strings do not count.
    deep = error_of(post_raw(client, path, with_field(path, "metadata", "[" * 100 + "]" * 100)), 400)
    assert deep["code"] == "too_deep"
    brackets_in_text = dict(SURFACES[path])
    brackets_in_text["stop"] = "[" * 100
    assert post_raw(client, path, json.dumps(brackets_in_text)).status_code < 500  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", SURFACES)
@pytest.mark.parametrize("field", ["max_tokens", "seed"])
def test_an_integer_of_5000_digits_is_400_naming_the_field(client: TestClient, path: str, field: str) -> None:
    error = error_of(post_raw(client, path, with_field(path, field, "9" * 5000)), 400)
    assert (error["param"], error["code"]) == (field, "number_out_of_range")
    assert "an integer of 5000 digits" in str(error["message"])
    assert len(str(error["message"])) < 200  # the number is not echoed back


@pytest.mark.parametrize("path", SURFACES)
@pytest.mark.parametrize("field", ["max_tokens", "seed", "temperature", "top_p"])
@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e999", "-1e999"])
def test_non_finite_numbers_are_400_naming_the_field(client: TestClient, path: str, field: str, literal: str) -> None:
    error = error_of(post_raw(client, path, with_field(path, field, literal)), 400)
    assert (error["param"], error["code"]) == (field, "number_out_of_range")
    assert str(error["message"]).startswith(f"{field} is {literal}")


@pytest.mark.parametrize(("query", "param"), [("max_tokens=1e999", "max_tokens"), ("seed=" + "9" * 5000, "seed")])
@pytest.mark.parametrize("more", ["", "&temperature=inf", "&temperature=nan"])
def test_query_numbers_out_of_range_are_400(client: TestClient, query: str, param: str, more: str) -> None:
    assert error_of(client.get(f"/stream?prompt=hi&{query}"), 400)["param"] == param
    if more:
        assert error_of(client.get(f"/stream?prompt=hi{more}"), 400)["param"] == "temperature"


def test_finite_floats_for_integer_fields_are_refused_by_the_validator_without_overflow() -> None:
    from ttft_sse.errors import InvalidRequest
    from ttft_sse.schemas import GenerationRequest

    for value in (float("inf"), float("nan"), 1e308, 2.5):
        with pytest.raises(InvalidRequest) as info:  # straight to the validator, past the JSON reader
            GenerationRequest.from_json({"prompt": "x", "max_tokens": value}, max_tokens_cap=10)
        assert info.value.param == "max_tokens"
    assert GenerationRequest.from_json({"prompt": "x", "max_tokens": 5.0}, max_tokens_cap=10).max_tokens == 5


LONE = "\\ud800"  # the JSON escape of a lone (high) surrogate


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/stream", f'{{"prompt": "hi {LONE}"}}', "prompt"),
        ("/complete", f'{{"messages": [{{"role": "user", "content": "x{LONE}"}}]}}', "messages[0].content"),
        ("/streams", f'{{"prompt": "hi", "stop": ["a", "{LONE}"]}}', "stop[1]"),
        ("/jobs", '{"prompt": "\\udfff"}', "prompt"),
        (CHAT, f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{LONE}"}}]}}]}}', None),
        (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "user": "{LONE}"}}', "user"),
        ("/v1/completions", f'{{"prompt": ["{LONE}"]}}', "prompt[0]"),
        ("/complete", f'{{"prompt": "hi", "{LONE}": 1}}', "\\ud800"),
    ],
)
def test_text_that_is_not_valid_unicode_is_400_naming_the_field(
    client: TestClient, path: str, body: str, param: str | None
) -> None:
    error = error_of(post_raw(client, path, body), 400)
    assert error["code"] == "invalid_unicode"
    assert "lone surrogate (U+D" in str(error["message"])
    if param is not None:
        assert error["param"] == param
    else:
        assert str(error["param"]).startswith("messages[0].content")


def test_a_surrogate_pair_is_one_character_and_fine(client: TestClient) -> None:
    response = post_raw(client, "/complete", '{"prompt": "smile \\ud83d\\ude00"}')
    assert response.status_code == 200  # type: ignore[attr-defined]


def test_a_lone_surrogate_in_query_messages_is_400(client: TestClient) -> None:
    messages = f'[{{"role":"user","content":"{LONE}"}}]'
    error = error_of(client.get("/stream", params={"prompt": None, "messages": messages}), 400)
    assert (error["param"], error["code"]) == ("messages[0].content", "invalid_unicode")
    deep = error_of(client.get("/stream", params={"messages": "[" * 500 + "]" * 500}), 400)
    assert (deep["param"], deep["code"]) == ("messages", "too_deep")


def test_errors_quoting_hostile_names_stay_short_valid_json(client: TestClient) -> None:
    body = {f"x{i}" * 300: 1 for i in range(50)} | {"prompt": "hi"}
    error = error_of(client.post("/complete", json=body), 400)
    assert "and 45 more" in str(error["message"])
    assert len(str(error["message"])) < 600
    role = error_of(client.post("/complete", json={"messages": [{"role": "x" * 100_000, "content": "hi"}]}), 400)
    assert len(str(role["message"])) < 200


# -- content types ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/json", ""],
)
@pytest.mark.parametrize("path", SURFACES)
def test_bodies_not_labelled_json_are_415(client: TestClient, path: str, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post(path, content=json.dumps(SURFACES[path]).encode(), headers=headers)
    error = error_of(response, 415)
    assert (error["param"], error["code"]) == ("Content-Type", "unsupported_media_type")
    assert "application/json" in str(error["message"])


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "Application/JSON; charset=UTF-8", 'application/json; charset="utf-8"', "application/x+json"],
)
def test_json_labels_are_read(client: TestClient, content_type: str) -> None:
    response = client.post("/complete", content=b'{"prompt": "hi"}', headers={"content-type": content_type})
    assert response.status_code == 200, response.text


def test_a_charset_other_than_utf8_is_415(client: TestClient) -> None:
    response = client.post(
        "/complete", content=b'{"prompt": "hi"}', headers={"content-type": "application/json; charset=latin-1"}
    )
    assert "UTF-8" in str(error_of(response, 415)["message"])


def test_allow_any_content_type_reads_every_body_as_json() -> None:
    app = create_app(Settings(warmup=False, allow_any_content_type=True), FakeEngine())
    with TestClient(app) as c:
        ready(c)
        for headers in ({}, {"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}):
            assert c.post("/complete", content=b'{"prompt": "hi"}', headers=headers).status_code == 200


def test_settings_read_the_content_type_switch_from_the_environment() -> None:
    assert Settings.from_env({}).allow_any_content_type is False
    assert Settings.from_env({"TTFT_ALLOW_ANY_CONTENT_TYPE": "true"}).allow_any_content_type is True
