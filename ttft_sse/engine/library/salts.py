"""Prefix-cache isolation in the library's paged cache: a request's blocks are hashed from its cache salt, and
from the mode that computed them.

The library chains each whole block's hash to its parent's from ``None`` (``compute_block_hash``), so two requests
with the same leading tokens share those blocks, whoever sent them. A shared cache tells a caller, by the time its
first token takes, whether some other caller sent the same prompt lately (docs/settings.md, "Isolation"). A request
with a salt (its key's, with ``TTFT_PREFIX_ISOLATION=key``, and its own ``cache_salt``) chains its hashes from the
salt's seed instead: it matches only blocks hashed with the same seed, and the blocks it completes are found only by
requests with that seed. A request without one hashes as the library does.

:func:`install` replaces, on one cache's instances only, the cache's prefix search and each allocator's block
registration with the library's own loops seeded by the request's salt (``seeds``: request id → seed, written by the
engine before the request reaches the library, read in the batching thread). :func:`cached` counts, from any thread,
the leading tokens of a prompt whose blocks the cache holds for a seed. :func:`keep_apart` does the same for the
engine's modes (engine/modes.py): a block computed in int8 rows is shared only with requests in int8 rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from ttft_sse.engine.base import NORMAL
from ttft_sse.engine.library import internals
from ttft_sse.engine.modes import Modes


def seed_of(salt: str) -> int | None:
    """The hash seed of ``salt`` (None for the empty salt: the library's own chain)."""
    if not salt:
        return None
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8, person=b"ttft-salt").digest(), "little")


def install(cache: Any, seeds: dict[str, int]) -> None:
    """Make ``cache`` (the library's ``PagedAttentionCache``) hash each request's blocks from ``seeds[request_id]``
    where it has one. Install it before any other wrapper of the same methods (:func:`keep_apart` wraps these)."""
    compute = internals.batching().compute_block_hash
    search = cache.search_prefix_match
    current: list[int | None] = [None]  # the seed of the prompt being matched (the batching thread's)

    def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
        current[0] = seeds.get(request_id)
        try:
            return int(search(request_id, prompt_ids))
        finally:
            current[0] = None

    cache.search_prefix_match = search_prefix_match
    for allocator in cache.cache_allocators.values():
        match, mark = allocator.match_prefix_blocks, allocator.mark_complete_blocks

        def match_prefix_blocks(prompt_ids: list[int], allocator: Any = allocator, match: Any = match) -> Any:
            seed = current[0]
            if seed is None:
                return match(prompt_ids)
            return _matched(allocator, compute, prompt_ids, seed)

        def mark_complete_blocks(
            request_id: str, token_ids: list[int], blocks: int, allocator: Any = allocator, mark: Any = mark
        ) -> None:
            seed = seeds.get(request_id)
            if seed is None:
                mark(request_id, token_ids, blocks)
            else:
                _mark(allocator, compute, request_id, token_ids, blocks, seed)

        allocator.match_prefix_blocks = match_prefix_blocks
        allocator.mark_complete_blocks = mark_complete_blocks


def cached(cache: Any, token_ids: Sequence[int], seed: int | None, salted: Any = None) -> int:
    """Leading tokens of ``token_ids`` whose blocks ``cache`` holds for requests of ``seed``, short of the last
    token (a request computes that one itself), in every allocator. ``salted`` maps token ids as the engine's mode
    does (engine/modes.py), if it does. Reads only: safe beside the batching thread."""
    compute = internals.batching().compute_block_hash
    ids = list(token_ids) if salted is None else salted(list(token_ids))
    held: int | None = None
    for allocator in list(cache.cache_allocators.values()):
        blocks = _matched(allocator, compute, ids, seed)
        tokens = len(blocks) * allocator.tokens_per_page
        held = tokens if held is None else min(held, tokens)
    return held or 0


def _matched(allocator: Any, compute: Any, prompt_ids: list[int], seed: int | None) -> list[int]:
    """The library's ``CacheAllocator.match_prefix_blocks``, its chain started from ``seed``."""
    page = allocator.tokens_per_page
    matched: list[int] = []
    current = seed
    for b in range((len(prompt_ids) - 1) // page):
        current = compute(current, prompt_ids[b * page : (b + 1) * page])
        block = allocator.ledger.hash_to_block.get(current)
        if block is None:
            break
        matched.append(block)
    return matched


def _mark(allocator: Any, compute: Any, request_id: str, token_ids: list[int], new_blocks: int, seed: int) -> None:
    """The library's ``CacheAllocator.mark_complete_blocks``, its chain started from ``seed``: each block completed
    by the last pass is registered (or, where an identical one is, replaced by it)."""
    table = allocator.block_table[request_id]
    ledger, page = allocator.ledger, allocator.tokens_per_page
    parent: int | None = seed
    for i, block in enumerate(table):
        block_hash = ledger.block_to_hash.get(block)
        if block_hash is None:
            tokens = token_ids[i * page : (i + 1) * page]
            if new_blocks == 0 or len(tokens) < page:
                break
            block_hash = compute(parent, tokens)
            new_blocks -= 1
            identical = ledger.register_new_hash(block, block_hash)
            if identical is not None:
                ledger.acquire(identical)
                table[i] = identical
                if ledger.release(block):
                    allocator.pool.free_blocks(allocator.index, [block])
        parent = block_hash


def keep_apart(cache: Any, modes: Modes) -> None:
    """Make the library's paged cache ``cache`` share KV blocks between requests of one mode only: its allocators
    hash the token ids of a step not in ``normal`` as ``-1 - id`` (the mode of :attr:`Modes.current`: the step's),
    for prefix matches and for the blocks a step completes alike, and the blocks of a request computed in two modes
    are not registered for sharing at all. The interludes' matches and registrations, in the batching thread, go
    through the same allocators."""

    def salted(ids: list[int]) -> list[int]:
        return ids if modes.current == NORMAL else [-1 - token for token in ids]

    for allocator in cache.cache_allocators.values():
        match, mark = allocator.match_prefix_blocks, allocator.mark_complete_blocks

        def match_prefix_blocks(prompt_ids: list[int], match: Any = match) -> Any:
            return match(salted(prompt_ids))

        def mark_complete_blocks(request_id: str, token_ids: list[int], blocks: int, mark: Any = mark) -> None:
            mark(request_id, salted(token_ids), blocks)

        allocator.match_prefix_blocks = match_prefix_blocks
        allocator.mark_complete_blocks = mark_complete_blocks

    register = cache.mark_complete_blocks

    def mark_complete(state: Any, complete_blocks: dict[str, int]) -> None:
        if not modes.mixed(state.request_id):
            register(state, complete_blocks)

    cache.mark_complete_blocks = mark_complete
