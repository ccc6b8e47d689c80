"""``GET /openapi.json`` says what the validators accept: every field with its type and limits, and the same verdict
on every body (drawn by hypothesis, good and bad, seeded). In-process, scripted engine.

``FUZZ_EXAMPLES`` (an environment variable, default 300) sets how many bodies each agreement test draws.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.testclient import TestClient

from ttft_sse.api import openai_requests as openai
from ttft_sse.api.openapi import document
from ttft_sse.app import create_app
from ttft_sse.engine.base import ROLES
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.errors import InvalidRequest
from ttft_sse.schemas import FIELDS, MAX_STOP_SEQUENCES, MAX_TEMPERATURE, SEED_LIMIT, GenerationRequest
from ttft_sse.settings import Settings

CAP = 100
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
AGREEMENT = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # seeded: the same bodies every run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = create_app(Settings(warmup=False, max_tokens_cap=CAP, default_max_tokens=10), FakeEngine())
    with TestClient(app) as c:
        yield c


def test_the_document_is_served_and_lists_every_route(client: TestClient) -> None:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    spec = response.json()
    assert spec["openapi"].startswith("3.1")
    served = set()
    for route in client.app.routes:  # type: ignore[attr-defined]
        if isinstance(route, Mount):
            continue  # /static: files, not an API
        if isinstance(route, WebSocketRoute):
            served.add((route.path, "get"))  # a WebSocket's handshake is a GET
            continue
        assert isinstance(route, Route)
        path = route.path.replace("{model:path}", "{model}")
        served |= {(path, method.lower()) for method in route.methods or () if method != "HEAD"}
    described = {(path, method) for path, item in spec["paths"].items() for method in item}
    assert described == served
    for schema in spec["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)  # each a valid JSON Schema (2020-12, as OpenAPI 3.1)


def test_every_field_the_validator_knows_is_described_with_its_limits() -> None:
    schema = GenerationRequest.json_schema(max_tokens_cap=CAP)
    properties = schema["properties"]
    assert tuple(properties) == FIELDS
    assert schema["additionalProperties"] is False
    assert (properties["max_tokens"]["minimum"], properties["max_tokens"]["maximum"]) == (1, CAP)
    assert properties["temperature"]["maximum"] == MAX_TEMPERATURE
    assert (properties["top_p"]["exclusiveMinimum"], properties["top_p"]["maximum"]) == (0, 1)
    assert properties["seed"]["maximum"] == SEED_LIMIT - 1
    assert properties["stop"]["anyOf"][2]["maxItems"] == MAX_STOP_SEQUENCES
    assert properties["messages"]["items"]["properties"]["role"]["enum"] == list(ROLES)
    # prompt or messages: exactly one is required
    assert sorted(branch["required"][0] for branch in schema["oneOf"]) == ["messages", "prompt"]


def test_the_openai_schemas_name_every_field_the_parser_knows() -> None:
    known = openai._HONOURED | openai._INERT | openai._UNSUPPORTED.keys()
    for chat, required in ((True, ["messages"]), (False, ["prompt"])):
        schema = openai.json_schema(chat=chat, max_tokens_cap=CAP)
        assert known <= set(schema["properties"])
        assert schema["required"] == required
        for name, (neutral, _) in openai._UNSUPPORTED.items():
            assert schema["properties"][name]["enum"] == [None, *neutral], name
        assert schema["properties"]["max_completion_tokens"]["maximum"] == CAP


def test_the_served_document_carries_the_settings_cap() -> None:
    spec = document(Settings(max_tokens_cap=77, default_max_tokens=10))
    assert spec["components"]["schemas"]["GenerationRequest"]["properties"]["max_tokens"]["maximum"] == 77
    stream = {p["name"]: p for p in spec["paths"]["/stream"]["get"]["parameters"]}
    assert set(stream) == set(FIELDS)
    assert stream["max_tokens"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 77}


# -- the schema and the validator agree --------------------------------------------------------------------------

# Text as JSON carries it (no lone surrogates: the JSON reader refuses those before any validator), blank text too.
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
    st.sampled_from(["", " ", "\t\n", "\u00a0", "\u2003x", "hi"]),
)
WORDS = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12).filter(str.strip)
# Numbers as JSON carries them: finite floats, integers up to the JSON reader's 32 digits.
INTEGER = st.one_of(
    st.integers(-3, CAP + 3),
    st.integers(-(10**32) + 1, 10**32 - 1),
    st.sampled_from([SEED_LIMIT - 1, SEED_LIMIT]),
)
NUMBER = st.one_of(
    INTEGER,
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1.0, 2.0, 2.0000001, -0.0, 1e-300, 5.0, 0.5, float(SEED_LIMIT), float(CAP), CAP + 0.5]),
)
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
ANY = st.recursive(
    SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6
)


def message(roles: list[str]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({"role": st.sampled_from(roles), "content": st.one_of(WORDS, TEXT)})


def message_edge(roles: list[str]) -> st.SearchStrategy[Any]:
    fields = {
        "role": st.one_of(st.sampled_from(roles), ANY),
        "content": st.one_of(TEXT, ANY),
        "name": ANY,
        "tool_call_id": st.one_of(TEXT, ANY),
        "x": ANY,
    }
    return st.one_of(st.fixed_dictionaries({}, optional=fields), ANY)


STOP = st.one_of(st.none(), WORDS, st.lists(WORDS, max_size=MAX_STOP_SEQUENCES))
STOP_EDGE = st.one_of(TEXT, st.lists(TEXT, min_size=MAX_STOP_SEQUENCES, max_size=MAX_STOP_SEQUENCES + 2), ANY)


@st.composite
def mutated(
    draw: st.DrawFn,
    base: dict[str, Any],
    good: dict[str, st.SearchStrategy[Any]],
    edge: dict[str, st.SearchStrategy[Any]],
) -> dict[str, Any]:
    """A body the validator would take (``base``, plus some ``good`` fields), then some fields set to an ``edge``
    value (a limit, either side of it; a wrong type) or taken away: both verdicts, on every field.

    An ``edge`` entry whose name starts with ``_`` draws a (name, value) pair: a family of fields, one at a time.
    """
    value = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(good)), unique=True, max_size=len(good))):
        value[name] = draw(good[name])
    for name in sorted(edge):
        if draw(st.integers(0, 3)) != 0:  # each field one time in four
            continue
        if name.startswith("_"):
            key, item = draw(edge[name])
            value[key] = item
        elif draw(st.integers(0, 5)) == 0:
            value.pop(name, None)
        else:
            value[name] = draw(edge[name])
    return value


def around(*limits: float) -> st.SearchStrategy[Any]:
    """Numbers on and either side of each limit, as integers and floats, and anything else now and then."""
    near = [x for limit in limits for x in (limit, limit - 1, limit + 1, limit - 1e-9, limit + 1e-9, float(limit))]
    return st.one_of(st.sampled_from(near), st.sampled_from(near), st.sampled_from(near), NUMBER, ANY)


GOOD = {
    "raw": st.booleans(),
    "parse_special": st.booleans(),
    "max_tokens": st.one_of(st.none(), st.integers(1, CAP)),
    "temperature": st.floats(0, MAX_TEMPERATURE),
    "top_p": st.floats(0, 1, exclude_min=True),
    "stop": STOP,
    "seed": st.one_of(st.none(), st.integers(0, SEED_LIMIT - 1)),
}
EDGE = {
    "prompt": st.one_of(TEXT, ANY),
    "messages": st.one_of(st.lists(st.one_of(message(list(ROLES)), message_edge(list(ROLES))), max_size=3), ANY),
    "raw": ANY,
    "parse_special": ANY,
    "max_tokens": around(1, CAP),
    "temperature": around(0, MAX_TEMPERATURE),
    "top_p": around(0, 1),
    "stop": STOP_EDGE,
    "seed": around(0, SEED_LIMIT - 1),
    "colour": ANY,
}
GENERATION = st.one_of(
    WORDS.flatmap(lambda prompt: mutated({"prompt": prompt}, GOOD, EDGE)),
    st.lists(message(list(ROLES)), min_size=1, max_size=3).flatmap(
        lambda messages: mutated({"messages": messages}, {k: v for k, v in GOOD.items() if k != "raw"}, EDGE)
    ),
)


def verdicts(schema: dict[str, Any], accepts: Any, value: dict[str, Any]) -> tuple[bool, bool]:
    by_schema = jsonschema.Draft202012Validator(schema).is_valid(value)
    try:
        accepts(value)
        by_validator = True
    except InvalidRequest:
        by_validator = False
    return by_schema, by_validator


# Every field, one at a time, on and either side of every limit there is, and in every JSON type: deterministic, so
# that a limit moved on one side only is caught whatever hypothesis draws.
SWEEP = [
    None, True, False, 0, 1, -1, 2, CAP, CAP + 1, 0.0, -0.0, 1e-9, -1e-9, 0.5, 1.0, 1 + 1e-9, 2.0, 2 - 1e-9,
    2 + 1e-9, 5.0, 5.5, SEED_LIMIT - 1, SEED_LIMIT, float(SEED_LIMIT), 10**31, 1e300, "", " ", "x", "\u00a0",
    [], [""], ["x"], ["x"] * MAX_STOP_SEQUENCES, ["x"] * (MAX_STOP_SEQUENCES + 1), [1], ["x", None], {}, {"a": 1},
    [{"role": "user", "content": "hi"}], [{"role": "user", "content": " "}],
    [{"role": "user", "content": "hi", "name": 1}],
    [{"role": "user", "content": "hi", "x": None}], [{"role": "user", "content": "hi", "tool_calls": []}],
    [{"role": "user", "content": "hi", "tool_calls": [{"id": "1"}]}], [{"role": "developer", "content": "hi"}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "user", "content": [{"type": "image"}]}],
    [{"role": "user", "content": []}], [{"role": "user", "content": None}], [{"role": "wizard", "content": "hi"}],
    [{"role": "tool", "content": "hi", "tool_call_id": "call_1"}],
    [{"role": "tool", "content": "hi", "tool_call_id": 1}],
    [{"role": "user", "content": "hi", "tool_call_id": "call_1"}], [{"role": "tool", "content": "hi"}],
    [1, 2], [[1]], {"type": "text"}, ["text"], {"include_usage": True}, {"include_usage": 1}, {"x": True}, "none",
]  # fmt: skip
PROMPTED = {"prompt": "hi"}
CHATTED = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("base", [PROMPTED, CHATTED], ids=["prompt", "messages"])
@pytest.mark.parametrize("field", [*FIELDS, "colour"])
def test_the_generation_schema_and_the_validator_agree_on_each_field_at_its_limits(
    base: dict[str, Any], field: str
) -> None:
    schema = GenerationRequest.json_schema(max_tokens_cap=CAP)
    for value in SWEEP:
        body = {**base, field: value}
        verdict = verdicts(schema, lambda v: GenerationRequest.from_json(v, max_tokens_cap=CAP), body)
        assert verdict[0] == verdict[1], body


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_the_openai_schemas_and_the_parsers_agree_on_each_field_at_its_limits(chat: bool) -> None:
    schema = openai.json_schema(chat=chat, max_tokens_cap=CAP)
    parse = openai.parse_chat if chat else openai.parse_completion
    base = CHATTED if chat else PROMPTED
    for field in [*schema["properties"], "colour"]:
        for value in SWEEP:
            body = {**base, field: value}
            if field == "stream_options":
                body["stream"] = True
            verdict = verdicts(schema, lambda v: parse(v, max_tokens_cap=CAP), body)
            assert verdict[0] == verdict[1], body


@AGREEMENT
@given(GENERATION)
def test_the_generation_schema_and_the_validator_agree_on_every_body(value: dict[str, Any]) -> None:
    schema = GenerationRequest.json_schema(max_tokens_cap=CAP)
    by_schema, by_validator = verdicts(schema, lambda v: GenerationRequest.from_json(v, max_tokens_cap=CAP), value)
    assert by_schema == by_validator, value


def openai_body(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    roles = [*ROLES, "developer"]
    part = st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(WORDS, TEXT)})
    chat_message = st.one_of(
        message(roles),
        st.fixed_dictionaries(
            {"role": st.sampled_from(roles), "content": st.lists(part, max_size=3)},
            optional={"tool_calls": st.just([]), "refusal": st.none(), "name": TEXT},
        ),
    )
    extra = st.sampled_from(["tool_calls", "function_call", "refusal", "name", "audio"])
    chat_edge = st.one_of(
        message_edge(roles),
        st.fixed_dictionaries({"role": st.sampled_from(roles), "content": st.lists(st.one_of(part, ANY), max_size=3)}),
        st.tuples(chat_message, extra, st.one_of(st.none(), st.just([]), ANY)).map(lambda m: {**m[0], m[1]: m[2]}),
    )
    good: dict[str, st.SearchStrategy[Any]] = {
        "model": WORDS,
        "temperature": st.one_of(st.none(), st.floats(0, MAX_TEMPERATURE)),
        "top_p": st.one_of(st.none(), st.floats(0, 1, exclude_min=True)),
        "stop": STOP,
        "seed": st.one_of(st.none(), st.integers(0, SEED_LIMIT - 1)),
        "stream": st.one_of(st.none(), st.just(True)),
        "user": TEXT,
        "metadata": ANY,
        "colour": ANY,
        # One of the two names at most: when both are given they must agree, which a schema cannot say.
        "max_tokens" if chat else "max_completion_tokens": st.one_of(st.none(), st.integers(1, CAP)),
        **{name: st.sampled_from([None, *neutral]) for name, (neutral, _) in openai._UNSUPPORTED.items()},
    }
    edge: dict[str, st.SearchStrategy[Any]] = {
        "model": ANY,
        "messages": st.one_of(st.lists(st.one_of(chat_message, chat_edge), max_size=3), ANY),
        "_messages": st.lists(st.one_of(chat_message, chat_edge), min_size=1, max_size=3).map(
            lambda messages: ("messages", messages)
        ),
        "prompt": st.one_of(st.lists(st.one_of(WORDS, TEXT, INTEGER), max_size=2), TEXT, ANY),
        "max_tokens" if chat else "max_completion_tokens": around(1, CAP),
        "temperature": st.one_of(st.none(), around(0, MAX_TEMPERATURE)),
        "top_p": st.one_of(st.none(), around(0, 1)),
        "stop": STOP_EDGE,
        "seed": around(0, SEED_LIMIT - 1),
        "stream": ANY,
        "stream_options": st.one_of(
            st.fixed_dictionaries({}, optional={"include_usage": st.one_of(st.booleans(), ANY), "other": ANY}), ANY
        ),
        "user": ANY,
        "_unsupported": st.tuples(st.sampled_from(sorted(openai._UNSUPPORTED)), ANY),
    }
    if chat:
        base = st.lists(chat_message, min_size=1, max_size=3).map(lambda messages: {"messages": messages})
    else:
        base = st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=1)).map(lambda prompt: {"prompt": prompt})
    return base.flatmap(lambda value: mutated(value, good, edge))


@AGREEMENT
@given(openai_body(chat=True))
def test_the_chat_schema_and_the_parser_agree_on_every_body(value: dict[str, Any]) -> None:
    schema = openai.json_schema(chat=True, max_tokens_cap=CAP)
    by_schema, by_parser = verdicts(schema, lambda v: openai.parse_chat(v, max_tokens_cap=CAP), value)
    assert by_schema == by_parser, value


@AGREEMENT
@given(openai_body(chat=False))
def test_the_completion_schema_and_the_parser_agree_on_every_body(value: dict[str, Any]) -> None:
    schema = openai.json_schema(chat=False, max_tokens_cap=CAP)
    by_schema, by_parser = verdicts(schema, lambda v: openai.parse_completion(v, max_tokens_cap=CAP), value)
    assert by_schema == by_parser, value
