"""``ttft-sse serve`` as a subprocess, with the real model and API keys: 401s, lanes, embedded jobs, clean logs.

A subprocess, so that its log output is exactly what an operator would see, and can be searched for the keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.paths import CACHE_DIR
from tests.support.processes import Proc, serve, wait_until
from tests.support.servers import stream_events

VIP, USER = "vip-secret-key-0001", "user-secret-key-0002"
BODY = {"prompt": "What is the capital of France?", "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc]]:
    tmp = tmp_path_factory.mktemp("keys")
    keyfile = tmp / "keys"
    keyfile.write_text(f"# lanes for the test\n{VIP}:high\n{USER}:normal\n")
    settings = {"TTFT_API_KEYS": f"@{keyfile}", "TTFT_CACHE_DIR": str(CACHE_DIR), "TTFT_LOG_LEVEL": "debug"}
    with serve(Path(tmp), settings) as running:
        yield running


def test_keys_lanes_and_an_embedded_job_with_the_real_model(server: tuple[str, Proc]) -> None:
    base, proc = server
    vip, user = {"Authorization": f"Bearer {VIP}"}, {"X-API-Key": USER}

    assert httpx.post(f"{base}/complete", json=BODY).status_code == 401
    wrong = httpx.post(f"{base}/stream", json=BODY, headers={"X-API-Key": "a-wrong-key-0003"})
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")

    complete = httpx.post(f"{base}/complete", json=BODY, headers=vip, timeout=120)
    assert complete.status_code == 200, complete.text
    text: str = complete.json()["text"]
    assert "Paris" in text

    with httpx.Client(timeout=120) as client:
        events = stream_events(client, "POST", f"{base}/stream", json=BODY, headers=user)
    assert "".join(e.data["text"] for e in events if e.event == "token") == text  # greedy: the same answer

    submitted = httpx.post(f"{base}/jobs", json=BODY, headers=user)
    assert submitted.status_code == 202
    job_id = submitted.json()["id"]
    assert httpx.get(f"{base}/result/{job_id}", headers=vip).status_code == 404  # not the VIP's job

    def finished() -> dict[str, Any] | None:
        view: dict[str, Any] = httpx.get(f"{base}/result/{job_id}", headers=user).json()
        return view if view["status"] in ("done", "failed", "cancelled") else None

    done = wait_until(finished, timeout=120, what="the job to finish")
    assert isinstance(done, dict)
    assert (done["status"], done["text"], done["attempts"]) == ("done", text, 1)
    # the job's prompt is cached from the requests before it: all but the cached tokens is the same
    assert {**done["usage"], "cached_tokens": 0} == {**complete.json()["usage"], "cached_tokens": 0}

    log = proc.log()
    for secret in (VIP, USER, "a-wrong-key-0003"):
        assert secret not in log
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    generations = {(g["endpoint"], g["lane"]) for g in lines if g.get("event") == "generation"}
    assert {("complete", "high"), ("stream", "normal"), ("job", "jobs")} <= generations
    assert all(g["key_id"].startswith("key-") for g in lines if g.get("event") == "generation" and g["key_id"])
