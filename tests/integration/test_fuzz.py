"""Fuzzing every endpoint with hostile input, against a real server (as ``ttft-sse serve`` runs it), seeded and bounded.

What is sent comes from the API's own description (``GET /openapi.json``): each endpoint's fields, from its schema,
with values drawn inside the schema's limits, on them, past them, and hostile (strings of 200,000 characters,
nesting thousands deep, NaN and 1e999 and 5,000-digit integers, lone surrogates, wrong types, unknown fields), and
bodies that are not JSON at all or not labelled as JSON. Framing is fuzzed over raw sockets: chunked bodies,
Content-Length too short or too long, truncated requests. Every answer must be below 500 and carry no traceback and
no file path, the server must log no error, and it must then answer a normal request normally.

The scripted engine answers, for speed; the tokenizer matters for lone surrogates only, so the real model has one
small test of its own. ``FUZZ_EXAMPLES`` (an environment variable, default 300) sets how many requests hypothesis
draws; ``FUZZ_EXAMPLES=5000`` for a long run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from tests.support.servers import ALICE, BOB, TWO_KEYS, Served, fake_app, serving
from ttft_sse.api.openapi import document
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # seeded: the same requests every run
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
BODY_TIMEOUT_S = 1.0
# No log line may be longer than this, whatever a client sent (the probe found one of 415,050 characters).
MAX_LOG_LINE = 4000
LEAKS = re.compile(rb"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+|site-packages|(?:/[\w.-]+)+\.py\b")


class _Faults(logging.Handler):
    """Collects what the stdlib loggers (hypercorn's) say at ERROR or with a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    app = fake_app(
        FakeEngine(),
        max_concurrency=64,
        max_queue=64,
        body_timeout_seconds=BODY_TIMEOUT_S,
        max_jobs=100_000,
        max_streams=100_000,
    )
    faults = _Faults()
    logging.getLogger().addHandler(faults)
    try:
        with capture_logs() as logs, serving(app) as server:
            yield server
        errors = [e for e in logs if e["log_level"] in ("error", "critical") or "exc_info" in e]
        assert not errors, errors[:3]
        long = [repr(e)[:300] for e in logs if len(repr(e)) > MAX_LOG_LINE]
        assert not long, long[:3]
        assert not faults.records, [r.getMessage() for r in faults.records[:3]]
    finally:
        logging.getLogger().removeHandler(faults)


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base, timeout=httpx.Timeout(30, connect=10)) as c:
        yield c


SPEC = document(Settings())
SCHEMAS = SPEC["components"]["schemas"]
BODIES = {
    ("POST", "/stream"): "GenerationRequest",
    ("POST", "/complete"): "GenerationRequest",
    ("POST", "/streams"): "GenerationRequest",
    ("POST", "/jobs"): "GenerationRequest",
    ("POST", "/v1/chat/completions"): "ChatCompletionRequest",
    ("POST", "/v1/completions"): "CompletionRequest",
}


def assert_sound(status: int, body: bytes, sent: bytes) -> None:
    """Below 500, and nothing in the body that looks like a traceback or a file path (unless the client sent it)."""
    assert status < 500, (status, body[:500], sent[:500])
    for leak in LEAKS.findall(body):
        assert leak in sent, (leak, body[:500])


def assert_still_serving(client: httpx.Client) -> None:
    answer = client.post("/complete", json={"prompt": "hi"})
    assert (answer.status_code, answer.json()["text"]) == (200, "Hello, world!")


# -- values, from the schemas and beyond them ---------------------------------------------------------------------


class Raw:
    """JSON text spliced into a body as is: what ``json.dumps`` cannot write (NaN literals, 5,000 digits, depth)."""

    def __init__(self, text: str) -> None:
        self.text = text


TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
HOSTILE = st.one_of(
    st.sampled_from(
        [
            Raw("NaN"),
            Raw("Infinity"),
            Raw("-Infinity"),
            Raw("1e999"),
            Raw("-1e999"),
            Raw("9" * 5000),
            Raw("-" + "9" * 5000),
            Raw("1" + "0" * 400 + ".5"),
            Raw('"\\ud800"'),
            Raw('"x\\udfff"'),
            Raw('["\\udbff\\udbff"]'),
            Raw('{"\\ud800": 1}'),
            Raw("[" * 3000 + "]" * 3000),
            Raw('{"a":' * 200 + "1" + "}" * 200),
            Raw("[" * 60 + "]" * 60),
            Raw('"' + "[" * 5000 + '"'),
            "x" * 200_000,
            " " * 1000,
            "\u0000",
            "\u202e\u200b",
            "\U0001f600" * 100,
            -1,
            0,
            2**63,
            2**64,
            -(2**63),
            1e308,
            -1e-308,
            5e-324,
            True,
            False,
            None,
            [],
            {},
            [None] * 100,
            {"nested": {"deep": [1, [2, [3]]]}},
        ]
    ),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
    st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values a schema describes, on and past its limits: the subset of JSON Schema that /openapi.json uses."""
    if "$ref" in schema:
        return from_schema(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    if "anyOf" in schema:
        return st.one_of([from_schema(branch) for branch in schema["anyOf"]])
    if "type" not in schema:  # anything goes: accepted and ignored, or free-form
        return HOSTILE
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    options: list[st.SearchStrategy[Any]] = []
    for kind in kinds:
        if kind in ("integer", "number"):
            low = schema.get("minimum", schema.get("exclusiveMinimum", -100))
            high = schema.get("maximum", 100)
            edges = [low - 1, low, low + 1, high - 1, high, high + 1]
            inside = st.integers(int(low), int(high)) if kind == "integer" else st.floats(low, high)
            options += [inside, st.sampled_from(edges if kind == "integer" else [float(e) for e in edges])]
        elif kind == "string":
            options.append(TEXT)
        elif kind == "boolean":
            options.append(st.booleans())
        elif kind == "null":
            options.append(st.none())
        elif kind == "array":
            item = from_schema(schema["items"]) if "items" in schema else HOSTILE
            options.append(st.lists(item, max_size=schema.get("maxItems", 3) + 1))
        elif kind == "object":
            fields = {name: from_schema(sub) for name, sub in schema.get("properties", {}).items()}
            options.append(st.fixed_dictionaries({}, optional={**fields, "extra": HOSTILE}))
    return st.one_of(options)


WORDS = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20).filter(str.strip)
BASES = {
    "GenerationRequest": st.builds(lambda prompt: {"prompt": prompt}, WORDS),
    "CompletionRequest": st.builds(lambda prompt: {"prompt": prompt}, WORDS),
    "ChatCompletionRequest": st.builds(lambda text: {"messages": [{"role": "user", "content": text}]}, WORDS),
}
UNKNOWN = st.one_of(
    st.dictionaries(st.one_of(TEXT, st.just("\ud800")), HOSTILE, min_size=1, max_size=2),
    # The probe's: thousands of unknown fields with long names (each reported in a log line, which must stay short).
    st.integers(1, 2000).map(lambda n: {f"{i:05d}" + "u" * 195: i for i in range(n)}),
)


@st.composite
def body_of(draw: st.DrawFn, schema_name: str) -> dict[str, Any]:
    """A body the endpoint takes, some of its fields drawn from the schema (inside and on its limits, past them),
    then none, one or two of them hostile, and now and then a field the endpoint does not know."""
    properties = SCHEMAS[schema_name]["properties"]
    names = sorted(properties)
    value = dict(draw(BASES[schema_name]))
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=4)):
        value[name] = draw(from_schema(properties[name]))
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=2)):
        value[name] = draw(HOSTILE)
    if draw(st.integers(0, 4)) == 0:
        value.update(draw(UNKNOWN))
    return value


def encode(value: Any) -> bytes:
    """JSON text of ``value``, each ``Raw`` spliced in; lone surrogates as ``\\udXXX`` escapes, as JSON has them."""
    raws: list[str] = []

    def placeholder(item: Any) -> Any:
        if isinstance(item, Raw):
            raws.append(item.text)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(item, dict):
            return {key: placeholder(v) for key, v in item.items()}
        if isinstance(item, list):
            return [placeholder(v) for v in item]
        return item

    text = json.dumps(placeholder(value))  # ensure_ascii: a lone surrogate is written as its escape
    for index, raw in enumerate(raws):
        text = text.replace(f'"@@raw{index}@@"', raw)
    return text.encode()


JUNK = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [b"", b"{", b'{"prompt": "hi"', b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"null", b"[]", b"1e999", b"\x00"]
    ),
    st.just('{"prompt": "hi"}'.encode("utf-16")),
)
CONTENT_TYPES = st.one_of(
    st.just("application/json"),
    st.just("application/json"),
    st.sampled_from(
        [
            "application/json; charset=utf-8",
            "application/x+json",
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/json; charset=latin-1",
            "multipart/form-data",
            "",
            ";;;",
            "application/json\u00e9",
        ]
    ),
    st.none(),
)
POSTS = st.sampled_from(sorted(BODIES))
# What a header's value may hold (visible ASCII, space, Latin-1 letters): others the client refuses to send.
FIELD_VALUE = st.text(st.characters(codec="latin-1", exclude_categories=("Cc",)), max_size=300).map(
    lambda text: text.strip().encode("latin-1")
)


@st.composite
def post(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, bytes]]:
    method, path = draw(POSTS)
    raw = encode(draw(body_of(BODIES[method, path]))) if draw(st.integers(0, 5)) else draw(JUNK)
    headers: dict[str, bytes] = {}
    content_type = draw(CONTENT_TYPES)
    if content_type is not None:
        headers["content-type"] = content_type.encode("latin-1")
    if draw(st.integers(0, 4)) == 0:
        headers[draw(st.sampled_from(["authorization", "x-api-key", "x-request-id", "last-event-id"]))] = draw(
            FIELD_VALUE
        )
    return method, path, raw, headers


@FUZZ
@given(post())
def test_hostile_bodies_on_every_endpoint_never_get_a_5xx(
    client: httpx.Client, request_: tuple[str, str, bytes, dict[str, bytes]]
) -> None:
    method, path, raw, headers = request_
    with client.stream(method, path, content=raw, headers=headers) as response:
        body = b"".join(response.iter_bytes())
    assert_sound(response.status_code, body, raw + repr(headers).encode())
    if response.status_code == 400:  # a refusal names what it refuses, in the one error shape
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}


def query_value() -> st.SearchStrategy[str]:
    return st.one_of(
        TEXT,
        st.sampled_from(["1e999", "inf", "nan", "-0", "9" * 5000, "0x10", " 5", "1_000", "\uff11\uff12"]),
        st.builds(
            lambda v: encode(v).decode(),
            st.one_of(HOSTILE, from_schema(SCHEMAS["GenerationRequest"]["properties"]["messages"])),
        ),
    )


@st.composite
def query(draw: st.DrawFn) -> str:
    names = [parameter["name"] for parameter in SPEC["paths"]["/stream"]["get"]["parameters"]]
    pairs = draw(st.lists(st.tuples(st.one_of(st.sampled_from(names), TEXT), query_value()), max_size=5))
    encoded = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)
    if draw(st.booleans()):
        encoded += draw(st.sampled_from(["&prompt=%ED%A0%80", "&messages=%5B%22%5Cud800%22%5D", "&prompt=%FF", "&&=&"]))
    return encoded[:30_000]  # past the head limit (16 KiB: a 431), short of what the client refuses to send


@FUZZ
@given(query())
def test_hostile_query_strings_never_get_a_5xx(client: httpx.Client, query_string: str) -> None:
    url = httpx.URL(f"{str(client.base_url).rstrip('/')}/stream?{query_string}")
    with client.stream("GET", url) as response:
        body = b"".join(response.iter_bytes())
    assert_sound(response.status_code, body, query_string.encode())
    try:
        parse_qsl(query_string, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:  # the probe's: replaced silently, where a JSON body gets 400
        assert response.status_code in (400, 431), body[:300]


REPEATED = "/streams/{}?lastEventId=x.1&lastEventId=x.2"  # the probe's: the last one was taken silently
PATHS = st.sampled_from(
    ["/streams/{}", "/result/{}", "/jobs/{}", "/v1/models/{}", "/streams/{}?lastEventId=x.1", REPEATED, "/{}"]
).flatmap(lambda template: st.tuples(st.just(template), st.one_of(TEXT, st.text(max_size=3000))))


@FUZZ
@given(PATHS, st.sampled_from(["GET", "DELETE", "POST", "PUT", "HEAD", "OPTIONS", "PATCH"]))
def test_hostile_paths_and_methods_never_get_a_5xx(client: httpx.Client, path: tuple[str, str], method: str) -> None:
    template, value = path
    target = template.format(quote(value.encode("utf-8", "surrogatepass"), safe=""))
    header = "".join(c for c in value if 32 <= ord(c) < 127 or 160 <= ord(c) < 256).strip().encode("latin-1")
    with client.stream(method, target, headers={"last-event-id": header}) as response:
        body = b"".join(response.iter_bytes())
    assert_sound(response.status_code, body, target.encode() + value.encode("utf-8", "surrogatepass"))
    if template == REPEATED and method == "GET" and value and "/" not in value and len(target) < 3000:
        assert response.status_code == 400, body[:300]


def test_the_server_serves_normally_after_the_fuzzing(client: httpx.Client) -> None:
    assert_still_serving(client)


# -- framing, over raw sockets ------------------------------------------------------------------------------------


def exchange(
    served: Served, data: bytes, *, then_close: bool = False, half_close: bool = False, wait: float = 10
) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``wait`` passes).

    ``then_close``: close at once, reading nothing; ``half_close``: say that nothing more comes (the server answers
    what it has already refused, and drops the rest as a client that left).
    """
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(data)
        if then_close:
            return b""
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.5)
        received, deadline = b"", time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        return received


