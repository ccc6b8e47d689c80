"""API keys: parsing (env and file), lookup, and 401 on every generating endpoint. In-process, with the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.support.processes import wait_until
from ttft_sse.admission.auth import ANONYMOUS, Caller, Keyring, key_id, parse_keys
from ttft_sse.admission.gate import Lane
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.errors import Unauthorized
from ttft_sse.settings import Settings, SettingsError

VIP = "vip-secret-0001"
USER = "user-secret-0002"


def test_entries_map_keys_to_lanes_with_normal_by_default() -> None:
    keys = parse_keys(f" {VIP}:high , {USER},slow-secret-03:LOW ")
    assert keys == {VIP: Lane.HIGH, USER: Lane.NORMAL, "slow-secret-03": Lane.LOW}
    assert parse_keys("a:b:c:secret:normal") == {"a:b:c:secret": Lane.NORMAL}  # the last colon names the lane


def test_a_key_file_holds_one_entry_a_line_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# who may generate\n{VIP}:high   # the VIP\n\n{USER}\n")
    assert parse_keys(f"@{path}") == {VIP: Lane.HIGH, USER: Lane.NORMAL}
    settings = Settings.from_env({"TTFT_API_KEYS": f"@{path}"})
    assert Keyring.from_spec(settings.api_keys).identify(VIP) == Caller(Lane.HIGH, key_id(VIP))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"{VIP}:urgent", "entry 1 names lane 'urgent'; lanes are high, normal, low"),
        (f"{VIP}, short", "entry 2 is not a usable key: use at least 8 printable ASCII"),
        (f"{VIP}:high,{VIP}:low", "entry 2 repeats an earlier key"),
        (" , ", "holds no keys; leave it unset for an open server"),
        ("@/nonexistent/keys", "cannot read the API key file '/nonexistent/keys'"),
    ],
)
def test_bad_key_settings_are_refused_without_quoting_any_key(spec: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"TTFT_API_KEYS": spec})
    assert message in str(info.value)
    assert VIP not in str(info.value)


def test_settings_repr_never_shows_the_keys() -> None:
    settings = Settings(api_keys=f"{VIP}:high")
    assert VIP not in repr(settings)
    assert settings.api_keys == f"{VIP}:high"


def test_keyring_lookup() -> None:
    assert Keyring().identify(None) is ANONYMOUS  # open server: everyone is anonymous, normal lane
    ring = Keyring({VIP: Lane.HIGH})
    assert ring.identify(VIP) == Caller(Lane.HIGH, key_id(VIP))
    assert key_id(VIP).startswith("key-") and len(key_id(VIP)) == 12 and VIP not in key_id(VIP)
    with pytest.raises(Unauthorized, match="an API key is required"):
        ring.identify(None)
    with pytest.raises(Unauthorized, match="the API key is not valid"):
        ring.identify(USER)


@pytest.fixture(scope="module")
def keyed() -> Iterator[TestClient]:
    settings = Settings(api_keys=f"{VIP}:high,{USER}", default_max_tokens=4)
    with TestClient(create_app(settings, FakeEngine()), raise_server_exceptions=False) as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=10, what="readiness")
        yield client


GENERATING = [
    ("POST", "/complete"),
    ("POST", "/stream"),
    ("GET", "/stream?prompt=hi"),
    ("POST", "/jobs"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
]


@pytest.mark.parametrize(("method", "path"), GENERATING)
@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer not-a-real-key"}, "invalid_api_key"),
        ({"X-API-Key": "not-a-real-key"}, "invalid_api_key"),
        ({"Authorization": f"Basic {VIP}"}, "invalid_api_key"),
    ],
)
def test_generating_without_a_valid_key_is_401_before_the_body_is_read(
    keyed: TestClient, method: str, path: str, headers: dict[str, str], code: str
) -> None:
    # The body is invalid too: authentication is checked first, so a stranger learns nothing about it.
    response = keyed.request(method, path, headers=headers, json={"prompt": ""} if method == "POST" else None)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == 'Bearer realm="ttft-sse"'
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", code)
    assert "not-a-real-key" not in response.text and VIP not in response.text


def test_a_valid_key_in_either_header_generates(keyed: TestClient) -> None:
    for headers in ({"Authorization": f"Bearer {VIP}"}, {"X-API-Key": USER}, {"authorization": f"bearer {USER}"}):
        response = keyed.post("/complete", json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["text"] == "Hello, world!"
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    response = keyed.post("/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {VIP}"})
    assert response.status_code == 200, response.text  # what OpenAI clients send: their api_key as a Bearer token


def test_health_and_readiness_need_no_key(keyed: TestClient) -> None:
    assert keyed.get("/healthz").status_code == 200
    assert keyed.get("/readyz").status_code == 200


def test_an_open_server_needs_no_key() -> None:
    with TestClient(create_app(Settings(), FakeEngine())) as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=10, what="readiness")
        assert client.post("/complete", json={"prompt": "hi"}).json()["text"] == "Hello, world!"
        # A key sent to an open server is ignored, not refused.
        assert client.post("/complete", json={"prompt": "hi"}, headers={"X-API-Key": "whatever"}).status_code == 200
