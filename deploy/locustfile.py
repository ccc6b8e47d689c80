"""Locust user for ttft-sse's ``POST /stream``: reports time to first token and total time as Locust metrics.

    locust -f deploy/locustfile.py --host http://127.0.0.1:8000 --headless -u 200 -r 20 -t 5m --max-tokens 64

Three rows appear in Locust's statistics (and its CSV / web charts), one request each per task:

    POST /stream   Locust's own: time to the response headers; fails on an HTTP status other than 200
    SSE  TTFT      time to the first token event with text (only for streams that produced one)
    SSE  total     time to the final ``done`` event; "size" is the number of tokens. Fails when the stream ends
                   with an ``error`` event, ends without ``done``, breaks, or never started (HTTP error)

Users wait 0 s between requests (a closed loop, as ``ttft-sse bench`` runs); set ``--wait`` for think time.
``--requests-per-user N`` makes each user stop after N streams, and the run end when the last user has stopped
(then ``-t`` is only a bound); every stream that started is then counted whole.
Prompts rotate through a small built-in set, or ``--prompt`` sends one text every time. Requests are greedy
(temperature 0). Needs only Locust itself; ``ttft-sse bench`` gives the same figures with percentiles per
inter-token gap, stream-versus-batch tables and charts (see docs/performance.md).
"""

from __future__ import annotations

import codecs
import itertools
import json
import time
from typing import Any

import gevent
from locust import HttpUser, events, task
from locust.exception import StopUser

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what TCP does.",
    "Donne-moi une recette simple de crêpes.",
    "请用三句话介绍一下长城。",
    "Give me one tip for sleeping better.",
]


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ttft-sse)")
    parser.add_argument("--prompt", default="", help="send this prompt every time instead of the built-in set")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds each user waits between requests")
    parser.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer KEY' (TTFT_API_KEYS)")
    parser.add_argument("--requests-per-user", type=int, default=0, help="each user stops after N requests (0: never)")


class StreamUser(HttpUser):
    def wait_time(self) -> float:
        return float(self.environment.parsed_options.wait)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.max_tokens = int(options.max_tokens)
        self.prompts = itertools.cycle([options.prompt] if options.prompt else PROMPTS)
        self.left = int(options.requests_per_user) or None
        self.headers = {"Accept": "text/event-stream"}
        if options.api_key:
            self.headers["Authorization"] = f"Bearer {options.api_key}"

    def _fire(self, name: str, started: float, *, length: int = 0, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="SSE",
            name=name,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=length,
            exception=exception,
            context={},
        )

    @task
    def stream(self) -> None:
        if self.left is not None:
            if self.left == 0:
                _user_done(self.environment)
                raise StopUser
            self.left -= 1
        body = {"messages": [{"role": "user", "content": next(self.prompts)}], "max_tokens": self.max_tokens}
        body["temperature"] = 0
        started = time.perf_counter()
        tokens, outcome = 0, None
        try:
            with self.client.post(
                "/stream",
                json=body,
                headers=self.headers,
                stream=True,
                catch_response=True,
                name="/stream",
            ) as response:
                if response.status_code != 200:
                    response.failure(f"HTTP {response.status_code}")
                    outcome = f"HTTP {response.status_code}"
                else:
                    response.success()  # the headers came; the stream's own outcome is the "total" row
                    for event, data in _events(response):
                        if event == "token" and json.loads(data).get("text"):
                            tokens += 1
                            if tokens == 1:
                                self._fire("TTFT", started)
                        elif event == "error":
                            outcome = "error event: " + str(json.loads(data).get("error", {}).get("message"))
                            break
                        elif event == "done":
                            outcome = "done"
                            break
                    else:
                        outcome = "the stream ended without a done event"
        except Exception as exc:  # a broken connection mid-stream (requests' ChunkedEncodingError and kin)
            outcome = f"dropped: {type(exc).__name__}: {exc}"
        failure = None if outcome == "done" else RuntimeError(outcome)
        self._fire("total", started, length=tokens, exception=failure)


_done_users = 0


def _user_done(environment: Any) -> None:
    """With --requests-per-user, the run ends when the last user has sent its requests (not at --run-time)."""
    global _done_users
    _done_users += 1
    runner = environment.runner
    if runner is not None and _done_users >= environment.parsed_options.num_users:
        gevent.spawn(runner.quit)  # from a greenlet of its own: quitting stops this user's greenlet too


def _events(response: Any) -> Any:
    """Server-Sent Events as ``(event, data)`` pairs, each as soon as its blank line arrives.

    Not ``iter_lines``: requests splits it per chunk, and a chunk that ends between ``\\r`` and ``\\n`` yields a
    blank line that is not there, which would cut an event in two.
    """
    buffer, event, data = "", "message", []
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # SSE is UTF-8, whatever Content-Type says
    for chunk in response.iter_content(chunk_size=None):
        buffer += decoder.decode(chunk)
        *lines, buffer = buffer.split("\n")
        for raw in lines:
            line = raw.removesuffix("\r")
            if line == "":
                if data:
                    yield event, "\n".join(data)
                event, data = "message", []
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
