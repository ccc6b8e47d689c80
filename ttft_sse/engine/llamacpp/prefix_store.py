"""Prefixes that survive a restart on the llama.cpp engine (``TTFT_PREFIX_STORE_MB``): the KV cells that free sequence
ids keep (engine/llamacpp/schedule.py's ``kept``) written to the cache directory on drain, and read back into free
ids at start, before ready.

**On drain** (:meth:`PrefixStore.store`), in the loop's thread between two steps, the free ids' cells are copied out
as llama.cpp gives a sequence's state (``llama_state_seq_get_data``: its cells' positions, every layer's keys and
values), the most useful first (the schedule's ``ranked``: the prompts that prefills and warm prompts computed, the
newest first, then the others, the one a request left last first), each whole, until the bound in bytes; an id whose
tokens another one chosen holds already, with the same salt, is left out. The file (engine/kv_file.py) is then
written beside the model's other files, whole or not at all.

**At start** (:meth:`PrefixStore.restore`, its own start-up stage, after the warm-up and before the warm prompts),
in the loop's thread, each prefix goes back into a free id (``llama_state_seq_set_data``), those holding nothing
first, the most useful as the id left last (the last a request evicts), and the schedule's ``kept`` says what it
holds: a request that starts with it takes that id and reports it as ``cached_tokens``. A prefix a prefill had
computed is kept ``TTFT_PREFILL_KEEP_SECONDS`` for the request to come, as the prefill's was. The bytes are the ones
the cells held, so a request gets exactly the answer a fresh computation gives, provided the same arithmetic computed
them and the same layout holds them: the file's key (:func:`key`) names all of it, and a file of another key is not
read.

A file that is missing, not whole, changed (its checksum) or another server's (its key) is ignored with one log line
(``prefix_store``, ``outcome: ignored``, ``what`` and ``reason``) and the server starts cold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import structlog

from ttft_sse.engine import kv_file
from ttft_sse.engine.base import NORMAL, ModelInfo
from ttft_sse.engine.kv_file import Unusable
from ttft_sse.engine.llamacpp import library
from ttft_sse.engine.llamacpp.schedule import Schedule
from ttft_sse.settings import Settings

log = structlog.get_logger("ttft_sse.engine")

ENGINE = "llamacpp"
FORMAT = 1
"""Bumped when what the file holds changes: a file of another format is not read."""
TENSOR = "state."
"""Each prefix's state is a tensor of bytes named this and the prefix's place in the file."""

T = TypeVar("T")
Visit = Callable[[Callable[[library.Runner, Schedule], T]], Awaitable[T]]
"""Runs work in the engine's loop thread between two steps, with its runner and schedule, and gives its result."""


@dataclass(frozen=True)
class Prefix:
    """A prefix kept in the file: the tokens whose KV its state holds, its salt's hash (engine/llamacpp/schedule.py's
    ``salt_hash``), whether a prefill computed it, and its state's bytes (uint8)."""

    tokens: tuple[int, ...]
    salt: str
    kept: bool
    state: np.ndarray

    def as_json(self, place: int) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "salt": self.salt, "kept": self.kept, "state": place}


@dataclass(frozen=True)
class Stored:
    """What the file holds: its key and its prefixes, the first to keep first."""

    key: Mapping[str, Any]
    prefixes: tuple[Prefix, ...]

    @property
    def bytes(self) -> int:
        return sum(int(p.state.size) for p in self.prefixes)


class PrefixStore:
    """One llama.cpp engine's prefix file: what :meth:`store` writes on drain and :meth:`restore` reads at start.
    For the event loop; the cells are read and written in the engine's loop thread (``visit``)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    async def store(self, visit: Visit[Stored], runner: library.Runner, info: ModelInfo) -> None:
        """Write the free ids' prefixes, the most useful first, within ``TTFT_PREFIX_STORE_MB``; one log line."""
        started = time.perf_counter()
        budget = self._settings.prefix_store_mb * 2**20
        ours = key(info, runner)
        stored = await visit(lambda runner, schedule: copy_out(runner, schedule, budget, ours))
        if not stored.prefixes:
            log.info("prefix_store", outcome="not_written", reason="no free sequence holds a prefix that fits")
        elif await asyncio.to_thread(write, path := self.path(info), stored):
            log.info("prefix_store", outcome="written", path=str(path), **kv_file.sizes(stored, started))

    async def restore(self, visit: Visit[list[Prefix]], runner: library.Runner, info: ModelInfo) -> None:
        """Read the prefix file back into free ids; one log line."""
        started = time.perf_counter()
        path = self.path(info)
        read_back = await asyncio.to_thread(read, path, key(info, runner))
        if isinstance(read_back, Unusable):
            (log.info if read_back.what == "missing" else log.warning)(
                "prefix_store", outcome="ignored", what=read_back.what, reason=read_back.reason
            )
            return
        restored = await visit(lambda runner, schedule: copy_in(runner, schedule, read_back))
        log.info(
            "prefix_store",
            outcome="restored",
            path=str(path),
            restored_prefixes=len(restored),
            restored_tokens=sum(len(p.tokens) for p in restored),
            **kv_file.sizes(read_back, started),
        )

    def path(self, info: ModelInfo) -> Path:
        """The model's prefix file of this engine in the cache directory."""
        return kv_file.path_of(self._settings.cache_dir, info.source, ENGINE)


