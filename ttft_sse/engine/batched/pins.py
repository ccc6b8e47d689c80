"""Prefills' requests and the blocks they keep: a prompt's KV computed as background work, then pinned in the
library's paged cache so that the request that follows finds it.

A prefill (``POST /prefill``, :meth:`Pins.prefill`) is a request of the library of two tokens, marked in
``PrefixCounters.prefills`` so that the scheduler runs it only in what real requests leave
(engine/library/scheduler.py), and cancelled once its prompt is in the cache. Its whole blocks are then held under a
name of their own, as a request holds its blocks (:meth:`Pins.pin`), for ``TTFT_PREFILL_KEEP_SECONDS``; then they
are cached like any prefix. A warm prompt's (:meth:`Pins.warm`, computed before the server is ready) are held for
good. Pins are made and released between two steps, in the batching thread (``PrefixCounters.chores``); their
bookkeeping is the event loop's.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ttft_sse.engine.base import Hold, Progress, Prompt
from ttft_sse.engine.library import salts
from ttft_sse.engine.library.hooks import BLOCK_TOKENS
from ttft_sse.engine.library.scheduler import PrefixCounters
from ttft_sse.engine.threads import Mailboxes
from ttft_sse.errors import EngineError

PINNED_SHARE = 4
"""Prefills pin at most 1/PINNED_SHARE of the KV cache's tokens: a newer pin past it releases the oldest ones (their
blocks stay cached, evicted like any prefix when the cache runs short)."""
WARM_SHARE = 4
"""Warm prompts (``TTFT_WARM_PROMPTS``) keep at most 1/WARM_SHARE of the KV cache's tokens, apart from the prefills'
share: a warm prompt past it is not kept (its blocks are cached like any prefix)."""

Pin = tuple[str, int]
"""(the name the blocks are held under in the cache, their tokens)."""


class Pins:
    """The prefills' requests and pins of one engine. ``attach`` hands it the library's manager once it exists."""

    def __init__(
        self, counters: PrefixCounters, mailboxes: Mailboxes[str, Any], ids: itertools.count[int], keep_seconds: float
    ) -> None:
        self._counters = counters
        self._mailboxes = mailboxes
        self._ids = ids
        self._keep = keep_seconds
        self._manager: Any = None
        self.capacity = 0
        """The KV cache's tokens (0 until attached)."""
        self._pins: dict[str, Pin] = {}  # owner → its prefill's kept blocks, oldest first
        self.pinned = 0
        """Tokens prefills pin now."""
        self.kept = 0
        """Tokens warm prompts keep (for good)."""

    def attach(self, manager: Any, capacity: int) -> None:
        self._manager = manager
        self.capacity = capacity

    def fits(self, prompt: Prompt) -> bool:
        """A prefill of ``prompt`` fits the cache: its prompt, the token it computes, and a block of slack."""
        return self._manager is not None and prompt.n_tokens + 2 <= self.capacity - BLOCK_TOKENS

    def cached(self, prompt: Prompt, cache_salt: str = "") -> int:
        """The leading tokens of ``prompt`` whose blocks the cache holds for ``cache_salt`` (any thread)."""
        processor = getattr(self._manager, "batch_processor", None) if self._manager is not None else None
        cache = getattr(processor, "cache", None)
        if cache is None or not getattr(cache, "use_prefix_sharing", False):
            return 0
        return salts.cached(cache, prompt.token_ids, salts.seed_of(cache_salt))

    async def prefill(self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None) -> int:
        """Compute ``prompt`` into the cache, then pin its blocks for a while; the tokens it computed. The caller
        checks :meth:`fits`."""
        computed = await self._compute(prompt, cache_salt, hold)
        self.pin(owner, prompt, salts.seed_of(cache_salt))
        return computed

    async def warm(self, prompt: Prompt) -> bool:
        """Compute ``prompt`` into the cache and keep its blocks for good, where warm prompts keep less than
        1/:data:`WARM_SHARE` of the cache with it; whether it is kept. The caller checks :meth:`fits`."""
        if self.kept + prompt.n_tokens > self.capacity // WARM_SHARE:
            return False
        await self._compute(prompt, "", None)
        self._hold(prompt, None)
        self.kept += prompt.n_tokens
        return True

    async def _compute(self, prompt: Prompt, cache_salt: str, hold: Hold) -> int:
        """A request of the library that computes ``prompt`` and one token, cancelled once its prompt is in the
        cache; the tokens it computed (0 where every whole block is there already)."""
        before = self.cached(prompt, cache_salt)
        seed = salts.seed_of(cache_salt)
        if before >= (prompt.n_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS:
            return 0
        request_id = f"ttft-prefill-{next(self._ids)}"
        inbox = self._mailboxes.open(request_id)
        counters = self._counters
        if seed is not None:
            counters.seeds[request_id] = seed
        counters.prefills[request_id] = hold or _never
        in_library = False
        try:
            added = self._manager.add_request(
                list(prompt.token_ids),
                request_id=request_id,
                max_new_tokens=2,  # a request that ends in its first step leaves its last blocks unregistered
                streaming=True,
                eos_token_id=-1,
                temperature=0.0,
                top_p=1.0,
            )
            if added is None:
                raise EngineError("prefill failed: the batching loop is not accepting requests")
            in_library = True
            async for output in inbox:
                if isinstance(output, Progress):
                    continue
                if output.error is not None:
                    in_library = False
                    raise EngineError(f"prefill failed: {output.error}")
                break  # its first token: the whole prompt is in the cache, its whole blocks registered
            else:
                return 0  # close() is ending everything
        finally:
            inbox.close()
            counters.prefills.pop(request_id, None)
            counters.hit_by_request.pop(request_id, None)
            counters.seeds.pop(request_id, None)
            if in_library:
                self._manager.cancel_request(request_id)
        return prompt.n_tokens - before

    def pin(self, owner: str, prompt: Prompt, seed: int | None) -> None:
        """Hold ``prompt``'s whole blocks in the cache for ``TTFT_PREFILL_KEEP_SECONDS``, in place of ``owner``'s
        earlier pin; the oldest pins make room where prefills would pin more than 1/:data:`PINNED_SHARE` of it."""
        earlier = self._pins.pop(owner, None) if owner else None
        if earlier is not None:
            self._unpin(earlier)
        cap = self.capacity // PINNED_SHARE
        if self._keep <= 0 or prompt.n_tokens > cap:
            return
        while self._pins and self.pinned + prompt.n_tokens > cap:
            oldest = next(iter(self._pins))
            self._unpin(self._pins.pop(oldest))
        pin = self._hold(prompt, seed)
        self._pins[owner or pin[0]] = pin
        self.pinned += prompt.n_tokens
        asyncio.get_running_loop().call_later(self._keep, self._expire, owner or pin[0], pin)

    def _hold(self, prompt: Prompt, seed: int | None) -> Pin:
        """Have the batching thread hold ``prompt``'s whole blocks under a new name, as a request holds its own."""
        name = f"ttft-pin-{next(self._ids)}"
        seeds, ids = self._counters.seeds, list(prompt.token_ids)

        def hold(cache: Any) -> None:
            if seed is not None:
                seeds[name] = seed
            cache.search_prefix_match(name, ids)

        self._counters.chores.append(hold)
        return name, prompt.n_tokens

    def _expire(self, owner: str, pin: Pin) -> None:
        if self._pins.get(owner) == pin:
            del self._pins[owner]
            self._unpin(pin)

    def _unpin(self, pin: Pin) -> None:
        name, tokens = pin
        self.pinned -= tokens
        seeds = self._counters.seeds

        def release(cache: Any) -> None:
            cache.free_blocks(name)
            seeds.pop(name, None)

        self._counters.chores.append(release)


def _never() -> bool:
    return False
