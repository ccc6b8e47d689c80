"""The server on the llama.cpp engine (``TTFT_ENGINE=llamacpp``, and ``auto`` with a scripted measurement): SSE,
``/complete`` and the OpenAI chat surface on a real hypercorn server with the bundled model; ``/readyz`` says which
engine runs and why; a ``/prefill`` then the request finds the prefix cached and answers the same."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.engines import llama_cpp_or_skip
from tests.support.servers import running, stream_events
from ttft_sse.app import create_app
from ttft_sse.engine import choice
from ttft_sse.engine.choice import AutoEngine
from ttft_sse.engine.llamacpp.engine import LlamaCppEngine
from ttft_sse.settings import Settings

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llama_server(settings: Settings) -> Iterator[str]:
    llama_cpp_or_skip()
    with running(create_app(settings.replace(engine="llamacpp"))) as base:
        yield base


def test_readyz_names_the_engine_and_that_the_setting_chose_it(llama_server: str) -> None:
    ready = httpx.get(f"{llama_server}/readyz").json()
    assert ready["engine"] == {"name": "llamacpp", "chosen_by": "setting"}
    assert ready["weights"] == "llama.cpp: llama 256M Q4_1"
    assert ready["context_length"] == Settings().kv_cache_tokens // Settings().max_concurrency


def test_sse_stream_complete_and_chat_completions_give_one_greedy_text(llama_server: str) -> None:
    body = {"prompt": QUESTION, "max_tokens": 24, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        events = stream_events(client, "POST", f"{llama_server}/stream", json=body)
        complete = client.post(f"{llama_server}/complete", json=body).json()
        chat = client.post(
            f"{llama_server}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0},
        ).json()
    tokens = [e for e in events if e.event == "token"]
    [done] = [e for e in events if e.event == "done"]
    streamed = "".join(e.data["text"] for e in tokens)
    assert [e.id for e in tokens] == [str(i) for i in range(len(tokens))]
    assert streamed and streamed == complete["text"] == chat["choices"][0]["message"]["content"]
    core = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: done.data["usage"][k] for k in core} == {k: complete["usage"][k] for k in core}
    assert {k: complete["usage"][k] for k in core} == {k: chat["usage"][k] for k in core}
    # The same prompt three times: the next two reuse the first's sequence cells for all but the last prompt token
    # (the first, at most the chat template's opening, from the start's warm-up); OpenAI's shape says so under
    # prompt_tokens_details.
    reused = complete["usage"]["prompt_tokens"] - 1
    assert done.data["usage"]["cached_tokens"] < reused and complete["usage"]["cached_tokens"] == reused
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": reused}
    assert done.data["finish_reason"] == complete["finish_reason"]


def test_a_prefill_then_the_request_finds_the_prefix_cached_and_answers_the_same(llama_server: str) -> None:
    system = {"role": "system", "content": " ".join(f"Rule {i} of the ferry desk: answer briefly." for i in range(12))}
    question = "Which ferry leaves first in the morning?"
    typed = [system, {"role": "user", "content": question[:-10]}]  # the user is still typing
    full = [system, {"role": "user", "content": question}]
    with httpx.Client(timeout=120) as client:
        alone = client.post(
            f"{llama_server}/complete", json={"messages": full, "max_tokens": 16, "cache_salt": "alone"}
        ).json()
        accepted = client.post(f"{llama_server}/prefill", json={"messages": typed, "cache_salt": "typed"})
        assert accepted.status_code == 202
        prefix = accepted.json()["prompt_tokens"]
        assert accepted.json()["cached_tokens"] < prefix
        # Asked again, /prefill says how much of the prefix the cache holds (each newer prefill goes on from where
        # the one it supersedes got to).
        deadline = time.monotonic() + 60
        while (
            client.post(f"{llama_server}/prefill", json={"messages": typed, "cache_salt": "typed"}).json()[
                "cached_tokens"
            ]
            < prefix
        ):
            assert time.monotonic() < deadline, "the prefill did not end in time"
            time.sleep(0.2)
        answer = client.post(
            f"{llama_server}/complete", json={"messages": full, "max_tokens": 16, "cache_salt": "typed"}
        ).json()
    assert alone["usage"]["cached_tokens"] == 0
    assert answer["usage"]["cached_tokens"] == prefix
    assert answer["text"] == alone["text"]


def test_metrics_are_served_without_the_batched_engines_cache_series(llama_server: str) -> None:
    metrics = httpx.get(f"{llama_server}/metrics")
    assert metrics.status_code == 200
    assert "ttft_sse_startup_stage_seconds" in metrics.text
    assert "ttft_sse_prefix_cache_queries_tokens" not in metrics.text


def scripted(rates: dict[str, dict[str, float]], calls: list[str]) -> choice.Measure:
    def measure(settings: Settings, name: str) -> choice.Rates:
        calls.append(name)
        return rates[name]

    return measure


def test_auto_uses_the_measured_verdict_then_the_remembered_one_and_readyz_says_so(settings: Settings) -> None:
    llama_cpp_or_skip()
    # Conditions of their own (max_concurrency 3): this verdict's file is not the one a real `auto` start reads.
    auto = settings.replace(engine="auto", max_concurrency=3, max_queue=4)
    path = choice.verdict_path(auto)
    path.unlink(missing_ok=True)
    calls: list[str] = []
    rates = {"batched": {"c1": 40.0, "c8": 90.0}, "llamacpp": {"c1": 60.0, "c8": 120.0}}
    try:
        engine = AutoEngine(auto, measure=scripted(rates, calls))
        with running(create_app(auto, engine)) as base:
            ready = httpx.get(f"{base}/readyz").json()
        assert calls == ["batched", "llamacpp"]
        assert isinstance(engine.chosen, LlamaCppEngine)
        assert ready["engine"] == {
            "name": "llamacpp",
            "chosen_by": "measured",
            "reason": "faster at c=1 and at c=8",
            "tokens_per_second": rates,
        }
        assert path.is_file()
        again = choice.choose(auto, measure=scripted(rates, calls))
        assert calls == ["batched", "llamacpp"]  # read, not measured again
        assert (again.name, again.chosen_by, again.tokens_per_second) == ("llamacpp", "measured before", rates)
    finally:
        path.unlink(missing_ok=True)
