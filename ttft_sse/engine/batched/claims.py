"""Who gives each raced request its first token: the batch, or what computes first tokens beside it
(engine/batched/interlude.py, engine/batched/prefill.py). :class:`Claims` settles it once per request;
:class:`FirstToken` carries a token given beside the batch to the request's inbox."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass


class Claims:
    """Who gives each raced request its first token: the batch, or what computes first tokens beside it (the prefill
    process, the interludes), whichever has one first, settled once under a lock shared by the event loop (the side's
    token, :meth:`side`) and the loop's thread (the step that computes the request's first token, :meth:`batch`).
    Where the side came first, that step is made to pick the side's token, so the batch goes on from the token the
    client saw."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[str] = set()  # raced, not settled
        self._side: dict[str, int] = {}  # settled by the process: its token, until the batch's step picks it
        self._stepping: frozenset[str] = frozenset()  # first tokens the step in flight computes

    def open(self, request_id: str) -> None:
        with self._lock:
            self._open.add(request_id)

    def wanted(self, request_id: str) -> bool:
        """Not settled yet: the process's token would still be used."""
        with self._lock:
            return request_id in self._open

    def beside(self, request_id: str) -> bool:
        """Not settled, and not computed by the step in flight."""
        with self._lock:
            return request_id in self._open and request_id not in self._stepping

    def scheduled(self, request_ids: Sequence[str]) -> None:
        """The step being prepared computes these requests' first tokens."""
        with self._lock:
            self._stepping = frozenset(request_ids)

    def side(self, request_id: str, token: int) -> bool:
        """The process has ``token``: True if it came first (the client gets it, and the batch's step will pick
        it); False if the batch's step picked one before, or the request has ended."""
        with self._lock:
            if request_id not in self._open:
                return False
            self._open.discard(request_id)
            self._side[request_id] = token
            return True

    def batch(self, request_ids: Sequence[str]) -> list[int | None]:
        """A step picks these requests' first tokens: for each, the process's token that it must pick, or None (its
        own: where the process has not come first, the race is now the batch's)."""
        with self._lock:
            self._open.difference_update(request_ids)
            return [self._side.pop(request_id, None) for request_id in request_ids]

    def close(self, request_id: str) -> None:
        """The request has ended."""
        with self._lock:
            self._open.discard(request_id)
            self._side.pop(request_id, None)


@dataclass(frozen=True)
class FirstToken:
    """A first token computed beside the batch (:class:`Claims`), in the request's inbox beside the library's
    outputs."""

    token: int
