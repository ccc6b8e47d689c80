"""Prefixes that survive a restart (``TTFT_PREFIX_STORE_BYTES``): the KV blocks of the pinned and the most used
prefixes written to the cache directory on drain, and read back into the paged cache at start, before ready.

**On drain** (:meth:`PrefixStore.store`), with the batching loop paused between two steps (the library's
``ContinuousBatchingManager.pause``), the blocks the cache holds for these prompts, in this order, are copied out
until the bound in bytes: the pinned ones (engine/batched/pins.py: the warm prompts, the prefixes restored at start,
the prefills' pins, newest first), then those the scheduler noted (engine/library/uses.py), the most hit first. Each
in every mode the engine has (engine/modes.py), with its salt's seed. The file (engine/batched/prefix_file.py)
is then written beside the model's other files, whole or not at all.

**At start** (:meth:`PrefixStore.restore`, its own start-up stage, after the warm-up and before the warm prompts),
with the loop paused, each prefix's blocks are put back: a block the cache holds already (same hash) is shared, any
other takes a free block, gets the file's bytes and is registered under its hash, as the library registers a block a
step completed. Every prefix is held under a name of its own, as a request holds its blocks, so that a request finds
it as if it had been computed; the warm prompts' share keeps them for good (:meth:`Pins.keep_restored`), the others
are cached like any prefix. At most half the cache is restored. The bytes are the ones the cache held, so a request
gets exactly the answer a fresh computation gives, provided the same arithmetic computed them: the file's key
(:func:`key`) names everything that decides it, and a file of another key is not read.

A file that is missing, not whole, changed (its checksum) or another server's (its key) is ignored with one log line
(``prefix_store``, ``outcome: ignored``, ``what`` and ``reason``) and the server starts cold; so is a cache whose
internals are not the ones this code knows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog

from ttft_sse.engine import kv_file
from ttft_sse.engine.base import NORMAL, ModelInfo
from ttft_sse.engine.batched import prefix_file
from ttft_sse.engine.batched.pins import Pinned, Pins
from ttft_sse.engine.batched.prefix_file import Prefix, Stored
from ttft_sse.engine.kv_file import Unusable, model_key, path_of
from ttft_sse.engine.library import internals
from ttft_sse.engine.library.paged_cache import BLOCK_TOKENS
from ttft_sse.engine.library.scheduler import PrefixCounters
from ttft_sse.settings import Settings

log = structlog.get_logger("ttft_sse.engine")

RESTORE_SHARE = 2
"""A restore fills at most 1/RESTORE_SHARE of the KV cache: the rest is the requests'."""
ALLOCATOR_PARTS = ("_copy_view", "ledger", "block_table", "pool", "index", "tokens_per_page", "bytes_per_block")
"""What the store uses of each of the library's cache allocators (instance attributes: looked up at use)."""

T = TypeVar("T")

Candidate = tuple[Sequence[int], int | None, Sequence[str]]
"""A prompt whose cached blocks to keep: its ids, its salt's seed, the modes to look for its blocks in."""


