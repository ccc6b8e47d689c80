"""The typing schedule of ``ttft-sse bench --typing-cps`` (pure), what a typist sends, and the flag's checks."""

from __future__ import annotations

import json

import httpx
import pytest

from ttft_sse.__main__ import main
from ttft_sse.bench.typist import Prefill, Typing, schedule, type_out

SYSTEM = {"role": "system", "content": "Be brief."}


def test_the_conversation_so_far_then_each_word_but_the_last_goes_to_prefill_at_its_typed_time() -> None:
    typing = schedule([SYSTEM, {"role": "user", "content": "What is  up?"}], cps=10)
    assert typing == Typing(
        prefills=(
            Prefill(0.0, (SYSTEM,)),
            Prefill(0.4, (SYSTEM, {"role": "user", "content": "What"})),
            Prefill(0.7, (SYSTEM, {"role": "user", "content": "What is"})),
        ),
        ends_s=1.2,  # 12 characters at 10 a second, the double space included
    )


def test_a_conversation_without_text_before_the_typed_message_is_not_prefilled_at_the_start() -> None:
    blank = {"role": "system", "content": "  "}
    assert schedule([blank, {"role": "user", "content": "Hi there"}], cps=4) == Typing(
        (Prefill(0.5, (blank, {"role": "user", "content": "Hi"})),), ends_s=2.0
    )
    assert schedule([{"role": "user", "content": "Hello"}], cps=5) == Typing((), ends_s=1.0)


@pytest.mark.parametrize("cps", [0, -1])
def test_a_speed_not_above_zero_is_refused(cps: float) -> None:
    with pytest.raises(ValueError, match="more than 0"):
        schedule([SYSTEM], cps)


async def test_each_prefill_goes_to_slash_prefill_with_the_typists_session_and_the_key() -> None:
    seen: list[tuple[str, str, str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        headers = request.headers
        seen.append(
            (request.url.path, headers["x-prefill-session"], headers["authorization"], json.loads(request.content))
        )
        return httpx.Response(202 if len(seen) == 1 else 429, json={})

    messages = [SYSTEM, {"role": "user", "content": "Say hi"}]
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        typed = await type_out(
            client, "http://server/", messages, 1000.0, session="tab-1", headers={"Authorization": "Bearer k"}
        )
        await typed.settled()
    assert seen == [
        ("/prefill", "tab-1", "Bearer k", {"messages": [SYSTEM]}),
        ("/prefill", "tab-1", "Bearer k", {"messages": [SYSTEM, {"role": "user", "content": "Say"}]}),
    ]
    assert (typed.accepted, typed.failed) == (1, 1)


def test_typing_against_an_openai_target_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--url", "http://127.0.0.1:9", "--protocol", "openai", "--typing-cps", "20"]
    assert main(argv) == 2
    assert "--typing-cps calls this server's /prefill" in capsys.readouterr().err
