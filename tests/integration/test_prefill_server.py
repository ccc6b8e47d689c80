"""A server with the prefill process, as a user starts it (``ttft-sse serve``, its default): greedy requests that
arrive at a busy batch are answered with the text they get alone, sampled ones (an OpenAI client's default) are
raced too, the metrics say how many first tokens the process gave, and the process ends with the server."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.processes import serve, wait_until
from tests.scrape import scrape
from tests.servers import stream_events

QUESTIONS = [
    "Name a fruit.",
    "Write a poem about the ocean.",
    "Explain how photosynthesis works.",
    "Describe the history of the bicycle.",
    "What is Python?",
    "Write a letter to a friend.",
    "How does a steam engine work?",
    "Describe your ideal city.",
]
RACE_BURSTS = 8
"""Bursts of 8 requests (greedy, then sampled) sent at most until the prefill process has given one of them its
first token."""


def child_pid(log: str) -> int | None:
    for line in log.splitlines():
        if '"prefill_process_started"' in line:
            return int(json.loads(line)["pid"])
    return None


def test_a_server_answers_a_busy_batch_from_the_prefill_process_and_stops_it(tmp_path: Path) -> None:
    with serve(
        tmp_path, {"TTFT_PREFILL_PROCESS": "true", "TTFT_PREFILL_BETWEEN_LAYERS": "false", "TTFT_KERNEL_HELPERS": "0"}
    ) as (base, proc):
        wait_until(lambda: '"prefill_process_ready"' in proc.log(), timeout=180, what="the prefill process")
        pid = child_pid(proc.log())
        assert pid is not None
        os.kill(pid, 0)  # running

        def ask(question: str) -> str:
            with httpx.Client(timeout=120) as client:
                events = stream_events(client, "POST", f"{base}/stream", json={"prompt": question, "max_tokens": 10})
            assert events[-1].event == "done", events[-1]
            return "".join(e.data["text"] for e in events if e.event == "token")

        def won() -> float:
            """First tokens the prefill process has given so far."""
            with httpx.Client(timeout=120) as client:
                return scrape(client, base).value("ttft_sse_prefill_process_first_tokens_total")

        # Which side wins a race depends on the machine's load: new bursts of 8 (new prompts) are sent, at most
        # RACE_BURSTS, until the process has won one. A server that never races them fails.
        greedy_side = 0.0
        for burst in range(RACE_BURSTS):
            asked = [question if burst == 0 else f"({burst}) {question}" for question in QUESTIONS]
            with ThreadPoolExecutor(len(asked)) as pool:
                together = list(pool.map(ask, asked))
            greedy_side = won()
            with httpx.Client(timeout=120) as client:
                alone = [
                    client.post(f"{base}/complete", json={"prompt": q, "max_tokens": 10}).json()["text"] for q in asked
                ]
            assert together == alone
            if greedy_side > 0:
                break
        assert greedy_side > 0, f"the prefill process won no greedy race in {RACE_BURSTS} bursts"

        # An OpenAI client's default: sampled (temperature 1). Raced as well; each answer is whole.
        def chat(question: str) -> dict[str, int]:
            body = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": 6}
            with httpx.Client(timeout=120) as client:
                response = client.post(f"{base}/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return dict(response.json()["usage"])

        sampled_side = greedy_side
        for burst in range(RACE_BURSTS):
            with ThreadPoolExecutor(len(QUESTIONS)) as pool:
                usages = list(pool.map(chat, [f"Again ({burst}): {q}" for q in QUESTIONS]))
            assert all(1 <= usage["completion_tokens"] <= 6 for usage in usages)
            sampled_side = won()
            if sampled_side > greedy_side:
                break
        assert sampled_side > greedy_side, f"the prefill process won no sampled race in {RACE_BURSTS} bursts"

        os.kill(proc.pid, signal.SIGTERM)  # the server alone: it stops its child itself
        proc.popen.wait(60)
    assert '"prefill_process_failed"' not in proc.log()
    assert '"first_token_mismatch"' not in proc.log()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
