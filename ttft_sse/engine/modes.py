"""The batched engine's modes (``Engine.set_mode``): switched by the batching thread between two steps, and the modes
each request's tokens were computed in.

:meth:`Modes.want` (any thread) only says which mode new steps take. The loop's scheduler applies it when it
prepares a step (:meth:`Modes.step`, before anything of the step is computed: the interludes it runs first, the
prefix matches, the forward pass), so a step runs whole in one mode: the batching thread's rows
(engine/kernels/kernel.py's ``ROWS``) are set there and nowhere else. It then notes the mode for every request of the
step (:meth:`Modes.saw`), as the engine does for a first token an interlude gave (computed in the batching thread, in
the mode of the step in flight). A request is degraded when any of its modes is not ``normal``.

The paged cache's prefix sharing must not hand a request KV computed in another mode: a normal request would be
answered, in part, by int8 arithmetic without knowing it, and an int8 one would not be the int8 model's. So
engine/library/salts.py's ``keep_apart`` makes each mode's blocks hash differently (the library hashes a block's token
ids, chained from the first block; int8 steps hash the ids as ``-1 - id``, which no token has), and a request computed
in both modes registers none of its blocks. A block is then shared only with requests of the mode that computed it and
every block before it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ttft_sse.engine.base import INT8, NORMAL, check_mode
from ttft_sse.engine.kernels import kernel


class Modes:
    """The mode new steps take, the mode of the step the batching thread prepares or runs, and each open request's
    modes. :meth:`want`, :meth:`open` and :meth:`close` are for the event loop (any thread); :meth:`step`,
    :meth:`saw` and :meth:`mixed` for the batching thread."""

    def __init__(self, modes: Sequence[str]) -> None:
        self.modes = tuple(modes)
        self.wanted = NORMAL
        """What :meth:`want` last asked for (one reference, read whole by the batching thread)."""
        self.current = NORMAL
        """The mode of the step the batching thread prepares or runs (written by that thread alone)."""
        self.steps = {mode: 0 for mode in self.modes}
        """Steps prepared in each mode."""
        self._lock = threading.Lock()
        self._seen: dict[str, set[str]] = {}  # open requests: the modes their tokens were computed in

    def want(self, mode: str) -> None:
        """New steps take ``mode`` (one of :attr:`modes`; ``ValueError`` else)."""
        check_mode(mode, self.modes)
        self.wanted = mode

    def step(self) -> str:
        """The batching thread, preparing a step: the mode it takes, applied to the thread's rows."""
        mode = self.current = self.wanted
        kernel.ROWS.int8 = mode == INT8
        self.steps[mode] += 1
        return mode

    def open(self, request_id: str) -> None:
        """A request is handed to the library: its modes are noted from now on."""
        with self._lock:
            self._seen[request_id] = set()

    def saw(self, request_ids: Iterable[str], mode: str) -> None:
        """``mode`` computed tokens of these requests (those not open are not noted)."""
        with self._lock:
            for request_id in request_ids:
                seen = self._seen.get(request_id)
                if seen is not None:
                    seen.add(mode)

    def degraded(self, request_id: str) -> bool:
        """Whether a mode other than ``normal`` computed any of the request's tokens so far."""
        with self._lock:
            return any(mode != NORMAL for mode in self._seen.get(request_id, ()))

    def mixed(self, request_id: str) -> bool:
        """Whether more than one mode computed the request's tokens: its KV blocks are not shared."""
        with self._lock:
            return len(self._seen.get(request_id, ())) > 1

    def close(self, request_id: str) -> None:
        """The request has ended: its modes are forgotten."""
        with self._lock:
            self._seen.pop(request_id, None)