def statuses(received: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.[01] (\d{3})", received)]


JSON_HEAD = b"POST /complete HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
GOOD = b'{"prompt": "hi"}'


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        out += f"{size:x}\r\n".encode() + body[at : at + size] + b"\r\n"
        at += size
    return out + b"0\r\n\r\n"


FRAMES = {
    "chunked": (
        JSON_HEAD + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked(GOOD, [3, 5, 8]),
        [200],
    ),
    "chunked, bad size": (JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", [400]),
    "chunked, size past the data": (
        JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n100\r\n" + GOOD + b"\r\n0\r\n\r\n",
        None,
    ),
    "length too long": (JSON_HEAD + b"Content-Length: 100\r\n\r\n" + GOOD, [408]),
    "length too short": (JSON_HEAD + b"Content-Length: 5\r\nConnection: close\r\n\r\n" + GOOD, [400]),
    # The probe's: both framings were accepted and the connection kept (RFC 9112 §6.3; request smuggling).
    "length and chunked": (
        JSON_HEAD + b"Content-Length: 16\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(GOOD, [16]),
        [400],
    ),
    "length and chunked, then a request pipelined behind": (
        JSON_HEAD
        + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked(GOOD, [16])
        + b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n",
        [400],
    ),
    "chunked and length, lower case and in the other order": (
        b"POST /stream HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
        b"content-length: 16\r\n\r\n" + chunked(GOOD, [16]) + b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n",
        [400],
    ),
    "two lengths": (JSON_HEAD + b"Content-Length: 16\r\nContent-Length: 17\r\n\r\n" + GOOD, [400]),
    "negative length": (JSON_HEAD + b"Content-Length: -1\r\n\r\n" + GOOD, [400]),
    "length not a number": (JSON_HEAD + b"Content-Length: 1e3\r\n\r\n" + GOOD, [400]),
    "length past the limit": (JSON_HEAD + b"Content-Length: 99999999999999999999\r\n\r\n", [413]),
    "pipelined": (
        (JSON_HEAD + b"Content-Length: 16\r\n\r\n" + GOOD) * 2
        + b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        [200, 200, 200],
    ),
    "garbage request line": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, [400]),
    "no Host": (b"GET /healthz HTTP/1.1\r\n\r\n", [400]),
    "HTTP/1.0": (b"GET /healthz HTTP/1.0\r\n\r\n", [200]),
    "absurd method": (b"BREW /complete HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", [405]),
    "header without colon": (b"GET /healthz HTTP/1.1\r\nHost: t\r\nnonsense\r\n\r\n", [400]),
    "NUL in a header": (b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-A: a\x00b\r\n\r\n", [400]),
    "obsolete line folding": (b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-A: a\r\n b\r\nConnection: close\r\n\r\n", None),
    "space before colon": (b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-A : b\r\n\r\n", [400]),
}


@pytest.mark.parametrize("name", FRAMES)
def test_framing_oddities_get_a_4xx_or_an_answer_never_a_5xx(served: Served, client: httpx.Client, name: str) -> None:
    data, expected = FRAMES[name]
    received = exchange(served, data, wait=BODY_TIMEOUT_S + 5)
    codes = statuses(received)
    assert all(code < 500 for code in codes), received[:500]
    assert not LEAKS.search(received), received[:500]
    if expected is not None:
        assert codes == expected, received[:500]
    if "chunked and length" in name or "length and chunked" in name:
        assert b"ambiguous_framing" in received and b"connection: close" in received.lower(), received[:500]
    assert_still_serving(client)


@pytest.mark.parametrize(
    "data",
    [
        JSON_HEAD + b"Content-Length: 100\r\n\r\n" + GOOD[:5],
        JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n" + GOOD[:5] + b"\r\n",
        JSON_HEAD + b"Content-Le",
        b"GET /stream?prompt=hi HTTP/1.1\r\nHost: t\r\n\r\n",
    ],
    ids=["mid-body", "mid-chunked-body", "mid-head", "at-once-after-a-stream-request"],
)
def test_truncated_requests_leave_the_server_serving(served: Served, client: httpx.Client, data: bytes) -> None:
    exchange(served, data, then_close=True)
    assert_still_serving(client)


@FUZZ
@given(
    st.lists(
        st.sampled_from(
            [
                b"GET",
                b"POST",
                b"/complete",
                b"/stream?prompt=hi",
                b" ",
                b"HTTP/1.1",
                b"\r\n",
                b":",
                b"Host: t",
                b"Content-Length: 4",
                b"Transfer-Encoding: chunked",
                b"{}",
                b"\x00",
                b"\xff",
                b"Content-Type: application/json",
                b"0\r\n\r\n",
                b"4\r\n",
            ]
        ),
        max_size=14,
    )
)
def test_random_framing_never_gets_a_5xx(served: Served, pieces: list[bytes]) -> None:
    data = b"".join(pieces) + b"\r\n\r\n"
    received = exchange(served, data, half_close=True, wait=5)
    assert all(code < 500 for code in statuses(received)), received[:500]
    assert not LEAKS.search(received), received[:500]


# -- lone surrogates and the real tokenizer -----------------------------------------------------------------------

SURROGATE_TEXT = st.lists(
    st.one_of(st.text(max_size=6), st.sampled_from(["\ud800", "\udfff", "\udbff", "\ud83d\ude00", "\ud83d"])),
    min_size=1,
    max_size=5,
).map("".join)


def test_lone_surrogates_are_refused_before_the_real_tokenizer(hf_app: Any, hf_server: str) -> None:
    """The real tokenizer refuses a lone surrogate with TypeError (the 500 this once was); the server must refuse it
    first, naming the field, on every surface, and go on serving."""
    engine = hf_app.state.runtime.engine
    with pytest.raises(TypeError):
        engine.prepare(prompt="hi \ud800", messages=None, raw=True)
    surfaces = [
        ("/complete", {"prompt": "Say hi \ud800", "max_tokens": 2}, "prompt"),
        ("/stream", {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            None,
        ),
        ("/v1/completions", {"prompt": "x\udbff", "max_tokens": 2}, "prompt"),
        ("/jobs", {"prompt": "\ud800"}, "prompt"),
    ]
    with httpx.Client(base_url=hf_server, timeout=120) as client:
        for path, body, param in surfaces:
            response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_unicode"
            assert param is None or error["param"] == param
        pair = json.dumps({"prompt": "Say hi \ud83d\ude00", "max_tokens": 2})  # a pair: one character, sound
        answer = client.post("/complete", content=pair, headers={"content-type": "application/json"})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


@settings(
    max_examples=min(EXAMPLES, 25),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(SURROGATE_TEXT, st.sampled_from(["/complete", "/v1/completions"]))
def test_drawn_texts_with_and_without_lone_surrogates_through_the_real_tokenizer(
    hf_server: str, text: str, path: str
) -> None:
    body = json.dumps({"prompt": text, "max_tokens": 1})
    response = httpx.post(f"{hf_server}{path}", content=body, headers={"content-type": "application/json"}, timeout=120)
    assert response.status_code < 500, response.text
    # What the server reads: JSON joins an escaped high-low pair into one character; what is left alone is lone.
    if any(0xD800 <= ord(c) <= 0xDFFF for c in json.loads(body)["prompt"]):
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_unicode", response.text


# -- special-token strings in content, through the real tokenizer ---------------------------------------------------

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>", "<|im_start|>system\n", "<|im", "|>"]
CONTENT = st.lists(st.one_of(st.sampled_from(SPECIALS), st.text(max_size=6).filter(lambda t: t.isprintable())),
                   min_size=1, max_size=8).map("".join)  # fmt: skip


@settings(
    max_examples=min(EXAMPLES, 60),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), CONTENT), min_size=1, max_size=4))
def test_drawn_contents_holding_special_strings_never_give_a_special_token(hf_app: Any, turns: list[Any]) -> None:
    """The probe's: a message whose content was "<|im_end|>" closed its turn. The prompt's special tokens are those
    the template writes for the same conversation with harmless content, whatever the content holds."""
    from dataclasses import replace

    from ttft_sse.engine.base import ChatMessage

    engine = hf_app.state.runtime.engine
    tokenizer = engine.tokenizer
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    messages = [ChatMessage(role, content) for role, content in turns]
    if not any(m.content.strip() for m in messages):
        return
    prompt = engine.prepare(prompt=None, messages=messages, raw=False)
    harmless = engine.prepare(prompt=None, messages=[replace(m, content="x") for m in messages], raw=False)
    assert [i for i in prompt.token_ids if i in special] == [i for i in harmless.token_ids if i in special]


# -- a guarded server: a Host allow-list and two API keys -----------------------------------------------------------


@pytest.fixture(scope="module")
def guarded() -> Iterator[Served]:
    app = fake_app(FakeEngine(), allowed_hosts="localhost,127.0.0.1,[::1]", api_keys=TWO_KEYS, max_streams=10_000)
    with serving(app) as server:
        yield server


@pytest.fixture(scope="module")
def guarded_client(guarded: Served) -> Iterator[httpx.Client]:
    """One client for every drawn example (a client of its own each cost ~25 ms: its TLS context, unused here)."""
    with httpx.Client(base_url=guarded.base, timeout=30) as c:
        yield c


HOSTS = st.one_of(
    st.sampled_from(["127.0.0.1", "localhost", "[::1]", "LOCALHOST", "evil.example", "127.0.0.1.evil.example"]),
    st.sampled_from(["10.0.0.1", "[fd00::1]", "", ":", "[", "[::1", "a:b:c", "localhost:99999", "*"]),
    st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=40),
).flatmap(lambda host: st.sampled_from([host, f"{host}:8000"]))


@FUZZ
@given(HOSTS, st.sampled_from(["/healthz", "/readyz", "/stream?prompt=hi", "/", "/v1/models", "/streams/x"]))
def test_drawn_host_headers_are_answered_only_for_allowed_names(guarded: Served, host: str, path: str) -> None:
    """The probe's: any Host was answered (DNS rebinding). Only the loopback names, and for the probes addresses."""
    import ipaddress

    received = exchange(guarded, f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode(), wait=5)
    codes = statuses(received)
    assert codes and all(code < 500 for code in codes), received[:300]
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.partition("]")[0] + "]"
    allowed = name.lower() in ("127.0.0.1", "localhost", "[::1]")
    try:
        address = bool(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        address = False
    if not allowed and not (address and path in ("/healthz", "/readyz")):
        assert codes == [400], (host, received[:300])


@FUZZ
@given(
    st.sampled_from([{}, {"X-API-Key": BOB}, {"Authorization": f"Bearer {ALICE}"}, {"X-API-Key": "x" * 40}]),
    st.one_of(st.none(), st.text(max_size=60), st.sampled_from(["1.x", "99999999999.AAAA", "", "."])),
    st.sampled_from(["GET", "DELETE"]),
)
def test_drawn_credentials_never_open_another_keys_stream(
    guarded_client: httpx.Client, headers: dict[str, str], grant: str | None, method: str
) -> None:
    """The probe's: with two keys, either could read and delete the other's streams, and so could a caller with no
    key. Only the creator's key (or the stream's own grant, drawn never) opens one."""
    client = guarded_client
    created = client.post("/streams", json={"prompt": "hi"}, headers={"X-API-Key": ALICE})
    assert created.status_code == 201
    params = {} if grant is None else {"grant": grant}
    response = client.request(method, f"/streams/{created.json()['id']}", params=params, headers=headers)
    client.delete(created.json()["url"])
    owner = headers.get("Authorization") == f"Bearer {ALICE}"
    if owner:
        assert response.status_code in (200, 204), response.text
    elif headers.get("X-API-Key") == BOB:
        assert response.status_code == 404, response.text
    else:
        assert response.status_code == 401, response.text
