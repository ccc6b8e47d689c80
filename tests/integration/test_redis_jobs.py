"""The Redis job store and the worker's job runner against a real redis-server, with the fake engine in-process.

Two apps share one Redis URL: a job submitted on one is answered by the other. The worker side (``JobRunner``)
is driven directly here, so every step of the state machine (claim, heartbeat, fencing, take-over, give-up,
cancel, expiry) is checked without a Celery process; ``test_celery_workers.py`` runs the real thing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.support.processes import wait_until
from tests.support.servers import free_port, running
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings
from ttft_sse.stores.jobs_redis import QUEUE, key_of
from ttft_sse.worker import JobRunner


def settings_for(url: str, **changes: Any) -> Settings:
    return Settings(redis_url=url, warmup=False, job_lease_seconds=1.0, job_attempts=2, **changes)


@pytest.fixture
def servers(redis_url: str, r: redis.Redis) -> Iterator[tuple[str, str]]:
    """Two servers sharing the Redis URL (the fake engine only validates; jobs run on a worker)."""
    with (
        running(create_app(settings_for(redis_url), FakeEngine())) as one,
        running(create_app(settings_for(redis_url), FakeEngine())) as two,
    ):
        yield one, two


def runner_for(url: str, engine: FakeEngine | None = None, **changes: Any) -> JobRunner:
    runner = JobRunner(settings_for(url, **changes), engine or FakeEngine())
    runner.start()
    return runner


def submit(base: str, body: dict[str, Any] | None = None) -> str:
    response = httpx.post(f"{base}/jobs", json=body or {"prompt": "say hello"})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def view(base: str, job_id: str) -> dict[str, Any]:
    response = httpx.get(f"{base}/result/{job_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_submitted_on_one_server_run_by_a_worker_answered_by_another(
    servers: tuple[str, str], redis_url: str, r: redis.Redis
) -> None:
    one, two = servers
    job_id = submit(one, {"prompt": "say hello", "max_tokens": 3})
    assert r.llen(QUEUE) == 1  # a Celery message, waiting for a worker
    queued = view(two, job_id)
    assert (queued["status"], queued["attempts"]) == ("queued", 0)
    assert r.ttl(key_of(job_id)) == -1  # an unfinished job does not expire

    runner = runner_for(redis_url)
    try:
        assert runner.run(job_id) == "done"
        assert runner.run(job_id) == "final"  # a second delivery of the same message runs nothing
    finally:
        runner.close()
    done = view(two, job_id)
    assert (done["status"], done["text"], done["finish_reason"], done["attempts"]) == (
        "done",
        "Hello, world",
        "length",
        1,
    )
    assert {**done["usage"], "cached_tokens": 0} == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "cached_tokens": 0,
    }
    assert {"wait_ms", "queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "total_ms"} <= set(done["timings"])
    assert view(one, job_id) == done
    assert 0 < r.ttl(key_of(job_id)) <= 600  # finished: kept for TTFT_JOB_TTL_SECONDS
    assert r.lrange("ttft:job-durations", 0, -1) != []


def test_cancel_while_queued_and_while_running(servers: tuple[str, str], redis_url: str, r: redis.Redis) -> None:
    one, two = servers
    queued = submit(one)
    cancelled = httpx.delete(f"{two}/jobs/{queued}").json()
    assert (cancelled["status"], cancelled["started"]) == ("cancelled", None)
    engine = FakeEngine(hold_after=1)
    runner = runner_for(redis_url, engine)
    try:
        assert runner.run(queued) == "final"
        assert engine.generated == []  # never started

        busy = submit(one)
        outcome: list[str] = []
        thread = threading.Thread(target=lambda: outcome.append(runner.run(busy)))
        thread.start()
        wait_until(lambda: view(two, busy)["tokens"] == 1, timeout=20, what="the job's first token to be recorded")
        assert view(one, busy)["status"] == "running"
        assert httpx.delete(f"{one}/jobs/{busy}").json()["status"] == "cancelled"
        thread.join(20)
        assert outcome == ["cancelled"]  # the runner saw it at its next heartbeat and stopped generating
        assert engine.active == 0 and engine.generated == [1]
        again = httpx.delete(f"{two}/jobs/{busy}")  # cancelling twice: the same answer, not an error
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
    finally:
        engine.release.set()
        runner.close()


def test_a_stale_attempt_is_taken_over_fenced_out_and_given_up_after_the_attempt_limit(
    servers: tuple[str, str], redis_url: str, r: redis.Redis
) -> None:
    one, _ = servers
    job_id = submit(one)
    key = key_of(job_id)
    # Attempt 1 is "running" on a machine that has gone quiet: its heartbeat is older than the lease (1 s).
    r.hset(key, mapping={"status": "running", "attempts": 1, "heartbeat": time.time() - 5, "worker": "gone"})
    shown = view(one, job_id)
    assert shown["status"] == "queued"  # shown as waiting for a worker, not as running
    assert shown["note"] == "its worker stopped sending heartbeats; the job will run again on another worker"

    runner = runner_for(redis_url)
    try:
        r.hset(key, "heartbeat", time.time())  # a fresh heartbeat: the attempt is alive, a duplicate must not run
        assert runner.run(job_id) == "busy"
        assert r.hget(key, "attempts") == "1"

        r.hset(key, "heartbeat", time.time() - 5)
        assert runner.run(job_id) == "done"
        done = view(one, job_id)
        assert (done["status"], done["attempts"]) == ("done", 2)
        assert done["note"] == "attempt 1 stopped sending heartbeats; it was run again"

        # Fencing: attempt 1 waking up now can change nothing.
        update = r.register_script(
            "local f = redis.call('HMGET', KEYS[1], 'status', 'attempts') return f[1] .. '/' .. f[2]"
        )
        assert update(keys=[key]) == "done/2"

        # Lost as many times as TTFT_JOB_ATTEMPTS (2): failed with the reason, not retried forever.
        again = submit(one)
        r.hset(key_of(again), mapping={"status": "running", "attempts": 2, "heartbeat": 0, "worker": "gone"})
        assert runner.run(again) == "failed"
        failed = view(one, again)
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "worker_lost"
        assert failed["error"]["message"] == (
            "the job was started 2 times and each time its worker was lost before it finished"
        )
        assert 0 < r.ttl(key_of(again)) <= 600
    finally:
        runner.close()


def test_the_worker_main_process_marks_a_job_whose_pool_process_died(redis_url: str, r: redis.Redis) -> None:
    from ttft_sse.stores.jobs_redis import LOST

    key = key_of("f" * 32)
    host = socket.gethostname()
    r.hset(key, mapping={"status": "running", "worker": host, "worker_pid": 4242, "created": 0, "attempts": 1})
    assert r.eval(LOST, 1, key, host, 4243, "note") == "running"  # another process's job: untouched
    assert r.eval(LOST, 1, key, host, 4242, "attempt lost: died") == "queued"
    assert r.hmget(key, "status", "note") == ["queued", "attempt lost: died"]


def test_a_foreign_or_unknown_job_is_404_and_a_job_request_without_redis_is_503(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    keys = "alice-key-0001,bob-key-00002"
    with running(create_app(settings_for(redis_url, api_keys=keys), FakeEngine())) as base:
        alice, bob = {"X-API-Key": "alice-key-0001"}, {"X-API-Key": "bob-key-00002"}
        job_id = httpx.post(f"{base}/jobs", json={"prompt": "hi"}, headers=alice).json()["id"]
        assert str(r.hget(key_of(job_id), "owner")).startswith("key-")  # the key's id, never the key
        assert "alice-key-0001" not in json.dumps(r.hgetall(key_of(job_id)))
        assert httpx.get(f"{base}/result/{job_id}", headers=bob).status_code == 404
        assert httpx.delete(f"{base}/jobs/{job_id}", headers=bob).status_code == 404
        assert httpx.get(f"{base}/result/{job_id}", headers=alice).status_code == 200
        assert httpx.get(f"{base}/result/{'e' * 32}", headers=alice).status_code == 404
        assert httpx.get(f"{base}/result/NOT-AN-ID", headers=alice).status_code == 404

    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    with running(create_app(settings_for(nowhere), FakeEngine())) as base:
        response = httpx.post(f"{base}/jobs", json={"prompt": "hi"}, timeout=30)
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "the job queue (Redis) cannot be reached; try again shortly"
        assert response.headers["retry-after"] == "5"
        assert httpx.get(f"{base}/result/{'e' * 32}", timeout=30).status_code == 503