def key(info: ModelInfo, runner: library.Runner) -> dict[str, Any]:
    """What decides a state's bytes and whether this context takes them: the model file; the engine and its one
    mode; the llama.cpp build (llama-cpp-python's version pins its llama.cpp) and the CPU features its kernels use
    here; the threads (the bundled model's states come out the same on 1 and 2, but llama.cpp promises nothing);
    the most rows a step computes (below it a row's attention is the same whatever the step holds); the context's
    choices (the cache's types, flash attention, a stream per sequence); and the sequences, whose streams a state
    lists (llama.cpp refuses a state of another count). Not the cells each sequence has: they hold a KV cell's bytes
    as they are, and a prefix longer than this context's sequences is not put back."""
    return {
        "model": kv_file.model_key(info.source),
        "engine": ENGINE,
        "mode": NORMAL,
        "llama_cpp": library.VERSION,
        "cpu": runner.system,
        "threads": runner.shape.threads,
        "rows_per_step": library.ROWS_PER_STEP,
        "context": dict(runner.choices),
        "sequences": runner.shape.sequences,
    }


def copy_out(runner: library.Runner, schedule: Schedule, budget: int, key: Mapping[str, Any]) -> Stored:
    """The free ids' states, in the schedule's ranking, each whole while they fit ``budget`` bytes; an id whose
    tokens (and salt) a prefix chosen already starts with is left out, and so is one whose cells do not hold exactly
    its tokens' positions. In the loop's thread."""
    prefixes: list[Prefix] = []
    used = 0
    for seq in schedule.ranked():
        kept = schedule.kept[seq]
        n = len(kept.tokens)
        if any(p.salt == kept.salt and p.tokens[:n] == kept.tokens for p in prefixes):
            continue
        if runner.last_position(seq) != n - 1:
            continue
        size = runner.state_size(seq)
        if used + size > budget:
            continue
        state = runner.state(seq)
        used += int(state.size)
        prefixes.append(Prefix(kept.tokens, kept.salt, kept.until > 0, state))
    return Stored(dict(key), tuple(prefixes))


def copy_in(runner: library.Runner, schedule: Schedule, stored: Stored) -> list[Prefix]:
    """Put ``stored``'s prefixes back into free ids (as many as there are, the first ones first), the first as the id
    left last; the prefixes put back. A prefix longer than a sequence's cells, or that llama.cpp refuses, is not.
    In the loop's thread."""
    fitting = [p for p in stored.prefixes if len(p.tokens) <= runner.cells_per_sequence]
    ids = schedule.vacant()
    chosen = fitting[: len(ids)]
    restored = []
    for prefix, seq in zip(reversed(chosen), ids, strict=False):  # the first one last: the id left last
        if runner.set_state(seq, prefix.state) and runner.last_position(seq) == len(prefix.tokens) - 1:
            schedule.hold(seq, prefix.salt, prefix.tokens, keep=prefix.kept)
            restored.append(prefix)
        else:
            runner.forget(seq)
            schedule.hold(seq, "", ())
    return restored[::-1]


def write(path: Path, stored: Stored) -> bool:
    """Write ``stored`` at ``path``, whole or not at all; False where the directory cannot be written (logged)."""
    import torch

    tensors = {f"{TENSOR}{i}": torch.from_numpy(np.ascontiguousarray(p.state)) for i, p in enumerate(stored.prefixes)}
    prefixes = [p.as_json(i) for i, p in enumerate(stored.prefixes)]
    return kv_file.write(path, stored.key, FORMAT, prefixes, tensors)


def read(path: Path, key: Mapping[str, Any]) -> Stored | Unusable:
    """The file at ``path`` if it is whole, its checksum matches and its key is ``key``; else why not."""

    def parse(entries: Sequence[Any], tensors: Mapping[str, Any]) -> Stored:
        return Stored(dict(key), tuple(_prefix(entry, tensors) for entry in entries))

    return kv_file.read(path, key, FORMAT, parse)


def _prefix(entry: Mapping[str, Any], tensors: Mapping[str, Any]) -> Prefix:
    tokens = tuple(int(t) for t in entry["tokens"])
    if not tokens:
        raise ValueError("a prefix of no tokens")
    salt = entry["salt"]
    if not isinstance(salt, str):
        raise TypeError(f"a salt of {salt!r}")
    state = tensors[f"{TENSOR}{int(entry['state'])}"]
    if state.dtype != _uint8() or state.dim() != 1 or not state.numel():
        raise ValueError(f"a state of {state.dtype} {list(state.shape)}, not bytes")
    return Prefix(tokens, salt, bool(entry["kept"]), state.numpy())


def _uint8() -> Any:
    import torch

    return torch.uint8
