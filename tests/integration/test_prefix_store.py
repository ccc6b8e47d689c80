"""``TTFT_PREFIX_STORE_MB`` on real ``ttft-sse serve`` processes with the real model: SIGTERM writes the prefixes' KV
to the cache directory, the next start reads it back before ``/readyz`` turns 200 (its first request finds the
prompt cached and answers as the cold server did), and a file that is corrupt or another server's is ignored with a
log line, the server starting cold.

The file lives in the suite's cache directory, at the bundled model's path (engine/batched/prefix_store.py's
``path_of``); the module removes it before and after."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_prefill import QUESTION, chat, system_prompt
from tests.support.paths import CACHE_DIR
from tests.support.processes import Proc, start_server, wait_server_ready
from ttft_sse.engine.batched.prefix_store import path_of
from ttft_sse.engine.loading.sources import bundled_gguf

SYSTEM = system_prompt("archive")
STORE = {"TTFT_CACHE_DIR": str(CACHE_DIR), "TTFT_PREFIX_STORE_MB": "64"}


def events(proc: Proc, name: str | None = None) -> list[dict[str, Any]]:
    logged = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
    return [e for e in logged if name is None or e["event"] == name]


def complete(base: str) -> dict[str, Any]:
    reply = httpx.post(f"{base}/complete", json={"messages": chat(SYSTEM, QUESTION), "max_tokens": 16}, timeout=300)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def whole(tokens: int) -> int:
    """The prompt tokens a request finds in whole blocks of 4 at most (it computes its last token itself)."""
    return (tokens - 1) // 4 * 4


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any], Proc, Path]]:
    """A server with the store on, its first request answered cold, then SIGTERM: (the file, the cold answer, the
    stopped server, a folder for the next servers' logs)."""
    path = path_of(CACHE_DIR, str(bundled_gguf()))
    path.unlink(missing_ok=True)
    tmp = Path(tmp_path_factory.mktemp("prefix-store"))
    base, proc = start_server(tmp, STORE, name="first")
    try:
        wait_server_ready(base, proc, name="first")
        cold = complete(base)
        proc.stop(signal.SIGTERM, timeout=60)
        yield path, cold, proc, tmp
    finally:
        proc.stop(signal.SIGKILL)
        path.unlink(missing_ok=True)


def test_sigterm_writes_the_prefixes_kv_to_the_cache_directory(
    first: tuple[Path, dict[str, Any], Proc, Path],
) -> None:
    path, cold, proc, _ = first
    assert proc.popen.returncode == 0
    logged = events(proc)
    names = [e["event"] for e in logged]
    at_start, written = [e for e in logged if e["event"] == "prefix_store"]
    assert at_start["outcome"] == "ignored" and at_start["what"] == "missing"  # no file yet: started cold
    assert names.index("prefix_store") < names.index("ready")
    assert written["outcome"] == "written" and written["path"] == str(path) and path.is_file()
    assert names.index("draining") < logged.index(written) < names.index("drained")
    assert written["tokens"] >= whole(cold["usage"]["prompt_tokens"])  # the request's prompt, every whole block


def test_the_next_start_reads_it_back_before_ready_and_answers_as_the_cold_server(
    first: tuple[Path, dict[str, Any], Proc, Path],
) -> None:
    """Beside it, a server with its KV cache in f16 (another key) ignores the same file as another server's."""
    path, cold, _, tmp = first
    restarted = start_server(tmp, STORE, name="restarted")
    f16 = start_server(tmp, {**STORE, "TTFT_KV_DTYPE": "f16"}, name="f16")
    try:
        for (base, proc), name in ((restarted, "restarted"), (f16, "f16")):
            wait_server_ready(base, proc, name=name)
        base, proc = restarted
        names = [e["event"] for e in events(proc)]
        (restored,) = events(proc, "prefix_store")
        assert restored["outcome"] == "restored" and restored["path"] == str(path)
        assert names.index("prefix_store") < names.index("ready")
        warm = complete(base)  # the restarted server's first request
        assert warm["usage"]["cached_tokens"] == whole(cold["usage"]["prompt_tokens"])
        assert cold["usage"]["cached_tokens"] < 16
        assert warm["text"] == cold["text"] and warm["finish_reason"] == cold["finish_reason"]

        base, proc = f16
        (ignored,) = events(proc, "prefix_store")
        assert ignored["outcome"] == "ignored" and ignored["what"] == "foreign"
        assert "its kv_dtype is 'float32', this server's 'float16'" in ignored["reason"]
        assert complete(base)["usage"]["cached_tokens"] < 16
    finally:
        for _, proc in (restarted, f16):  # no drain: the file stays as the first server wrote it
            proc.stop(signal.SIGKILL)


def test_a_corrupt_file_is_ignored_with_a_log_line_and_the_server_starts_cold(
    first: tuple[Path, dict[str, Any], Proc, Path],
) -> None:
    path, cold, _, tmp = first
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit of the last block's keys and values
    path.write_bytes(bytes(data))
    base, proc = start_server(tmp, STORE, name="corrupt")
    try:
        wait_server_ready(base, proc, name="corrupt")
        (ignored,) = events(proc, "prefix_store")
        assert ignored["outcome"] == "ignored" and ignored["what"] == "corrupt"
        assert "does not match its sha256" in ignored["reason"]
        again = complete(base)
        assert again["usage"]["cached_tokens"] < 16
        assert again["text"] == cold["text"]
    finally:
        proc.stop(signal.SIGKILL)
