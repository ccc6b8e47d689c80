"""A raced request's first token asked of what computes first tokens beside the batch: the interludes
(engine/first/interlude.py) or the prefill process (engine/first/process.py). Whichever of it and the batch has
the token first gives it (claims.py's :class:`~ttft_sse.engine.first.claims.Claims`); a token given beside the
batch goes to the request's inbox as a :class:`~ttft_sse.engine.first.claims.FirstToken`.

Modes (engine/modes.py): an interlude computes in the batching thread, in the mode of the step it runs in or
before, which it notes for the request as it computes (``Modes.current``); the note counts once the token is the
request's. The prefill process holds fp32 rows alone, so it is asked only while the engine's mode is ``normal``; a
token it gives is a ``normal`` one.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from typing import Any

from ttft_sse.engine.base import NORMAL, Prompt, SamplingParams
from ttft_sse.engine.first.claims import Claims, FirstToken
from ttft_sse.engine.first.interlude import Interlude
from ttft_sse.engine.first.process import PrefillProcess
from ttft_sse.engine.modes import Modes


class Race:
    """Races the batch for first tokens with ``side``, handing those it gives to ``deliver`` (the requests'
    mailboxes: ``(request id, FirstToken)`` pairs). For the event loop."""

    def __init__(
        self,
        side: Interlude | PrefillProcess,
        claims: Claims,
        modes: Modes,
        deliver: Callable[[Iterable[tuple[str, Any]]], None],
    ) -> None:
        self._side = side
        self._claims = claims
        self._modes = modes
        self._deliver = deliver
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def open(self) -> bool:
        """Whether ``side`` is asked now: the interludes always (they compute in the batch's mode), the prefill
        process while the engine's mode is ``normal``."""
        return isinstance(self._side, Interlude) or self._modes.wanted == NORMAL

    def start(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        seed: int | None = None,
        shared: Callable[[int], None] | None = None,
    ) -> None:
        """Ask ``side`` for the request's first token too; it goes to the request's inbox if it comes before the
        batch's step has picked one (:class:`Claims`). ``seed`` (the request's cache salt's) and ``shared`` (told
        the tokens the cache held for it) are the interludes'; the prefill process, which keeps its own KV, takes no
        salted request (the engine does not race one there)."""
        side, claims, modes = self._side, self._claims, self._modes
        claims.open(request_id)
        temperature = 0.0 if params.greedy else float(params.temperature)
        top_p = 1.0 if params.greedy else float(params.top_p)
        # Interludes compute it only while no step in flight does; the process races that step too.
        wanted = functools.partial(claims.beside if isinstance(side, Interlude) else claims.wanted, request_id)
        computed_in = [NORMAL]  # the mode the token was computed in

        def note() -> None:  # the batching thread, as an interlude computes the token
            computed_in[0] = modes.current

        async def ask() -> None:
            if isinstance(side, Interlude):
                token = await side.first_token(
                    prompt.token_ids,
                    wanted,
                    temperature,
                    top_p,
                    computed=note,
                    urgent=params.urgent,
                    seed=seed,
                    shared=shared,
                )
            else:
                token = await side.first_token(prompt.token_ids, wanted, temperature, top_p)
            if token is not None and claims.side(request_id, token):
                modes.saw([request_id], computed_in[0])
                self._deliver([(request_id, FirstToken(token))])

        # The task is never cancelled (see PrefillProcess.first_token); a strong reference keeps it until it ends.
        task = asyncio.get_running_loop().create_task(ask(), name=f"ttft-prefill-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def ended(self) -> None:
        """Return once every ask has ended (after ``side`` stopped, each ends at once)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
