"""Embedded overflow jobs, in-process with the fake engine: the API, cancellation, bounds, expiry, ownership."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.support.processes import wait_until
from ttft_sse.admission.auth import ANONYMOUS
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.runtime import Runtime
from ttft_sse.settings import Settings, SettingsError
from ttft_sse.stores.jobs import EmbeddedJobs

VIEW_KEYS = {"id", "status", "created", "started", "finished", "attempts", "tokens", "result_url"}


def started(client: TestClient) -> TestClient:
    wait_until(lambda: client.get("/readyz").status_code == 200, timeout=10, what="readiness")
    return client


def submit(client: TestClient, body: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    response = client.post("/jobs", json=body or {"prompt": "say hello"}, **kwargs)
    assert response.status_code == 202, response.text
    view: dict[str, Any] = response.json()
    assert response.headers["location"] == f"/result/{view['id']}" == view["result_url"]
    return view


def poll(client: TestClient, job_id: str, *statuses: str, **kwargs: Any) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        view: dict[str, Any] = client.get(f"/result/{job_id}", **kwargs).json()
        return view if view["status"] in statuses else None

    found = wait_until(check, timeout=10, what=f"job {job_id} to be {' or '.join(statuses)}", every=0.01)
    assert isinstance(found, dict)
    return found


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = Settings(max_tokens_cap=100, default_max_tokens=10)
    with TestClient(create_app(settings, FakeEngine(context_length=20)), raise_server_exceptions=False) as c:
        yield started(c)


def test_a_job_is_accepted_at_once_and_its_result_has_text_usage_and_timings(client: TestClient) -> None:
    queued = submit(client)
    assert set(queued) == VIEW_KEYS
    assert queued["status"] == "queued" and len(queued["id"]) == 32
    done = poll(client, queued["id"], "done")
    assert set(done) == VIEW_KEYS | {"text", "finish_reason", "usage", "timings", "degraded"}
    assert (done["text"], done["finish_reason"]) == ("Hello, world!", "stop")
    assert done["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6, "cached_tokens": 0}
    assert (done["attempts"], done["tokens"]) == (1, 4)
    assert {"wait_ms", "queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "total_ms"} <= set(done["timings"])
    assert done["created"] <= done["started"] <= done["finished"]


def test_the_job_body_is_the_complete_body(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": ["zzz"]}
    done = poll(client, submit(client, body)["id"], "done")
    assert (done["text"], done["finish_reason"]) == ("Hello,", "length")
    assert done["text"] == client.post("/complete", json=body).json()["text"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "prompt", "prompt or messages is required"),
        ({"prompt": "hi", "max_tokens": 101}, "max_tokens", "between 1 and 100, got 101"),
        ({"prompt": "hi", "colour": "red"}, "colour", "unknown field(s): colour"),
        ({"prompt": " ".join(["w"] * 25)}, "prompt", "the prompt is 25 tokens; the model's context is 20"),
        ({"prompt": " ".join(["w"] * 15), "max_tokens": 10}, "max_tokens", "lower max_tokens to 5"),
    ],
)
def test_a_bad_job_is_refused_at_submission_not_failed_later(
    client: TestClient, body: dict[str, Any], param: str, message: str
) -> None:
    response = client.post("/jobs", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_unknown_malformed_and_misrouted_job_requests_are_clear_4xx(client: TestClient) -> None:
    missing = "0" * 32
    for response in (client.get(f"/result/{missing}"), client.delete(f"/jobs/{missing}")):
        assert response.status_code == 404
        assert response.json()["error"]["message"] == (
            f"no job '{missing}': it never existed, has expired, or belongs to another API key"
        )
    assert client.get("/result/not-an-id").status_code == 404
    assert client.get("/result/").status_code == 404
    assert client.get("/jobs").json()["error"]["message"] == "method GET is not allowed on /jobs"
    assert client.post("/jobs", content=b"{nope", headers={"content-type": "application/json"}).status_code == 400
    done = poll(client, submit(client)["id"], "done")
    conflict = client.delete(f"/jobs/{done['id']}")
    assert conflict.status_code == 409
    assert conflict.json()["error"]["type"] == "conflict_error"
    assert "has already ended (done); there is nothing to cancel" in conflict.json()["error"]["message"]


def test_cancelling_a_queued_and_a_running_job_stops_the_generation() -> None:
    engine = FakeEngine(hold_after=1)
    with TestClient(create_app(Settings(job_runners=1, warmup=False), engine)) as client:
        running = submit(started(client))
        poll(client, running["id"], "running")
        wait_until(lambda: client.get(f"/result/{running['id']}").json()["tokens"] == 1, timeout=10, what="a token")
        queued = submit(client)
        assert client.get(f"/result/{queued['id']}").json()["status"] == "queued"

        cancelled = client.delete(f"/jobs/{queued['id']}").json()
        assert cancelled["status"] == "cancelled" and cancelled["started"] is None
        assert client.delete(f"/jobs/{running['id']}").json()["status"] == "cancelled"
        assert client.delete(f"/jobs/{running['id']}").json()["status"] == "cancelled"  # again: same answer
        wait_until(lambda: engine.active == 0, timeout=10, what="the cancelled job's generation thread to end")
        assert engine.generated == [1]  # the job stopped after its one token (no warm-up: it would hold too)

        engine.release.set()
        after = poll(client, submit(client)["id"], "done")  # the runner is free again
        assert after["text"] == "Hello, world!"
        assert client.get(f"/result/{running['id']}").json()["status"] == "cancelled"  # never overwritten


def test_past_max_jobs_queued_a_submission_is_503_with_retry_after() -> None:
    engine = FakeEngine(hold_after=0)
    with TestClient(create_app(Settings(job_runners=1, max_jobs=1, warmup=False), engine)) as client:
        running = submit(started(client))
        poll(client, running["id"], "running")
        submit(client)  # queued: the one place
        refused = client.post("/jobs", json={"prompt": "one more"})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == "1 jobs are already queued (the limit is 1)"
        assert int(refused.headers["retry-after"]) >= 1
        engine.release.set()


def test_a_finished_job_expires_after_the_ttl() -> None:
    now = [1_000_000.0]
    app = create_app(Settings(job_ttl_seconds=600), FakeEngine())
    runtime: Runtime = app.state.runtime
    runtime.jobs = EmbeddedJobs(runtime.settings, runtime.generations, clock=lambda: now[0])
    with TestClient(app) as client:
        job = poll(client, submit(started(client))["id"], "done")
        assert job["finished"] == now[0]
        now[0] += 599.5
        assert client.get(f"/result/{job['id']}").status_code == 200
        now[0] += 1
        assert client.get(f"/result/{job['id']}").status_code == 404
        assert client.delete(f"/jobs/{job['id']}").status_code == 404


def test_a_job_is_visible_only_to_the_key_that_submitted_it() -> None:
    alice, bob = {"X-API-Key": "alice-key-0001"}, {"X-API-Key": "bob-key-00002"}
    settings = Settings(api_keys="alice-key-0001:high,bob-key-00002")
    with TestClient(create_app(settings, FakeEngine())) as client:
        started(client)
        job = submit(client, headers=alice)
        assert client.get(f"/result/{job['id']}", headers=bob).status_code == 404
        assert client.delete(f"/jobs/{job['id']}", headers=bob).status_code == 404
        assert client.get(f"/result/{job['id']}").status_code == 401
        assert poll(client, job["id"], "done", headers=alice)["text"] == "Hello, world!"


def test_jobs_left_at_shutdown_end_failed_with_the_reason() -> None:
    engine = FakeEngine(hold_after=0)
    app = create_app(Settings(job_runners=1, warmup=False), engine)  # the warm-up would hold too
    with TestClient(app) as client:
        running = submit(started(client))
        poll(client, running["id"], "running")
        queued = submit(client)
    jobs = app.state.runtime.jobs
    for job_id, when in ((running["id"], "while it ran"), (queued["id"], "before it ran")):
        job = asyncio.run(jobs.get(job_id, ANONYMOUS))
        assert job.status == "failed"
        assert job.error["code"] == "shutdown"
        assert job.error["message"].startswith(f"the server shut down {when}")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TTFT_REDIS_URL": "localhost:6379"}, "redis_url must start with redis://, rediss:// or unix://"),
        ({"TTFT_REDIS_URL": "http://user:hunter2@host"}, "redis_url must start with"),
        ({"TTFT_JOB_RUNNERS": "0"}, "job_runners must be at least 1, got 0"),
        ({"TTFT_MAX_JOBS": "0"}, "max_jobs must be at least 1, got 0"),
        ({"TTFT_JOB_ATTEMPTS": "0"}, "job_attempts must be at least 1, got 0"),
        ({"TTFT_JOB_TTL_SECONDS": "0"}, "job_ttl_seconds must be more than 0"),
        ({"TTFT_JOB_LEASE_SECONDS": "-1"}, "job_lease_seconds must be more than 0"),
    ],
)
def test_bad_job_settings_are_refused_with_a_sentence(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    assert message in str(info.value)
    assert "hunter2" not in str(info.value)  # a Redis URL may carry a password: never echoed


def test_job_settings_from_the_environment() -> None:
    env = {
        "TTFT_REDIS_URL": "redis://127.0.0.1:6380/2",
        "TTFT_JOB_RUNNERS": "2",
        "TTFT_MAX_JOBS": "50",
        "TTFT_JOB_TTL_SECONDS": "60",
        "TTFT_JOB_LEASE_SECONDS": "10",
        "TTFT_JOB_ATTEMPTS": "5",
    }
    s = Settings.from_env(env)
    assert (s.redis_url, s.job_runners, s.max_jobs, s.job_ttl_seconds, s.job_lease_seconds, s.job_attempts) == (
        "redis://127.0.0.1:6380/2",
        2,
        50,
        60.0,
        10.0,
        5,
    )
