"""The Host allow-list (ttft_sse/http/hosts.py, TTFT_ALLOWED_HOSTS) and what /readyz shows an anonymous caller.

In-process (the scripted engine): a Host header is a header, whichever client sends it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.support.servers import ALICE, TWO_KEYS
from ttft_sse.app import create_app
from ttft_sse.engine.base import ModelInfo
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.http.hosts import default_allowed_hosts, parse_hosts
from ttft_sse.settings import Settings, SettingsError

LOOPBACK = "localhost,127.0.0.1,[::1]"


def test_serve_answers_only_loopback_names_when_it_listens_on_loopback_and_any_name_elsewhere() -> None:
    assert Settings.from_env({}).allowed_hosts == LOOPBACK  # the default host, 127.0.0.1
    assert Settings.from_env({}, host="localhost").allowed_hosts == LOOPBACK
    assert Settings.from_env({"TTFT_HOST": "::1"}).allowed_hosts == LOOPBACK
    assert Settings.from_env({}, host="127.0.0.2").allowed_hosts == LOOPBACK + ",127.0.0.2"
    assert Settings.from_env({"TTFT_HOST": "0.0.0.0"}).allowed_hosts == "*"
    assert Settings.from_env({"TTFT_HOST": "192.168.1.4"}).allowed_hosts == "*"
    told = Settings.from_env({"TTFT_HOST": "127.0.0.1", "TTFT_ALLOWED_HOSTS": "chat.example.com, *.example.org"})
    assert told.allowed_hosts == "chat.example.com, *.example.org"
    assert parse_hosts(told.allowed_hosts) == ("chat.example.com", "*.example.org")
    assert Settings().allowed_hosts is None  # built in code: any Host, unless told
    assert default_allowed_hosts("::") == "*"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (" , ", "names no host"),
        ("a.*.example.com", "is not a name"),
        ("*example.com", "is not a name"),
        ("::1", "in brackets"),
    ],
)
def test_a_malformed_allow_list_stops_the_server_with_a_sentence(spec: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({"TTFT_ALLOWED_HOSTS": spec})


def ready(client: TestClient, **headers: str) -> Any:
    deadline = time.monotonic() + 10
    while (response := client.get("/readyz", headers=headers)).status_code != 200:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.01)
    return response


@pytest.fixture(scope="module")
def loopback() -> Iterator[TestClient]:
    app = create_app(Settings(warmup=False, allowed_hosts=LOOPBACK), FakeEngine())
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        ready(client)
        yield client


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "LOCALHOST:80", "[::1]:8000"])
def test_the_loopback_names_are_answered(loopback: TestClient, host: str) -> None:
    assert loopback.get("/stream", params={"prompt": "hi"}, headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["rebound.example.com", "rebound.example.com:8000", "127.0.0.1.nip.io", "10.0.0.7"])
def test_another_name_is_a_json_400_before_anything_runs(loopback: TestClient, host: str) -> None:
    """The probe's: any Host was answered, so a page elsewhere could reach a keyless server on its visitor's machine
    by DNS rebinding and start generations with GET /stream."""
    for method, path in (("GET", "/stream?prompt=hi"), ("POST", "/streams"), ("GET", "/"), ("GET", "/v1/models")):
        response = loopback.request(method, path, headers={"Host": host}, json={"prompt": "hi"})
        assert response.status_code == 400, (method, path)
        assert response.json()["error"] == {
            "message": "this server does not answer to the name in the Host header (TTFT_ALLOWED_HOSTS)",
            "type": "invalid_request_error",
            "param": "Host",
            "code": "invalid_host",
        }


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_the_probes_answer_an_address_as_kubernetes_sends_the_pods_but_not_another_name(
    loopback: TestClient, path: str
) -> None:
    for host in ("10.244.1.7:8000", "10.244.1.7", "[fd00::7]:8000"):
        assert loopback.get(path, headers={"Host": host}).status_code == 200, host
    assert loopback.get(path, headers={"Host": "rebound.example.com"}).status_code == 400
    assert loopback.get("/stream?prompt=hi", headers={"Host": "10.244.1.7:8000"}).status_code == 400


def test_a_websocket_to_another_name_is_closed_before_it_opens() -> None:
    from starlette.websockets import WebSocketDisconnect

    app = create_app(Settings(warmup=False, allowed_hosts=LOOPBACK), FakeEngine())
    with (
        TestClient(app, base_url="http://rebound.example.com") as client,
        pytest.raises(WebSocketDisconnect) as closed,
        client.websocket_connect("/anything"),
    ):
        pass
    assert closed.value.code == 1008


class PathEngine(FakeEngine):
    """The scripted engine, claiming a model file at an absolute path."""

    @property
    def info(self) -> ModelInfo:
        from dataclasses import replace

        return replace(super().info, source="/home/someone/models/secret-project.Q4_K_M.gguf")


@pytest.mark.parametrize("keys", [None, TWO_KEYS], ids=["keyless", "keys"])
def test_readyz_shows_the_models_path_as_its_file_name_to_callers_without_a_key(keys: str | None) -> None:
    """The probe's: /readyz showed the model's absolute path on the host to anyone."""
    with TestClient(create_app(Settings(warmup=False, api_keys=keys), PathEngine())) as client:
        anonymous = ready(client).json()["source"]
        wrong = ready(client, **{"X-API-Key": "not-a-key-at-all"}).json()["source"]
        keyed = ready(client, Authorization=f"Bearer {ALICE}").json()["source"]
    assert anonymous == wrong == "secret-project.Q4_K_M.gguf"
    assert keyed == ("/home/someone/models/secret-project.Q4_K_M.gguf" if keys else anonymous)
