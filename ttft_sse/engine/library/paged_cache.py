"""The batched engine's paged KV cache: the library's ``PagedAttentionCache`` as a class of one engine's own
(:func:`cache_class`), which the engine's batch processor is built with (engine/library/internals.py's
``build_processors``). What it adds to the library's cache, each asked for at load (:class:`Additions`):

* **f16** (``half``, ``TTFT_KV_DTYPE``: engine/library/half_cache.py): allocated in f16 whatever the model's dtype,
  its update rounding the new rows to f16 as the library writes them and widening the rows it reads back (or
  returns) to the new rows' dtype. The library sizes its blocks, sectors and pages by the cache's dtype (its
  ``itemsize``), so every index it hands out counts f16 values; nothing else of the cache depends on the dtype.
* **memory zeroed lazily** (``zeros``, on CPU: engine/batched/memory.py): the library allocates the whole cache with
  ``torch.zeros`` in its constructor, which writes every page; here that one allocation (CPU bytes, one size) is
  ``zeros(size)`` instead, by a torch function mode of the constructing thread around the constructor: nothing of
  torch or of the library changes for another thread or another cache.
* **reads in place** (``steps``, the C attention: engine/library/in_place.py): each layer's new keys and values
  written, the step's keys not gathered; the cache's :attr:`in_place` hands the attention and the decoder layers in C
  the layer's cache rows and the step's key index, and calls the engine's step hooks (:class:`~in_place.StepHooks`,
  handed in here: the interludes, the held outputs' release).
* **blocks hashed by salt and by mode** (``seeds``, ``modes``: engine/library/salts.py): a request shares blocks only
  with requests of its cache salt and of the mode that computed them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ttft_sse.engine.library import in_place as places
from ttft_sse.engine.library import salts
from ttft_sse.engine.modes import Modes

BLOCK_TOKENS = 4
"""Tokens per KV block: the unit of prefix sharing. A prompt reuses every whole block it shares with an earlier one,
short of its last token, so small blocks reuse more of it; decoding is as fast with small blocks as with large
ones. 4 is the library's minimum."""


@dataclass(frozen=True)
class Additions:
    """What one engine's paged cache adds to the library's (module docstring)."""

    half: bool = False
    zeros: Callable[[int], Any] | None = None
    steps: places.StepHooks | None = None  # None: the library's gathering reads
    seeds: dict[str, int] = field(default_factory=dict)  # request id → its cache salt's seed (written by the engine)
    modes: Modes | None = None  # where the engine has more than one mode


def cache_class(base: type, additions: Additions) -> type:
    """``base`` (the library's ``PagedAttentionCache``) with ``additions``: the class one engine's batch processor
    builds its cache from."""
    import torch

    class EngineCache(base):  # type: ignore[misc]
        in_place: places.InPlace | None = None
        """The cache's rows and the step in flight's indices, where it reads in place; None where it does not."""

        def __init__(self, *args: Any, dtype: Any = None, **kwargs: Any) -> None:
            with _zeros_by(additions.zeros, torch):
                super().__init__(*args, dtype=torch.float16 if additions.half else dtype, **kwargs)
            if additions.steps is not None and places.reads_in_place(self):
                self.in_place = places.InPlace(self, additions.steps)
            salts.install(self, additions.seeds)
            if additions.modes is not None:
                salts.keep_apart(self, additions.modes)

        def update(self, key_states: Any, value_states: Any, layer_idx: int, kwargs: dict[str, Any]) -> Any:
            if self.in_place is not None:
                return self.in_place.update(self._store, key_states, value_states, layer_idx, kwargs)
            return self._store(key_states, value_states, layer_idx, kwargs)

        def _store(self, key_states: Any, value_states: Any, layer_idx: int, kwargs: dict[str, Any]) -> Any:
            """The library's update: rounded to f16 and widened back where the cache holds f16."""
            if not additions.half:
                return super().update(key_states, value_states, layer_idx, kwargs)
            wide = key_states.dtype
            keys, values = super().update(key_states.to(self.dtype), value_states.to(self.dtype), layer_idx, kwargs)
            return keys.to(wide), values.to(wide)

    EngineCache.__name__ = EngineCache.__qualname__ = f"Engine{base.__name__}"
    return EngineCache


@contextlib.contextmanager
def _zeros_by(zeros: Callable[[int], Any] | None, torch: Any) -> Iterator[None]:
    """Within the block, in this thread, ``torch.zeros(size, dtype=torch.uint8)`` of CPU bytes is ``zeros(size)``
    (every other call is torch's own). Nothing where ``zeros`` is None."""
    if zeros is None:
        yield
        return
    from torch.overrides import TorchFunctionMode

    take = zeros

    class Zeros(TorchFunctionMode):  # type: ignore[misc]
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if (
                func is torch.zeros
                and len(args) == 1
                and isinstance(args[0], int)
                and kwargs.get("dtype") is torch.uint8
                and torch.device(kwargs.get("device") or "cpu").type == "cpu"
                and set(kwargs) <= {"dtype", "device"}
            ):
                return take(args[0])
            return func(*args, **kwargs)

    with Zeros():
        yield