class PrefixStore:
    """One engine's prefix file: what :meth:`store` writes on drain and :meth:`restore` reads at start. For the event
    loop; the cache is read and written in a worker thread while the batching loop is paused."""

    def __init__(self, settings: Settings, counters: PrefixCounters, pins: Pins) -> None:
        self._settings = settings
        self._counters = counters
        self._pins = pins

    async def store(self, manager: Any, info: ModelInfo) -> None:
        """Write the pinned and most used prefixes' blocks, within ``TTFT_PREFIX_STORE_MB``; one log line."""
        started = time.perf_counter()
        candidates: list[Candidate] = [(ids, seed, info.modes) for ids, seed in self._pins.held()]
        budget = self._settings.prefix_store_mb * 2**20

        def collect(cache: Any) -> Stored:
            candidates.extend((use.ids, use.seed, (use.mode,)) for use in self._counters.uses.ranked())
            return copy_out(cache, candidates, budget, key(info, cache, self._settings))

        stored = await asyncio.to_thread(_paused, manager, collect)
        if stored is None:
            log.warning("prefix_store", outcome="not_written", reason=_NO_CACHE)
        elif not stored.prefixes:
            log.info("prefix_store", outcome="not_written", reason="the cache holds no block of a prefix to keep")
        elif await asyncio.to_thread(prefix_file.write, path := self.path(info), stored):
            log.info("prefix_store", outcome="written", path=str(path), **kv_file.sizes(stored, started))

    async def restore(self, manager: Any, info: ModelInfo) -> None:
        """Read the prefix file back into the cache and keep what the warm prompts' share allows; one log line."""
        started = time.perf_counter()
        cache = await asyncio.to_thread(_paused, manager, lambda cache: cache)
        if cache is None:
            log.warning("prefix_store", outcome="ignored", what="internals", reason=_NO_CACHE)
            return
        path = self.path(info)
        read = await asyncio.to_thread(prefix_file.read, path, key(info, cache, self._settings))
        if isinstance(read, Unusable):
            (log.info if read.what == "missing" else log.warning)(
                "prefix_store", outcome="ignored", what=read.what, reason=read.reason
            )
            return
        names = [self._pins.name() for _ in read.prefixes]
        limit = self._pins.capacity // RESTORE_SHARE

        def put_back(cache: Any) -> list[Pinned]:
            restored = copy_in(cache, read, names, limit)
            self._counters.uses.extend((p.tokens, p.seed, p.mode) for p, _ in restored)
            return [pinned for _, pinned in restored]

        restored = await asyncio.to_thread(_paused, manager, put_back)
        if restored is None:
            log.warning("prefix_store", outcome="ignored", what="internals", reason=_NO_CACHE)
            return
        kept = self._pins.keep_restored(restored)
        log.info(
            "prefix_store",
            outcome="restored",
            path=str(path),
            restored_prefixes=len(restored),
            restored_tokens=sum(p.tokens for p in restored),
            kept_tokens=kept,
            **kv_file.sizes(read, started),
        )

    def path(self, info: ModelInfo) -> Path:
        """The model's prefix file in the cache directory."""
        return path_of(self._settings.cache_dir, info.source)


_NO_CACHE = "the batching loop holds no paged cache this code knows (transformers' internals differ), or it stopped"


def _paused(manager: Any, work: Callable[[Any], T]) -> T | None:
    """``work(cache)`` in this thread while the batching loop is paused between two steps (the library's own pause:
    no step runs, no request is scheduled); None where the loop is not running or its cache is not one this code
    knows."""
    import torch

    if manager is None or not manager.is_running():
        return None
    with manager.pause(), torch.inference_mode():  # the cache is an inference tensor: written in that mode only
        cache = _cache(manager)
        return None if cache is None else work(cache)


def _cache(manager: Any) -> Any:
    """The manager's paged cache, where its allocators have what the store uses and share prefixes; else None."""
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    allocators = list(getattr(cache, "cache_allocators", {}).values())
    if not allocators or not getattr(cache, "use_prefix_sharing", False):
        return None
    if not all(hasattr(a, part) for a in allocators for part in ALLOCATOR_PARTS):
        return None
    if len({a.tokens_per_page for a in allocators}) != 1:
        return None
    return cache


def key(info: ModelInfo, cache: Any, settings: Settings) -> dict[str, Any]:
    """What decides a KV block's bytes: the model file, the engine and every choice of its arithmetic (the weights'
    layout and rows, the decoder layers, the attention, the torch threads, the C sources built for this CPU), the
    cache's dtype and each allocator's geometry."""
    import transformers

    return {
        "model": model_key(info.source),
        "engine": "batched",
        "device": info.device,
        "dtype": info.dtype,
        "weights": info.weights,
        "decoder": info.decoder,
        "modes": list(info.modes),
        "paged_attention": settings.paged_attention,
        "grouped_attention": settings.grouped_attention,
        "threads": settings.torch_threads,
        "native": _native_key(),
        "transformers": transformers.__version__,
        "kv_dtype": str(cache.dtype).removeprefix("torch."),
        "block_tokens": BLOCK_TOKENS,
        "allocators": {
            name: [type(a).__name__, list(a.layer_indices), a.tokens_per_page, a.bytes_per_block]
            for name, a in cache.cache_allocators.items()
        },
    }


def _native_key() -> str | None:
    """The C sources' build key on this CPU (engine/kernels/compiler.py), or None where no compiler builds them."""
    from ttft_sse.engine.kernels import compiler

    try:
        return compiler.key(tuple(sorted(Path(compiler.__file__).parent.glob("*.c"))))
    except RuntimeError:
        return None


def _salted(ids: Sequence[int], mode: str) -> list[int]:
    """The ids a mode's blocks are hashed from (engine/library/salts.py's ``keep_apart``)."""
    return list(ids) if mode == NORMAL else [-1 - token for token in ids]


def _compute() -> Callable[[int | None, list[int]], int]:
    fn: Callable[[int | None, list[int]], int] = internals.batching().compute_block_hash
    return fn


