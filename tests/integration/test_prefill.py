"""``POST /prefill`` on a real server with the real model (``ttft-sse serve`` as a user starts it, keys on and
``TTFT_PREFIX_ISOLATION=key``): a prefill then the request reports the prefix as cached tokens and gives the answer
the same request gets without one; a newer prefill of the same session stops the older; a key over its bound gets 429;
a long prompt's stream tells its progress before its first token, and so does its resumable stream, whose resumed
reader gets exactly the tokens it missed; one key's prefill gives another key nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_streams import check_progress_then_tokens
from tests.support.paths import CACHE_DIR
from tests.support.processes import Proc, serve, wait_until
from tests.support.servers import stream_events

ALICE, BOB = "alice-secret-key-0001", "bob-secret-key-00002"
QUESTION = "In one sentence, what is the main job of a lighthouse keeper?"


def system_prompt(topic: str, sentences: int = 60) -> str:
    """A system prompt of about 14 tokens a sentence, unique to ``topic``."""
    rule = "desk: answer briefly, kindly and only about facts."
    return " ".join(f"Rule {i} of the {topic} {rule}" for i in range(sentences))


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def key(secret: str, session: str = "") -> dict[str, str]:
    headers = {"X-API-Key": secret}
    if session:
        headers["X-Prefill-Session"] = session
    return headers


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc]]:
    tmp = tmp_path_factory.mktemp("prefill")
    settings = {
        "TTFT_API_KEYS": f"{ALICE}:normal,{BOB}:normal",
        "TTFT_PREFIX_ISOLATION": "key",
        "TTFT_PREFILL_PER_KEY": "1",
        "TTFT_CACHE_DIR": str(CACHE_DIR),
    }
    with serve(Path(tmp), settings) as running:
        yield running


def prefill_outcomes(proc: Proc) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "prefill"]


def wait_prefills(proc: Proc, count: int) -> list[dict[str, Any]]:
    wait_until(lambda: len(prefill_outcomes(proc)) >= count, timeout=120, what=f"{count} prefills to end")
    return prefill_outcomes(proc)


def complete(base: str, messages: list[dict[str, str]], secret: str, **extra: Any) -> dict[str, Any]:
    reply = httpx.post(
        f"{base}/complete", json={"messages": messages, "max_tokens": 16, **extra}, headers=key(secret), timeout=120
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def test_a_prefill_then_the_request_finds_the_prefix_cached_and_answers_the_same(server: tuple[str, Proc]) -> None:
    base, proc = server
    system = system_prompt("lighthouse", 20)
    alone = complete(base, chat(system, QUESTION), BOB)  # Bob's cache is apart from Alice's: computed in full
    assert alone["usage"]["cached_tokens"] < 16

    typed = QUESTION[: len(QUESTION) - 12]  # the user is still typing
    ended = len(prefill_outcomes(proc))
    accepted = httpx.post(f"{base}/prefill", json={"messages": chat(system, typed)}, headers=key(ALICE, "tab-1"))
    assert accepted.status_code == 202, accepted.text
    body = accepted.json()
    assert set(body) == {"prompt_tokens", "cached_tokens"}
    assert alone["usage"]["prompt_tokens"] - 20 < body["prompt_tokens"] < alone["usage"]["prompt_tokens"]
    assert body["cached_tokens"] < 16  # nothing of it was Alice's before
    assert wait_prefills(proc, ended + 1)[-1]["outcome"] == "ok"

    after = complete(base, chat(system, QUESTION), ALICE)
    assert after["text"] == alone["text"]  # greedy: the same answer, prefilled or not
    assert after["usage"]["cached_tokens"] >= body["prompt_tokens"] // 4 * 4
    assert after["usage"]["cached_tokens"] < after["usage"]["prompt_tokens"]

    # The OpenAI surface says it as OpenAI does.
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "m", "messages": chat(system, QUESTION), "max_tokens": 4, "temperature": 0},
        headers=key(ALICE),
        timeout=120,
    )
    usage = reply.json()["usage"]
    # the whole question is cached now too (the request before completed its blocks), short of the last block
    assert after["usage"]["cached_tokens"] <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    # A request of Alice's with a salt of its own finds none of it.
    salted = complete(base, chat(system, QUESTION), ALICE, cache_salt="tenant-7")
    assert salted["usage"]["cached_tokens"] < 16
    assert salted["text"] == alone["text"]


def test_a_newer_prefill_of_the_session_supersedes_the_older_and_the_bound_gives_429(
    server: tuple[str, Proc],
) -> None:
    base, proc = server
    ended = len(prefill_outcomes(proc))
    first = {"messages": chat(system_prompt("harbour", 90), "Which ships")}
    second = {"messages": chat(system_prompt("airport", 90), "Which planes")}
    assert httpx.post(f"{base}/prefill", json=first, headers=key(BOB, "tab-9")).status_code == 202
    # Another session of the same key, over TTFT_PREFILL_PER_KEY=1, while the first computes.
    over = httpx.post(f"{base}/prefill", json=second, headers=key(BOB, "tab-10"))
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "too_many_prefills"
    assert int(over.headers["Retry-After"]) >= 1
    # The same session: the newer one supersedes the older, which stops.
    assert httpx.post(f"{base}/prefill", json=second, headers=key(BOB, "tab-9")).status_code == 202
    outcomes = wait_prefills(proc, ended + 2)[ended:]
    assert [o["outcome"] for o in outcomes] == ["superseded", "ok"]
    again = httpx.post(f"{base}/prefill", json=first, headers=key(BOB, "tab-9")).json()
    assert again["cached_tokens"] < again["prompt_tokens"] - 100  # the older one stopped well before its end
    assert wait_prefills(proc, ended + 3)[-1]["outcome"] == "ok"


def test_a_long_prompt_streams_its_progress_before_its_first_token(server: tuple[str, Proc]) -> None:
    base, _ = server
    body = {"messages": chat(system_prompt("museum", 110), "Say hello."), "max_tokens": 4}
    with httpx.Client(timeout=120) as client:
        events = stream_events(client, "POST", f"{base}/stream", json=body, headers=key(ALICE))
    kinds = [e.event for e in events]
    assert kinds[-1] == "done"
    first_token = kinds.index("token")
    progress = [e.data for e in events if e.event == "progress"]
    assert progress and all(kinds.index("progress") < first_token for _ in progress)
    assert "progress" not in kinds[first_token:]
    total = events[-1].data["usage"]["prompt_tokens"]
    assert {p["prompt_tokens"] for p in progress} == {total}
    computed = [p["computed"] for p in progress]
    assert computed == sorted(computed) and computed[-1] < total
    assert len(progress) >= 2  # a prompt of three steps (TTFT_BATCH_TOKENS 512) tells at least two of them


def test_a_long_prompt_tells_its_progress_on_a_resumable_stream_and_a_resume_gets_exactly_the_missed_tokens(
    server: tuple[str, Proc],
) -> None:
    base, _ = server
    body = {"messages": chat(system_prompt("harbour", 110), "Say hello."), "max_tokens": 6}
    with httpx.Client(timeout=120) as client:
        created = client.post(f"{base}/streams", json=body, headers=key(ALICE))
        assert created.status_code == 201, created.text
        stream_id, url = created.json()["id"], f"{base}{created.json()['url']}"  # the url carries the grant
        events = stream_events(client, "GET", url)
        resumed = stream_events(client, "GET", url, headers={"Last-Event-ID": f"{stream_id}.2"})
    assert events[-1].event == "done"
    total = events[-1].data["usage"]["prompt_tokens"]
    assert total > 1100 and events[-1].data["usage"]["cached_tokens"] < 16
    check_progress_then_tokens(events, stream_id, total)  # a prompt of three steps (TTFT_BATCH_TOKENS 512)
    after = [(e.event, e.id, e.data) for e in events if e.event != "progress"][3:]
    assert [(e.event, e.id, e.data) for e in resumed] == after  # tokens 3.. and done, nothing else
    assert [event for event, _, _ in after] == ["token"] * (len(after) - 1) + ["done"]


def test_one_keys_prefill_gives_another_key_no_cached_tokens(server: tuple[str, Proc]) -> None:
    base, proc = server
    system = system_prompt("garden", 20)
    ended = len(prefill_outcomes(proc))
    typed = {"messages": chat(system, "What grows")}
    assert httpx.post(f"{base}/prefill", json=typed, headers=key(ALICE, "tab-2")).status_code == 202
    assert wait_prefills(proc, ended + 1)[-1]["outcome"] == "ok"
    bob = complete(base, chat(system, "What grows in shade?"), BOB)
    assert bob["usage"]["cached_tokens"] < 16
    alice = complete(base, chat(system, "What grows in shade?"), ALICE)
    assert alice["usage"]["cached_tokens"] > bob["usage"]["prompt_tokens"] - 20
    assert alice["text"] == bob["text"]
