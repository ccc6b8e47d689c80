"""``POST /prefill``: a prompt's KV computed while its user is still typing, as background work.

The chat page sends the conversation as it stands each time its user pauses in typing (and when a conversation is
loaded or the system prompt changes). :meth:`Prefills.start` prepares the part of that prompt which the request sent
at Enter will start with for sure (``Engine.prepare_prefix``: up to the end of the text typed so far, less the tokens
whose split may still change), answers at once what it will compute, and has the engine compute it into the prefix
cache in the background (``Engine.prefill``), where the request finds it.

Background work, never in a real request's way:

* it takes no generation slot and no queue place (ttft_sse/admission/gate.py), and holds still, between two of its
  steps, while any request waits for a slot (``hold``); the batched engine also gives its steps only what real requests
  leave;
* a newer prefill of the same caller (its API key and ``X-Prefill-Session``: one browser tab) supersedes the older
  one, which stops at its next step; a key has at most ``TTFT_PREFILL_PER_KEY`` prefills computing at once (its
  sessions'), and one more is refused with 429 and Retry-After;
* it is cancelled when the server drains.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial

import anyio
import structlog

from ttft_sse.admission import isolation
from ttft_sse.admission.auth import Caller
from ttft_sse.admission.gate import Gate
from ttft_sse.engine.base import Engine, Prompt
from ttft_sse.errors import NotReady, PromptTooLong, TooManyRequests
from ttft_sse.lifecycle import Lifecycle
from ttft_sse.schemas import GenerationRequest

log = structlog.get_logger("ttft_sse.prefill")

MAX_SESSION_CHARS = 128
"""``X-Prefill-Session`` is cut to this many characters."""

Owner = tuple[str, str]
"""(the caller's key id, or "" on an open server; its session): whose newer prefill supersedes an older one."""


@dataclass(frozen=True)
class Accepted:
    """What a prefill will do: the prompt tokens it keeps in the cache, and how many of them are there already."""

    prompt_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}


class Prefills:
    """The prefills computing now, by owner. For the event loop."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        engine: Engine,
        gate: Gate,
        *,
        per_key: int,
        prefix_isolation: str = isolation.SHARED,
        max_prompt_tokens: int = 0,
    ) -> None:
        self._lifecycle = lifecycle
        self._engine = engine
        self._gate = gate
        self._per_key = per_key
        self._isolation = prefix_isolation
        self._max_prompt_tokens = max_prompt_tokens
        self._running: dict[Owner, asyncio.Task[None]] = {}
        self.superseded = 0
        """Prefills stopped by a newer one of the same owner."""

    @property
    def running(self) -> int:
        return len(self._running)

    async def start(self, request: GenerationRequest, *, caller: Caller, session: str = "") -> Accepted:
        """Prepare ``request``'s stable prefix and start computing it; what it will compute. Refused as a request
        would be (not ready, draining, a bad prompt), and with 429 where ``caller``'s key has its bound of
        prefills computing."""
        lifecycle = self._lifecycle
        if lifecycle.state == "stopping":
            raise lifecycle.refusal()
        if not lifecycle.ready:
            raise NotReady(lifecycle.not_ready_reason(), retry_after=5)
        owner: Owner = (caller.key_id or "", session[:MAX_SESSION_CHARS])
        if owner not in self._running and self._of_key(owner[0]) >= self._per_key:
            raise TooManyRequests(
                f"this key has {self._per_key} prefills computing already (TTFT_PREFILL_PER_KEY); a newer prefill of "
                "the same X-Prefill-Session supersedes the older one instead",
                code="too_many_prefills",
            )
        engine = self._engine
        prompt = await anyio.to_thread.run_sync(
            partial(engine.prepare_prefix, prompt=request.prompt, messages=request.messages, raw=request.raw)
        )
        cap = self._max_prompt_tokens
        if cap and prompt.n_tokens > cap:
            raise PromptTooLong(
                f"the prompt is {prompt.n_tokens} tokens; this server takes at most {cap} prompt tokens a request "
                "(TTFT_MAX_PROMPT_TOKENS): shorten it",
                param="messages" if request.prompt is None else "prompt",
                code="prompt_too_long",
            )
        salt = isolation.cache_salt(self._isolation, caller.key_id, request.cache_salt or "")
        accepted = Accepted(prompt.n_tokens, min(engine.cached(prompt, salt), prompt.n_tokens))
        older = self._running.pop(owner, None)
        if older is not None and not older.done():
            older.cancel()  # it stops at its next step; its blocks computed so far stay cached for this one
            self.superseded += 1
        task = asyncio.get_running_loop().create_task(self._run(owner, prompt, salt), name="ttft-prefill")
        self._running[owner] = task
        task.add_done_callback(partial(self._ended, owner))
        return accepted

    async def close(self) -> None:
        """Cancel every prefill (the drain) and wait for them to end."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _of_key(self, key: str) -> int:
        return sum(1 for owner in self._running if owner[0] == key)

    def _hold(self) -> bool:
        """A request waits for a slot: a prefill computes nothing meanwhile."""
        return self._gate.waiting > 0

    async def _run(self, owner: Owner, prompt: Prompt, salt: str) -> None:
        try:
            computed = await self._engine.prefill(prompt, cache_salt=salt, owner="\x00".join(owner), hold=self._hold)
        except asyncio.CancelledError:
            log.info("prefill", outcome="superseded", prompt_tokens=prompt.n_tokens, key_id=owner[0] or None)
            raise
        except Exception as exc:  # background work: nobody waits for it; the request that follows computes it
            log.warning("prefill", outcome="failed", error=f"{type(exc).__name__}: {exc}")
            return
        log.info("prefill", outcome="ok", prompt_tokens=prompt.n_tokens, computed=computed, key_id=owner[0] or None)

    def _ended(self, owner: Owner, task: asyncio.Task[None]) -> None:
        if self._running.get(owner) is task:
            del self._running[owner]
