"""First tokens from beside the batch, in a server as a user starts it (``ttft-sse serve``): with its defaults, from
interludes between two layers of the step in flight; with the prefill process (interludes off, no kernel helpers),
from a second process. Either way greedy requests that arrive at a busy batch are answered with the text they get
alone, sampled ones (an OpenAI client's default) get a first token from beside the batch too, the metrics count
them, and (for the process) the child ends with the server."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.processes import serve, wait_until
from tests.support.scrape import scrape
from tests.support.servers import stream_events

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
"""Bursts of 8 requests (greedy, then sampled) sent at most until the prefill process or an interlude has given one
of them its first token."""


def child_pid(log: str) -> int | None:
    for line in log.splitlines():
        if '"prefill_process_started"' in line:
            return int(json.loads(line)["pid"])
    return None


def won(base: str, metric: str) -> float:
    """First tokens the server's prefill process or interludes (``metric``) have given so far."""
    with httpx.Client(timeout=120) as client:
        return scrape(client, base).value(metric)


def greedy_races(base: str, metric: str) -> float:
    """Bursts of 8 streamed greedy requests until ``metric`` counts a first token given beside the batch; each
    answer is the one the request gets alone. Returns the count."""

    def ask(question: str) -> str:
        with httpx.Client(timeout=120) as client:
            events = stream_events(client, "POST", f"{base}/stream", json={"prompt": question, "max_tokens": 10})
        assert events[-1].event == "done", events[-1]
        return "".join(e.data["text"] for e in events if e.event == "token")

    # Which side gives a first token depends on the machine's load: new bursts of 8 (new prompts) are sent, at most
    # RACE_BURSTS, until one came from beside the batch. A server that never does fails.
    for burst in range(RACE_BURSTS):
        asked = [question if burst == 0 else f"({burst}) {question}" for question in QUESTIONS]
        with ThreadPoolExecutor(len(asked)) as pool:
            together = list(pool.map(ask, asked))
        given = won(base, metric)
        with httpx.Client(timeout=120) as client:
            alone = [
                client.post(f"{base}/complete", json={"prompt": q, "max_tokens": 10}).json()["text"] for q in asked
            ]
        assert together == alone
        if given > 0:
            return given
    raise AssertionError(f"no greedy first token from beside the batch ({metric}) in {RACE_BURSTS} bursts")


def sampled_races(base: str, metric: str, before: float) -> None:
    """An OpenAI client's default, sampled (temperature 1): bursts until ``metric`` rises past ``before``; each
    answer is whole."""

    def chat(question: str) -> dict[str, int]:
        body = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": 6}
        with httpx.Client(timeout=120) as client:
            response = client.post(f"{base}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json()["usage"])

    for burst in range(RACE_BURSTS):
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            usages = list(pool.map(chat, [f"Again ({burst}): {q}" for q in QUESTIONS]))
        assert all(1 <= usage["completion_tokens"] <= 6 for usage in usages)
        if won(base, metric) > before:
            return
    raise AssertionError(f"no sampled first token from beside the batch ({metric}) in {RACE_BURSTS} bursts")


def test_a_server_answers_a_busy_batch_between_two_layers_by_default(tmp_path: Path) -> None:
    """``ttft-sse serve`` with interludes as they come (on); requests that arrive at a busy batch get first tokens
    from them and the text they get alone."""
    with serve(tmp_path, {}) as (base, proc):
        wait_until(lambda: '"interludes_on"' in proc.log(), timeout=10, what="interludes")
        assert httpx.get(f"{base}/readyz").json()["beside_batch"] == "interludes ready"
        greedy_side = greedy_races(base, "ttft_sse_interlude_first_tokens_total")
        sampled_races(base, "ttft_sse_interlude_first_tokens_total", greedy_side)
        os.kill(proc.pid, signal.SIGTERM)
        proc.popen.wait(60)
    assert '"interlude_failed"' not in proc.log()


def test_a_server_answers_a_busy_batch_from_the_prefill_process_and_stops_it(tmp_path: Path) -> None:
    with serve(
        tmp_path, {"TTFT_PREFILL_PROCESS": "true", "TTFT_PREFILL_BETWEEN_LAYERS": "false", "TTFT_KERNEL_HELPERS": "0"}
    ) as (base, proc):
        wait_until(lambda: '"prefill_process_ready"' in proc.log(), timeout=180, what="the prefill process")
        assert httpx.get(f"{base}/readyz").json()["beside_batch"] == "prefill-process ready"
        pid = child_pid(proc.log())
        assert pid is not None
        os.kill(pid, 0)  # running

        greedy_side = greedy_races(base, "ttft_sse_prefill_process_first_tokens_total")
        sampled_races(base, "ttft_sse_prefill_process_first_tokens_total", greedy_side)

        os.kill(proc.pid, signal.SIGTERM)  # the server alone: it stops its child itself
        proc.popen.wait(60)
    assert '"prefill_process_failed"' not in proc.log()
    assert '"first_token_mismatch"' not in proc.log()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