def copy_out(cache: Any, candidates: Sequence[Candidate], budget: int, key: dict[str, Any]) -> Stored:
    """The blocks ``cache`` holds for ``candidates``, in order, each prompt's leading whole blocks as far as they are
    cached, within ``budget`` bytes; a block two prompts share is copied once. Call it with the loop paused."""
    import torch

    compute = _compute()
    allocators = list(cache.cache_allocators.items())
    page = allocators[0][1].tokens_per_page
    per_row = sum(a.bytes_per_block for _, a in allocators)
    rows: dict[int, int] = {}  # block hash → row
    blocks: list[list[int]] = [[] for _ in allocators]
    prefixes: list[Prefix] = []
    for ids, seed, modes in candidates:
        for mode in modes:
            salted = _salted(ids, mode)
            found: list[int] = []
            parent = seed
            for start in range(0, len(salted) - page + 1, page):
                parent = compute(parent, salted[start : start + page])
                held = [a.ledger.hash_to_block.get(parent) for _, a in allocators]
                if any(block is None for block in held):
                    break
                row = rows.get(parent)
                if row is None:
                    if (len(rows) + 1) * per_row > budget:
                        break
                    row = rows[parent] = len(rows)
                    for listed, block in zip(blocks, held, strict=True):
                        listed.append(int(block))
                found.append(row)
            tokens = tuple(ids[: len(found) * page])
            if found and not any(_covers(p, tokens, seed, mode) for p in prefixes):
                prefixes.append(Prefix(tokens, seed, mode, tuple(found)))
    tensors = {
        name: a._copy_view.index_select(0, torch.tensor(listed, dtype=torch.long))
        for (name, a), listed in zip(allocators, blocks, strict=True)
    }
    return Stored(key, tuple(prefixes), tensors)


def _covers(prefix: Prefix, tokens: tuple[int, ...], seed: int | None, mode: str) -> bool:
    """``prefix`` holds every block of ``tokens`` already."""
    return prefix.seed == seed and prefix.mode == mode and prefix.tokens[: len(tokens)] == tokens


def copy_in(cache: Any, stored: Stored, names: Sequence[str], limit: int) -> list[tuple[Prefix, Pinned]]:
    """Put ``stored``'s prefixes back into ``cache``, each held under its name of ``names``, until ``limit`` tokens of
    new blocks or a full cache; the prefixes put back (a prefix cut short where its next block found no room), each
    with its pin. Call it with the loop paused."""
    compute = _compute()
    allocators = list(cache.cache_allocators.items())
    page = allocators[0][1].tokens_per_page
    added = 0
    restored: list[tuple[Prefix, Pinned]] = []
    for prefix, name in zip(stored.prefixes, names, strict=True):
        salted = _salted(prefix.tokens, prefix.mode)
        tables: list[list[int]] = [[] for _ in allocators]
        parent = prefix.seed
        for j, row in enumerate(prefix.rows):
            chunk = salted[j * page : (j + 1) * page]
            if len(chunk) < page:
                break
            parent = compute(parent, chunk)
            held = [a.ledger.hash_to_block.get(parent) for _, a in allocators]
            missing = [i for i, block in enumerate(held) if block is None]
            if missing and (added + page > limit or not _room(cache, [allocators[i][1] for i in missing])):
                break
            for i, ((alloc_name, allocator), block) in enumerate(zip(allocators, held, strict=True)):
                if block is None:
                    block = allocator.pool.get_free_blocks(allocator.index, 1)[0]
                    allocator._copy_view[block].copy_(stored.blocks[alloc_name][row])
                    allocator.ledger.register_new_hash(block, parent)
                else:
                    allocator.ledger.acquire(block)
                tables[i].append(int(block))
            added += page if missing else 0
        if not tables[0]:
            continue
        for (_, allocator), table in zip(allocators, tables, strict=True):
            allocator.block_table[name] = table
        tokens = prefix.tokens[: len(tables[0]) * page]
        put = Prefix(tokens, prefix.seed, prefix.mode, prefix.rows[: len(tables[0])])
        restored.append((put, Pinned(name, tokens, prefix.seed, len(tokens))))
    return restored


def _room(cache: Any, allocators: Sequence[Any]) -> bool:
    """A free block for each of ``allocators``, a free sector given to those that have none (as the library does)."""
    short = [a for a in allocators if a.pool.count_free_blocks(a.index) == 0]
    if len(short) > cache.pool.num_free_sectors:
        return False
    for allocator in short:
        cache.pool.allocate_sector(allocator.index)
    return True
