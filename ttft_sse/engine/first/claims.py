"""Who gives each raced request its first token: the batch, or what computes first tokens beside it
(engine/first/interlude.py, engine/first/process.py). :class:`Claims` settles it once per request;
:class:`FirstToken` carries a token given beside the batch to the request's inbox, and :class:`Arrivals` turns what
the inbox brings into the request's new tokens."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ttft_sse.errors import EngineError

log = structlog.get_logger("ttft_sse.engine")


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


class Arrivals:
    """What a batched request's inbox brings, as tokens: a first token given beside the batch (then the library's
    first token is that same one, and skipped), and the library's outputs, each holding every token so far."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._side: int | None = None
        self._seen = 0

    def take(self, output: Any) -> tuple[list[int], bool]:
        """The tokens ``output`` brings that were not had before, and whether the request is finished. Raises
        :class:`EngineError` for an output that carries the library's error."""
        if isinstance(output, FirstToken):
            self._side = output.token
            return [output.token], False
        if output.error is not None:
            log.error("generation_failed", error=output.error, request_id=self._request_id)
            raise EngineError("generation failed: the batched forward pass raised an error")
        tokens: list[int] = output.generated_tokens
        if self._side is not None and self._seen == 0 and tokens:
            self._seen = 1
            if tokens[0] != self._side:  # not expected: the step was made to pick it (engine/library/selection.py)
                log.error("first_token_mismatch", request_id=self._request_id, side=self._side, batch=tokens[0])
        fresh, self._seen = tokens[self._seen :], len(tokens)
        return fresh, bool(output.is_finished())
