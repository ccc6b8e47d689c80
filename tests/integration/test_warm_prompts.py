"""``TTFT_WARM_PROMPTS`` on a real server with the real model: the file's prompts are computed before ``/readyz``
turns 200, so that the first request starting with one finds it cached, and answers as a server without them does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_prefill import QUESTION, chat, system_prompt
from tests.support.paths import CACHE_DIR
from tests.support.processes import Proc, start_server, wait_server_ready

SYSTEM = system_prompt("harbour")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[tuple[str, Proc], tuple[str, Proc]]]:
    """(a server with a warm prompt file of SYSTEM, one without), started side by side."""
    tmp = Path(tmp_path_factory.mktemp("warm"))
    warm = tmp / "warm.jsonl"
    warm.write_text(json.dumps({"messages": [{"role": "system", "content": SYSTEM}]}) + "\n\n")
    common = {"TTFT_CACHE_DIR": str(CACHE_DIR)}
    warmed = start_server(tmp, {**common, "TTFT_WARM_PROMPTS": str(warm)}, name="warmed")
    plain = start_server(tmp, common, name="plain")
    try:
        for (base, proc), name in ((warmed, "warmed"), (plain, "plain")):
            wait_server_ready(base, proc, name=name)
        yield warmed, plain
    finally:
        warmed[1].stop()
        plain[1].stop()


def events(proc: Proc) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]


def complete(base: str) -> dict[str, Any]:
    reply = httpx.post(f"{base}/complete", json={"messages": chat(SYSTEM, QUESTION), "max_tokens": 16}, timeout=120)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def test_the_first_request_finds_the_warm_prompt_cached_and_answers_as_without(
    servers: tuple[tuple[str, Proc], tuple[str, Proc]],
) -> None:
    (warm_base, warm_proc), (plain_base, _) = servers
    logged = events(warm_proc)
    names = [e["event"] for e in logged]
    assert "warm_prompt" in names and names.index("warm_prompt") < names.index("ready")
    (line,) = [e for e in logged if e["event"] == "warm_prompt"]
    assert line["outcome"] == "kept" and line["line"] == 1
    kept = line["prompt_tokens"]
    assert kept > 600  # the system prompt, through the chat template
    assert kept // 16 * 16 <= line["cached_tokens"] <= kept  # its whole blocks at least

    warmed = complete(warm_base)  # the server's first request
    plain = complete(plain_base)
    assert warmed["usage"]["cached_tokens"] >= kept // 16 * 16
    assert plain["usage"]["cached_tokens"] < 16
    assert warmed["text"] == plain["text"]
    assert warmed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
