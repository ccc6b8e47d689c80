from __future__ import annotations

import json

import httpx

from ttft_sse.bench.client import Record, Target, send
from ttft_sse.bench.prompts import Prompt

REPLY = {"choices": [{"message": {"role": "assistant", "content": "Paris."}}], "usage": {"completion_tokens": 3}}


async def _body_sent(target: Target) -> dict[str, object]:
    sent: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=REPLY)

    prompt = Prompt("q", ({"role": "user", "content": "Capital of France?"},))
    record = Record(target.label, target.protocol, "batch", 1, 0, prompt.name)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await send(client, target, "batch", prompt, max_tokens=16, record=record, epoch=0.0)
    assert (record.outcome, record.completion_tokens) == ("ok", 3)
    return sent[0]


async def test_a_target_that_ignores_eos_sends_ignore_eos_with_each_request() -> None:
    body = await _body_sent(Target("http://llama", "openai", "llama", model="m", ignore_eos=True))
    assert (body["ignore_eos"], body["max_tokens"]) == (True, 16)


async def test_a_target_sends_no_ignore_eos_unless_asked() -> None:
    assert "ignore_eos" not in await _body_sent(Target("http://ours", "openai", "ours", model="m"))
