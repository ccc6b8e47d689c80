"""Prefills' requests and the blocks they keep: a prompt's KV computed as background work, then pinned in the
library's paged cache so that the request that follows finds it.

A prefill (``POST /prefill``, :meth:`Pins.prefill`) is a request of the library of two tokens, marked in
``PrefixCounters.prefills`` so that the scheduler runs it only in what real requests leave
(engine/library/scheduler.py), and cancelled once its prompt is in the cache, or ended by the scheduler where a real
request starting with its prompt takes it over (:class:`TakenOver`). Its whole blocks are then held under a
name of their own, as a request holds its blocks (:meth:`Pins.pin`), for ``TTFT_PREFILL_KEEP_SECONDS``; then they
are cached like any prefix. A warm prompt's (:meth:`Pins.warm`, computed before the server is ready) are held for
good. Prefixes read back from the prefix store at start (engine/batched/prefix_store.py, held as the restore made
them) are kept for good in the warm prompts' share too (:meth:`Pins.keep_restored`), behind the warm prompts: a
warm prompt they hold already takes their pin over, and one that needs the room takes it from the last of them.
Pins are made and released between two steps, in the batching thread (``PrefixCounters.chores``); their bookkeeping
is the event loop's.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ttft_sse.engine.base import Hold, Progress, Prompt
from ttft_sse.engine.library import salts
from ttft_sse.engine.library.paged_cache import BLOCK_TOKENS
from ttft_sse.engine.library.scheduler import PrefixCounters
from ttft_sse.engine.threads import Mailboxes
from ttft_sse.errors import EngineError

log = structlog.get_logger("ttft_sse.engine")

PINNED_SHARE = 4
"""Prefills pin at most 1/PINNED_SHARE of the KV cache's tokens: a newer pin past it releases the oldest ones (their
blocks stay cached, evicted like any prefix when the cache runs short)."""
WARM_SHARE = 4
"""Warm prompts (``TTFT_WARM_PROMPTS``) keep at most 1/WARM_SHARE of the KV cache's tokens, apart from the prefills'
share: a warm prompt past it is not kept (its blocks are cached like any prefix)."""


@dataclass(frozen=True)
class TakenOver:
    """To a prefill's inbox: a real request starting with its prompt took it over, with ``cached`` of its prompt
    tokens in the cache (engine/library/scheduler.py)."""

    cached: int


@dataclass
class Pinned:
    """Blocks held in the cache under ``name``: those of the prompt ``ids`` for the salt's ``seed``, counted as
    ``tokens`` against their share. ``restored``: read back from the prefix store, and kept only while the warm
    prompts leave room."""

    name: str
    ids: tuple[int, ...]
    seed: int | None
    tokens: int
    restored: bool = False


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
        self._pins: dict[str, Pinned] = {}  # owner → its prefill's kept blocks, oldest first
        self._kept: list[Pinned] = []  # kept for good: the warm prompts, then the restored prefixes
        self.pinned = 0
        """Tokens prefills pin now."""
        self.kept = 0
        """Tokens warm prompts and restored prefixes keep (for good)."""
        counters.taken_over = self._taken_over

    def attach(self, manager: Any, capacity: int) -> None:
        self._manager = manager
        self.capacity = capacity

    def name(self) -> str:
        """A new name to hold blocks under in the cache."""
        return f"ttft-pin-{next(self._ids)}"

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
        1/:data:`WARM_SHARE` of the cache with it (restored prefixes give it their room); whether it is kept. The
        caller checks :meth:`fits`."""
        if self._adopt(prompt):
            return True
        share = self.capacity // WARM_SHARE
        while self.kept + prompt.n_tokens > share and self._kept and self._kept[-1].restored:
            self._release_kept(self._kept.pop())
        if self.kept + prompt.n_tokens > share:
            return False
        await self._compute(prompt, "", None)
        warm = self._hold(prompt.token_ids, None, prompt.n_tokens)
        self._kept.insert(sum(not p.restored for p in self._kept), warm)
        self.kept += prompt.n_tokens
        return True

    def _adopt(self, prompt: Prompt) -> bool:
        """A restored prefix holding every whole block of ``prompt`` (no salt) becomes its warm prompt's pin."""
        whole = (prompt.n_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        for i, pinned in enumerate(self._kept):
            if pinned.restored and pinned.seed is None and whole and pinned.ids[:whole] == prompt.token_ids[:whole]:
                del self._kept[i]
                pinned.restored = False
                self._kept.insert(sum(not p.restored for p in self._kept), pinned)
                return True
        return False

    def keep_restored(self, restored: Sequence[Pinned]) -> int:
        """Keep the prefixes the prefix store read back, held in the cache under their names, in order, while the
        warm prompts' share has room; the others' blocks are released (cached like any prefix). The tokens kept."""
        kept = 0
        for pinned in restored:
            if self.kept + pinned.tokens <= self.capacity // WARM_SHARE:
                pinned.restored = True
                self._kept.append(pinned)
                self.kept += pinned.tokens
                kept += pinned.tokens
            else:
                self._release(pinned.name)
        return kept

    def held(self) -> list[tuple[tuple[int, ...], int | None]]:
        """The prompts (ids, salt's seed) whose blocks are pinned, the first to keep first: the warm prompts, the
        restored prefixes, then the prefills' pins, the newest first."""
        pins = [*self._kept, *reversed(self._pins.values())]
        return [(pinned.ids, pinned.seed) for pinned in pins]

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
                if isinstance(output, TakenOver):
                    in_library = False  # the scheduler ended it
                    log.info("prefill_taken_over", prompt_tokens=prompt.n_tokens, cached=output.cached)
                    return max(0, output.cached - before)
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

    def _taken_over(self, request_id: str, cached: int) -> None:
        """The batching thread: a request took the prefill ``request_id`` over (engine/library/scheduler.py)."""
        self._mailboxes.deliver([(request_id, TakenOver(cached))])

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
        pin = self._hold(prompt.token_ids, seed, prompt.n_tokens)
        self._pins[owner or pin.name] = pin
        self.pinned += prompt.n_tokens
        asyncio.get_running_loop().call_later(self._keep, self._expire, owner or pin.name, pin)

    def _hold(self, ids: tuple[int, ...], seed: int | None, tokens: int) -> Pinned:
        """Have the batching thread hold the whole blocks of ``ids`` under a new name, as a request holds its own."""
        name = self.name()
        seeds, listed = self._counters.seeds, list(ids)

        def hold(cache: Any) -> None:
            if seed is not None:
                seeds[name] = seed
            cache.search_prefix_match(name, listed)

        self._counters.chores.append(hold)
        return Pinned(name, tuple(ids), seed, tokens)

    def _expire(self, owner: str, pin: Pinned) -> None:
        if self._pins.get(owner) is pin:
            del self._pins[owner]
            self._unpin(pin)

    def _unpin(self, pin: Pinned) -> None:
        self.pinned -= pin.tokens
        self._release(pin.name)

    def _release_kept(self, pin: Pinned) -> None:
        self.kept -= pin.tokens
        self._release(pin.name)

    def _release(self, name: str) -> None:
        """Have the batching thread let go of the blocks held under ``name`` (cached like any prefix's from then)."""
        seeds = self._counters.seeds

        def release(cache: Any) -> None:
            cache.free_blocks(name)
            seeds.pop(name, None)

        self._counters.chores.append(release)


def _never() -> bool:
    return False
