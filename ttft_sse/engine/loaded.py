"""A model loaded for the transformers engines, apart from any one engine: the model, its tokenizer and end ids, what
``/readyz`` says of it, its prompts' preparation, and the block kernel's library where the kernel serves its layers.

The single engine generates over one; the batched engine steps the library's continuous batching over one and runs
its seeded and too-long requests on a single engine over the same one (one copy of the weights); the prefill process
and ``ttft-sse prepare`` load one without any engine. Torch and transformers are imported by :meth:`LoadedModel.load`,
not before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from ttft_sse.engine import prompts
from ttft_sse.engine.base import ChatMessage, ModelInfo, Prompt
from ttft_sse.engine.kernels import kernel
from ttft_sse.engine.loading.model import load_model
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

log = structlog.get_logger("ttft_sse.engine")


class LoadedModel(prompts.TokenizedPrompts):
    """A model, loaded once by :meth:`load`; read by the engines that share it from any thread."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._info: ModelInfo | None = None
        self._torch: Any = None
        self._tokenizer: Any = None
        self._model: Any = None
        self._eos: frozenset[int] = frozenset()
        self._library: Path | None = None  # the block kernel's library, where it serves the model
        self.janitor = CacheJanitor(0, lambda: None)
        """Counts the generations of every engine over this model and empties the CUDA allocator's cache every N (a
        no-op counter off CUDA): replaced at load when the model sits on CUDA."""

    def load(self, clock: StageClock) -> None:
        """Load ``settings.model`` (engine/loading/model.py), timing each stage on ``clock``."""
        loaded = load_model(self._settings, clock)
        self._torch, self._tokenizer, self._model = loaded.torch, loaded.tokenizer, loaded.model
        self._eos, self._info, self._library = loaded.eos, loaded.info, loaded.library
        if self._info.device.startswith("cuda"):
            self.janitor = CacheJanitor(self._settings.cuda_empty_cache_every, self._torch.cuda.empty_cache)

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("the engine's info is read before load(); await the lifespan's readiness first")
        return self._info

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def model(self) -> Any:
        if self._model is None:
            raise RuntimeError("the model is read before load()")
        return self._model

    @property
    def torch(self) -> Any:
        return self._torch

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def eos(self) -> frozenset[int]:
        return self._eos

    def fence_kernel(self) -> None:
        """Wait until no helper thread of the block kernel is inside a chunk (kernel.fence): before a KV cache whose
        attention they shared is dropped. Helpers are the process's, whichever engine started them."""
        if self._library is not None:
            kernel.fence(self._library)

    def kernel_counts(self) -> kernel.HelperCounts | None:
        """What the block kernel's helper threads did so far (every engine of the process together); None without
        them."""
        if self._info is None or not self._info.kernel_helpers or self._library is None:
            return None
        return kernel.helper_counts(self._library)


class OnLoadedModel:
    """``prepare`` and ``prepare_prefix`` of an engine that runs over a :class:`LoadedModel` (``_loaded``): the
    single and batched engines alike."""

    _loaded: LoadedModel

    def prepare(
        self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool, parse_special: bool = False
    ) -> Prompt:
        return self._loaded.prepare(prompt=prompt, messages=messages, raw=raw, parse_special=parse_special)

    def prepare_prefix(self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool) -> Prompt:
        return self._loaded.prepare_prefix(prompt=prompt, messages=messages, raw=raw)


class CacheJanitor:
    """Empties the CUDA caching allocator's cache once every ``every`` generations (``every=0``: never).

    torch keeps freed blocks reserved for reuse. Prompts of varying length leave a growing set of odd-sized
    blocks behind, so reserved memory creeps up although live tensors do not; ``empty_cache`` hands the unused
    ones back. Its cudaFree calls synchronise the device and stall concurrent generations for a moment, hence
    only every N requests. Called from generation worker threads, so the count is locked; ``empty`` runs
    outside the lock.
    """

    def __init__(self, every: int, empty: Callable[[], None]) -> None:
        if every < 0:
            raise ValueError(f"every must be 0 (never) or more, got {every}")
        self.every = every
        self._empty = empty
        self._lock = threading.Lock()
        self.generations = 0
        self.emptied = 0

    def generation_ended(self) -> bool:
        """Count one generation; empty the cache if it is the Nth. True when it emptied."""
        due = self.count()
        if due:
            self.empty()
        return due

    def count(self) -> bool:
        """Count one generation, without emptying; True when it is the Nth (the caller then calls :meth:`empty`,
        off the event loop: it synchronises the device)."""
        with self._lock:
            self.generations += 1
            return self.every > 0 and self.generations % self.every == 0

    def empty(self) -> None:
        self._empty()
        with self._lock:
            self.emptied += 1
            generations = self.generations
        log.info("cuda_cache_emptied", generations=generations, every=self.every)
