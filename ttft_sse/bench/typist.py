"""``--typing-cps``: a request's last message typed before it is sent, with ``POST /prefill`` called as the chat
page calls it, so that TTFT is measured from the moment typing ends (the request's send), as a user feels it.

The cadence (:func:`schedule`, pure): typing starts from the conversation without the last message's text, at
``cps`` characters a second, so the whole message takes ``len(text) / cps`` seconds. At time 0 the conversation so
far goes to ``/prefill`` (the page does so when a conversation is loaded or the system prompt changes; with an
empty draft it sends the messages before the draft), unless none of it has text. Then, at the end of each word but
the last (at ``end / cps``, ``end`` the index just past the word), the conversation with the message typed up to that
word (no trailing space) goes to ``/prefill``: the typist pauses at each word long enough for the page's 300 ms
timer to fire, and these pauses are not added to the typing time. At the end of the last word typing ends and the
request goes out; the page clears its timer on Enter, so no prefill goes then. A text the page has sent already is
not sent again (the page skips a prefill whose text has not changed).

Each prefill is sent as the page sends it, in the background (the page does not wait for its answer), with an
``X-Prefill-Session`` of the request's own (one tab per typist): a newer prefill supersedes the older one. This is
our API: only ``--protocol native`` targets take it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

SESSION_HEADER = "X-Prefill-Session"
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Prefill:
    """One ``/prefill`` call: ``at_s`` seconds after typing starts, with these messages."""

    at_s: float
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Typing:
    """What typing one request's last message does: its prefills, in order, and when typing ends (the send)."""

    prefills: tuple[Prefill, ...]
    ends_s: float


def schedule(messages: Sequence[dict[str, str]], cps: float) -> Typing:
    """The prefills a typist at ``cps`` characters a second causes while typing ``messages``' last message (the
    module's docstring says the cadence). ``ValueError`` for no messages or a ``cps`` not above 0."""
    if not messages:
        raise ValueError("a conversation to type needs a message")
    if cps <= 0:
        raise ValueError(f"characters a second must be more than 0, got {cps}")
    before, last = [dict(m) for m in messages[:-1]], messages[-1]
    text = last["content"]
    prefills: list[Prefill] = []
    if any(m["content"].strip() for m in before):
        prefills.append(Prefill(0.0, tuple(before)))
    words = list(_WORD.finditer(text))
    for word in words[:-1]:
        typed = {**last, "content": text[: word.end()]}
        prefills.append(Prefill(word.end() / cps, (*before, typed)))
    return Typing(tuple(prefills), len(text) / cps)


@dataclass
class Typed:
    """How one request's prefills went: answered 202 (``accepted``), or anything else (``failed``); counted as each
    answer arrives, all of them once :meth:`settled` returns."""

    accepted: int = 0
    failed: int = 0
    _sent: list[asyncio.Task[None]] = field(default_factory=list, repr=False)

    async def settled(self) -> Typed:
        """Waits for every prefill's answer (they went in the background), then returns ``self``."""
        await asyncio.gather(*self._sent)
        return self


async def type_out(
    client: httpx.AsyncClient,
    url: str,
    messages: Sequence[dict[str, str]],
    cps: float,
    *,
    session: str,
    headers: dict[str, str],
) -> Typed:
    """Type ``messages``' last message at ``cps`` against the server at ``url``: each prefill of :func:`schedule` is
    sent at its time, in the background; returns when typing ends, without waiting for the prefills' answers."""
    typing = schedule(messages, cps)
    typed = Typed()
    started = time.perf_counter()
    for prefill in typing.prefills:
        await asyncio.sleep(max(0.0, started + prefill.at_s - time.perf_counter()))
        typed._sent.append(asyncio.create_task(_send(client, url, prefill, session, headers, typed)))
    await asyncio.sleep(max(0.0, started + typing.ends_s - time.perf_counter()))
    return typed


async def _send(
    client: httpx.AsyncClient, url: str, prefill: Prefill, session: str, headers: dict[str, str], typed: Typed
) -> None:
    try:
        response = await client.post(
            url.rstrip("/") + "/prefill",
            json={"messages": list(prefill.messages)},
            headers={**headers, SESSION_HEADER: session},
        )
    except httpx.HTTPError:
        typed.failed += 1
        return
    if response.status_code == 202:
        typed.accepted += 1
    else:
        typed.failed += 1
