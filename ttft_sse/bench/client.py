"""One measured request: send it with httpx, time every part of the reply, and say how it ended.

Outcomes (every request has exactly one; only ``ok`` requests enter the latency figures, every other one is counted
as an error of its kind — nothing is dropped from the count):

    ok               the reply ended as the protocol says a good reply ends (``done``; finish_reason + ``[DONE]``;
                     a 200 JSON body with text)
    http_status      the server answered with a status other than 200 (``status`` holds it)
    error_event      the stream carried an error event (``error`` holds its message)
    dropped          the response started, then the connection broke, timed out or ended before the final event
    transport_error  no response at all: connection refused, reset or timed out before the headers

Times are taken with ``time.perf_counter`` from just before the request is sent. ``ttft_ms`` is the time to the
first event with non-empty text (OpenAI's leading ``{"role": "assistant", "content": ""}`` chunk does not count);
for a batch request the whole answer arrives at once, so its ``ttft_ms`` is its total time — which is the point of
putting the two side by side.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from ttft_sse.bench import protocol
from ttft_sse.bench.prompts import Prompt
from ttft_sse.bench.protocol import Mode, Protocol

Outcome = Literal["ok", "http_status", "error_event", "dropped", "transport_error"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "http_status", "error_event", "dropped", "transport_error")


@dataclass(frozen=True)
class Target:
    """A server under test. ``label`` names it in tables and charts; ``model`` is sent to OpenAI servers;
    ``api_key`` goes out as ``Authorization: Bearer`` (ours, vLLM's and llama-server's ``--api-key``);
    ``temperature`` is sent with every request (0: greedy), and ``ignore_eos: true`` too when ``ignore_eos``."""

    url: str
    protocol: Protocol
    label: str
    model: str = ""
    api_key: str = field(default="", repr=False)
    temperature: float = 0.0
    ignore_eos: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Record:
    target: str
    protocol: Protocol
    mode: Mode
    concurrency: int
    index: int
    prompt: str
    max_tokens: int = 0  # what the request asked for
    start_s: float = 0.0  # since the start of the run
    headers_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    gaps_ms: list[float] = field(default_factory=list)
    chunks: int = 0  # events with non-empty text
    completion_tokens: int | None = None  # the server's own count, when it gives one
    outcome: Outcome = "ok"
    status: int | None = None
    error: str | None = None
    phase: str = "load"
    prefills: int = 0  # --typing-cps: /prefill calls answered 202 while the last message was typed
    prefills_failed: int = 0  # ... and those answered otherwise, or not at all

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def tokens(self) -> int:
        """Generated tokens: the server's count when it reports one, else the number of text events."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens"] = self.tokens
        return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


async def send(
    client: httpx.AsyncClient,
    target: Target,
    mode: Mode,
    prompt: Prompt,
    *,
    max_tokens: int,
    record: Record,
    epoch: float,
) -> Record:
    """Send one request to ``target`` and fill in ``record``; never raises for anything the server or network does."""
    record.max_tokens = max_tokens
    path, body = protocol.request(
        target.protocol,
        mode,
        prompt.as_messages(),
        max_tokens,
        target.model,
        target.temperature,
        ignore_eos=target.ignore_eos,
    )
    url = target.url.rstrip("/") + path
    started = time.perf_counter()
    record.start_s = round(started - epoch, 6)
    try:
        async with client.stream("POST", url, json=body, headers=target.headers) as response:
            record.headers_ms = _ms(time.perf_counter() - started)
            record.status = response.status_code
            if response.status_code != 200:
                record.outcome = "http_status"
                record.error = await _error_text(response)
            elif mode == "stream":
                await _read_stream(response, target.protocol, record, started)
            else:
                await _read_whole(response, target.protocol, record, started)
    except httpx.HTTPError as exc:
        record.outcome = "dropped" if record.headers_ms is not None else "transport_error"
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    record.total_ms = _ms(time.perf_counter() - started)
    return record


async def _read_stream(response: httpx.Response, proto: Protocol, record: Record, started: float) -> None:
    reader = protocol.SSEReader()
    last: float | None = None
    finished = ended = False
    async for line in response.aiter_lines():
        event = reader.feed(line)
        if event is None:
            continue
        now = time.perf_counter()
        step = protocol.read_event(proto, event)
        if step.text:
            record.chunks += 1
            if last is None:
                record.ttft_ms = _ms(now - started)
            else:
                record.gaps_ms.append(_ms(now - last))
            last = now
        if step.completion_tokens is not None:
            record.completion_tokens = step.completion_tokens
        if step.error is not None and record.error is None:
            record.outcome, record.error = "error_event", step.error
        finished = finished or step.finished
        if step.end:
            ended = True
            break
    if record.outcome == "error_event":
        return
    if not ended or not finished:
        record.outcome = "dropped"
        last_event = "done" if proto == "native" else "a finish_reason and data: [DONE]"
        record.error = f"the stream ended before {last_event}"


async def _read_whole(response: httpx.Response, proto: Protocol, record: Record, started: float) -> None:
    raw = await response.aread()
    try:
        _, record.completion_tokens = protocol.read_whole(proto, json.loads(raw))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        record.outcome, record.error = "dropped", f"the reply is not a complete answer: {exc}"
        return
    record.ttft_ms = _ms(time.perf_counter() - started)


async def _error_text(response: httpx.Response) -> str:
    try:
        raw = await response.aread()
    except httpx.HTTPError as exc:
        return f"HTTP {response.status_code} (body unreadable: {type(exc).__name__})"
    try:
        message = protocol.error_message(json.loads(raw))
    except (ValueError, UnicodeDecodeError):
        message = None
    text = message if message is not None else raw.decode("utf-8", "replace").strip()[:200]
    return f"HTTP {response.status_code}: {text}" if text else f"HTTP {response.status_code}"
