"""The wire formats a benchmark speaks: what to send, and how to read each event of the reply. Pure; no I/O.

``native`` is this server's own API: ``POST /stream`` (SSE events ``token`` / ``done`` / ``error``) and
``POST /complete`` (one JSON body). ``openai`` is ``POST /v1/chat/completions`` with ``stream: true`` (``data:``
chunks, then ``data: [DONE]``) or ``stream: false``, which llama-server, vLLM and most other servers speak.

Requests are greedy (``temperature: 0``) unless the bench is asked otherwise (``--temperature``), so that repeated
runs generate the same tokens and a comparison is about the server, not about sampling luck. ``--temperature 1``
sends what an OpenAI client sends by default: most chat traffic samples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Protocol = Literal["native", "openai"]
Mode = Literal["stream", "batch"]
PROTOCOLS: tuple[Protocol, ...] = ("native", "openai")
MODES: tuple[Mode, ...] = ("stream", "batch")
GOLDEN = (5**0.5 - 1) / 2


@dataclass(frozen=True)
class Lengths:
    """The ``max_tokens`` each request asks for: ``low`` to ``high`` (``--max-tokens 32-96``), or one value.

    Request *i* asks for :meth:`at` ``(i)``: the same value for every target and mode, spread evenly over the
    range (the fractional parts of *i* times the golden ratio). With one value for all, requests sent together end
    together under a batching server, and the next ones arrive together: a closed loop then measures bursts,
    where clients of a real chat product ask for answers of many lengths and come and go at any step."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"max_tokens must be 1 or more, low to high; got {self.low} to {self.high}")

    def at(self, index: int) -> int:
        return self.low + int((index * GOLDEN) % 1.0 * (self.high - self.low + 1))


@dataclass(frozen=True)
class SSEEvent:
    event: str
    data: str


class SSEReader:
    """An incremental Server-Sent Events reader: feed it lines, it returns each event as its blank line arrives.

    Comments (sse-starlette's ``: ping``) and events without data are skipped, as the SSE specification says.
    """

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []

    def feed(self, line: str) -> SSEEvent | None:
        if line == "":
            event, data = self._event, self._data
            self._event, self._data = "message", []
            return SSEEvent(event, "\n".join(data)) if data else None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None

    def feed_all(self, lines: Iterator[str]) -> Iterator[SSEEvent]:
        for line in lines:
            if (event := self.feed(line)) is not None:
                yield event


@dataclass(frozen=True)
class Step:
    """What one event means to a measurement.

    ``text``: generated text (empty for events that carry none); ``finished``: the server said the generation is over
    (``done``, or an OpenAI ``finish_reason``); ``end``: the stream's final event (``done``, ``data: [DONE]``);
    ``error``: the server reported an error in the stream; ``completion_tokens``: the server's own count, if given.
    """

    text: str = ""
    finished: bool = False
    end: bool = False
    error: str | None = None
    completion_tokens: int | None = None


def request(
    protocol: Protocol,
    mode: Mode,
    messages: list[dict[str, str]],
    max_tokens: int,
    model: str,
    temperature: float = 0.0,
    *,
    ignore_eos: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one request. ``ignore_eos`` adds llama-server's and vLLM's ``ignore_eos: true``
    (generate ``max_tokens`` whatever the model says); a server without it answers as it answers unknown fields."""
    extra: dict[str, Any] = {"ignore_eos": True} if ignore_eos else {}
    if protocol == "native":
        path = "/stream" if mode == "stream" else "/complete"
        return path, {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, **extra}
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    body.update(extra)
    if mode == "stream":
        body.update(stream=True, stream_options={"include_usage": True})
    else:
        body["stream"] = False
    return "/v1/chat/completions", body


def read_event(protocol: Protocol, event: SSEEvent) -> Step:
    return _native_event(event) if protocol == "native" else _openai_event(event)


def read_whole(protocol: Protocol, body: Any) -> tuple[str, int | None]:
    """The text and the server's completion-token count of a non-streamed reply. ``ValueError`` if it has none."""
    if not isinstance(body, dict):
        raise ValueError("the reply is not a JSON object")
    if protocol == "native":
        text = body.get("text")
    else:
        choices = body.get("choices") or [{}]
        text = ((choices[0] or {}).get("message") or {}).get("content")
    if not isinstance(text, str):
        raise ValueError("the reply has no text")
    return text, _completion_tokens(body.get("usage"))


def error_message(body: Any) -> str | None:
    """The message of an ``{"error": {"message": …}}`` body (ours, OpenAI's, vLLM's, llama-server's)."""
    if isinstance(body, dict) and "error" in body:
        error = body["error"]
        if isinstance(error, dict):
            return str(error.get("message") or error.get("type") or error)
        return str(error)
    return None


def _native_event(event: SSEEvent) -> Step:
    if event.event == "token":
        data = _json(event.data)
        text = data.get("text") if isinstance(data, dict) else None
        return Step(text=text if isinstance(text, str) else "")
    if event.event == "done":
        data = _json(event.data)
        usage = data.get("usage") if isinstance(data, dict) else None
        return Step(finished=True, end=True, completion_tokens=_completion_tokens(usage))
    if event.event == "error":
        return Step(end=True, error=error_message(_json(event.data)) or event.data[:200])
    return Step()  # queued, or an event this reader does not know: no text, no end


def _openai_event(event: SSEEvent) -> Step:
    if event.data.strip() == "[DONE]":
        return Step(end=True)
    data = _json(event.data)
    if not isinstance(data, dict):
        return Step()
    if (message := error_message(data)) is not None:
        return Step(error=message)  # the stream still ends with [DONE]; the outcome is the error
    text, finished = "", False
    for choice in data.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str):
            text += content
        elif isinstance(choice.get("text"), str):  # /v1/completions framing, should a server answer with it
            text += choice["text"]
        finished = finished or choice.get("finish_reason") is not None
    return Step(text=text, finished=finished, completion_tokens=_completion_tokens(data.get("usage")))


def _completion_tokens(usage: Any) -> int | None:
    if isinstance(usage, dict):
        value = usage.get("completion_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
