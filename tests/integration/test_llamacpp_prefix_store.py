"""``TTFT_PREFIX_STORE_MB`` on servers of the llama.cpp engine (``TTFT_ENGINE=llamacpp``) with the real model: SIGTERM
writes the free sequences' KV to the prefix file, and the next start reads it back in its ``prefix_store`` stage,
before ``/readyz`` turns 200, so that its first request finds the prompt cached and answers as the cold server did.
The corrupt and foreign files: tests/engine/llamacpp/test_prefix_store.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.engines import llama_cpp_or_skip
from tests.support.servers import running, serving
from ttft_sse.app import create_app
from ttft_sse.engine.llamacpp.prefix_store import PrefixStore
from ttft_sse.runtime import shutdown_budget
from ttft_sse.settings import Settings

SYSTEM = " ".join(f"Rule {i} of the lighthouse museum desk: answer briefly and kindly." for i in range(10))
BODY = {
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When does the museum open?"}],
    "max_tokens": 16,
}


def complete(base: str) -> dict[str, Any]:
    reply = httpx.post(f"{base}/complete", json=BODY, timeout=120)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def test_sigterm_writes_the_kept_sequences_and_the_next_start_reads_them_back_before_ready(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama_cpp_or_skip()
    path = tmp_path / "prefixes.safetensors"
    monkeypatch.setattr(PrefixStore, "path", lambda self, info: path)
    store = settings.replace(engine="llamacpp", prefix_store_mb=64)
    with serving(create_app(store)) as served:
        cold = complete(served.base)
        served.stop()  # SIGTERM
        assert served.wait_stopped(shutdown_budget(store.drain_seconds) + 30)
    assert path.is_file()
    with running(create_app(store)) as base:
        startup = list(httpx.get(f"{base}/readyz").json()["startup"])
        warm = complete(base)  # the restarted server's first request
    assert startup.index("warmup_ms") < startup.index("prefix_store_ms")
    assert cold["usage"]["cached_tokens"] < 8  # at most the chat template's opening, from the warm-up
    assert warm["usage"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
    assert warm["text"] == cold["text"] and warm["finish_reason"] == cold["finish_reason"]
