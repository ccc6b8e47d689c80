"""A server started with ``TTFT_INT4_WEIGHTS=true`` as a user starts it: real hypercorn, the bundled model."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from tests.servers import running, stream_events
from ttft_sse.settings import Settings

torch = pytest.importorskip("torch")


@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="the engine uses torch's CPU int4 kernel only with AVX-512",
)
def test_an_int4_server_says_so_when_ready_and_streams_the_right_answer(settings: Settings) -> None:
    from ttft_sse.app import create_app

    app = create_app(dataclasses.replace(settings, int4_weights=True))
    with running(app) as base, httpx.Client(timeout=60) as client:
        ready = client.get(f"{base}/readyz").json()
        assert (ready["status"], ready["weights"], ready["dtype"]) == ("ready", "int4+bf16-packed", "float32")
        body = {"prompt": "What is the capital of France?", "max_tokens": 12}
        events = stream_events(client, "POST", f"{base}/stream", json=body)
        complete = client.post(f"{base}/complete", json=body).json()
    tokens = [e.data["text"] for e in events if e.event == "token"]
    done = events[-1]
    assert done.event == "done" and done.data["finish_reason"] == "stop"  # the answer ended before 12 tokens
    assert "Paris" in "".join(tokens)
    # One request at a time: the same steps, so the same greedy text streamed or not.
    assert complete["text"] == "".join(tokens)
