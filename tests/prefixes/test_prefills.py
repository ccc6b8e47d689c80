"""ttft_sse/prefixes/prefills.py over the scripted engine, whose prompt steps have a known cost (``prompt_delay``): a
prefill takes no slot and computes nothing while a request waits for one, so the waiting request is admitted and
answered as it would be without it; the prefill goes on after."""

from __future__ import annotations

import time

import httpx

from tests.support.servers import StreamReader, eventually, fake_app, running
from ttft_sse.engine.fake import FakeEngine

LONG = " ".join(f"word{i}" for i in range(120))  # 15 scripted steps


def test_a_prefill_never_makes_a_waiting_request_wait_longer() -> None:
    engine = FakeEngine(("a", "b", "c"), hold_after=1, prompt_delay=0.002, context_length=512)
    app = fake_app(engine, max_concurrency=1)
    with running(app) as base:
        gate = app.state.runtime.gate
        holder = StreamReader(f"{base}/stream", params={"prompt": "first"})
        eventually(lambda: gate.running == 1)
        waiting = StreamReader(f"{base}/stream", params={"prompt": "second"})
        eventually(lambda: gate.waiting == 1)
        accepted = httpx.post(f"{base}/prefill", json={"prompt": LONG})
        assert accepted.status_code == 202
        assert accepted.json() == {"prompt_tokens": 119, "cached_tokens": 0}
        assert gate.running == 1 and gate.waiting == 1  # the prefill took no slot and no queue place
        time.sleep(0.3)  # ample time for the prefill's 15 steps of 16 ms
        assert engine.prefill_steps == 0  # nothing computed while a request waits for a slot
        engine.release.set()
        assert holder.rest()[-1].event == "done"
        events = waiting.rest()
        assert [e.event for e in events] == ["queued", "token", "token", "token", "done"]
        eventually(lambda: engine.prefills == [("done", 119)])
        assert engine.prefill_steps == 15


def test_a_newer_prefill_of_the_session_supersedes_the_older_one() -> None:
    engine = FakeEngine(prompt_delay=0.05, context_length=512)
    with running(fake_app(engine, prefill_per_key=1)) as base:
        assert httpx.post(f"{base}/prefill", json={"prompt": LONG}, headers={"X-Prefill-Session": "a"}).is_success
        other = httpx.post(f"{base}/prefill", json={"prompt": "x " + LONG}, headers={"X-Prefill-Session": "b"})
        assert other.status_code == 429 and other.headers["Retry-After"] == "1"
        assert other.json()["error"]["type"] == "rate_limit_error"
        newer = httpx.post(f"{base}/prefill", json={"prompt": "x " + LONG}, headers={"X-Prefill-Session": "a"})
        assert newer.status_code == 202
        eventually(lambda: len(engine.prefills) == 2, timeout=30)
        (first, stopped), second = engine.prefills
        assert first == "cancelled" and stopped < 119 and second == ("done", 120)
