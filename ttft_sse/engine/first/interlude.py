"""First tokens between two layers of the batch's step in flight (``TTFT_PREFILL_BETWEEN_LAYERS``).

In the batched engine a request that arrives while others decode waits for the step in flight, then for a step that
holds its prompt's rows beside the others': about two steps, where an idle server answers in one (figures:
docs/engine.md). Here the batching thread stops the step in flight between two of its layers (:meth:`Interlude.serve`,
called by the decoder layers in C before each layer of a batched step), computes the newcomer's prompt alone, with
the kernel's helper threads as an idle server would, gives its first token, and takes the step up again where it
stopped. The newcomer waits for one layer of the step in flight, not for the whole step and another. One that comes
after a step's last layer (during its output layer, its sampling, the next step's preparation) is computed the same
way just before the next step is scheduled, while streams decode (``CountingScheduler.schedule_batch`` in
engine/library/scheduler.py), rather than in that step beside their rows.

Its prompt is computed once. The rows already in the batch's paged KV cache (the chat template's system prompt, a
conversation's earlier turns) are read from there; the KV of its new rows is written into blocks of that cache and
registered with the library's prefix sharing, as a finished request's would be. So when the batch schedules the
request, its prompt is a prefix hit up to its last block: the batch computes 1 to 4 rows of it, not the whole prompt
again. (The prefill process, engine/first/process.py, keeps its own KV apart, and the batch prefills each prompt it
answered again.)

Each row's result is its own arithmetic alone (the block kernel's linear layers, the C attention on the dense and on
the paged cache alike), so the KV written here is the KV the batch would have written, bit for bit, and the first
token is the batch's argmax: greedy answers stay the single engine's. A sampled first token is drawn here, by the rule
every engine draws by (engine/sampling.py); the batch's step then picks it (engine/library/selection.py).

Prompts of more than :data:`NEW_TOKENS` tokens past the prefix the cache holds are declined, since the streams of the
step in flight wait for them: the batch computes those itself.

An interlude computes in the batching thread, so in the mode of the step it runs in or before (engine/modes.py:
a switch comes only between two steps, before the interlude that precedes a step), and its KV blocks are hashed for
that mode's requests alone. Its ``computed`` callback lets the engine note the mode for the request whose first token
it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ttft_sse.engine import sampling

log = structlog.get_logger("ttft_sse.engine")

NEW_TOKENS = 64
"""The most prompt tokens past the prefix the batch's cache holds that an interlude computes (a chat question is
10-60): the streams of the step in flight wait for it, for a time that grows with its tokens."""

Ask = tuple[tuple[int, ...], float, float]
"""A prompt's token ids, and the temperature and top-p its first token is chosen at."""


@dataclass
class _Waiting:
    ask: Ask
    wanted: Callable[[], bool]
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future[int | None]
    computed: Callable[[], None] | None
    urgent: bool = False
    seed: int | None = None  # the request's cache salt's (engine/library/salts.py)
    shared: Callable[[int], None] | None = None  # told the prompt tokens the cache held for it


@dataclass(frozen=True)
class _Pseudo:
    """What the paged cache's allocation reads of a request: its name and how many of its tokens it holds."""

    request_id: str
    held: int

    def current_len(self) -> int:
        return self.held


class Interlude:
    """First tokens computed in the batching thread between two layers of a step. :meth:`first_token` and
    :meth:`sweep` are for the event loop, :meth:`serve` for the batching thread, :meth:`stop` for any."""

    def __init__(self, model: Any, seeds: dict[str, int] | None = None) -> None:
        self._model = model
        self._seeds = seeds if seeds is not None else {}  # the cache's salts by request name (salts.install)
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []
        self._generator: Any = None  # made in the batching thread, at its first draw
        self._names = itertools.count(1)
        self._broken = False
        self._stopping = False
        self.served = 0
        """First tokens computed."""
        self.declined = 0
        """Prompts left to the batch: too many new tokens, or no room in the cache."""
        self.waiting = ctypes.c_int32(0)
        """How many prompts wait (0 when none), for the decoder layers run in one call to read before each layer
        (engine/library/in_place.py's ``StepHooks.waiting``)."""

    @property
    def state(self) -> str:
        """ready, failed (an interlude raised: the batch gives every first token since) or stopped."""
        return "stopped" if self._stopping else "failed" if self._broken else "ready"

    async def first_token(
        self,
        token_ids: Sequence[int],
        wanted: Callable[[], bool],
        temperature: float = 0.0,
        top_p: float = 1.0,
        *,
        computed: Callable[[], None] | None = None,
        urgent: bool = False,
        seed: int | None = None,
        shared: Callable[[int], None] | None = None,
    ) -> int | None:
        """The first token after ``token_ids``: the argmax at ``temperature`` 0, else drawn at ``temperature`` from
        the ``top_p``, computed at the batch's next layer. None if the interlude declined it, once nobody ``wanted``
        it (:meth:`sweep`), or when the engine stops. ``computed`` is called in the batching thread once the token is
        computed, before it is given. An ``urgent`` prompt (the high lane's) is computed at the next layer with the
        other urgent ones only, the rest at the layers after. ``seed`` is the request's cache salt's: its prompt
        shares and registers blocks of that salt only. ``shared`` is told, in the batching thread, how many of its
        tokens the cache held (the request's cached tokens: the batch later finds the blocks computed here too)."""
        if self._broken or self._stopping:
            return None
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[int | None] = loop.create_future()
        with self._lock:
            ask = (tuple(token_ids), float(temperature), float(top_p))
            self._waiting.append(_Waiting(ask, wanted, loop, answer, computed, urgent, seed, shared))
            self.waiting.value = len(self._waiting)
        return await asyncio.shield(answer)

    def sweep(self) -> None:
        """Answer None to every prompt nobody wants any more (the batch's step gave its first token, or it ended)."""
        if self._waiting:
            self._take(serve=None)

    def serve(self, in_place: Any) -> None:
        """The batching thread, between two layers of a step over ``in_place`` (engine/library/in_place.py's
        ``InPlace``): the first token of every prompt still wanted, one after another."""
        if self._waiting:
            self._take(serve=in_place)

    def stop(self) -> None:
        """Answer None to every prompt, now and from now on."""
        self._stopping = True
        self._take(serve=None)

    def _take(self, *, serve: Any) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
            self.waiting.value = 0
        computed: list[_Waiting] = []
        kept: list[_Waiting] = []
        for one in waiting:
            if self._broken or self._stopping or not one.wanted():
                _settle(one.loop, one.answer, None)
            else:
                (kept if serve is None else computed).append(one)
        if any(one.urgent for one in computed) and not all(one.urgent for one in computed):
            kept += [one for one in computed if not one.urgent]  # at the next layer: urgent prompts come first
            computed = [one for one in computed if one.urgent]
        if kept:
            with self._lock:
                self._waiting[:0] = kept  # ahead of any that came meanwhile
                self.waiting.value = len(self._waiting)
        if not computed:
            return
        held = [0] * len(computed)
        tokens = self._compute(serve, [one.ask for one in computed], [one.seed for one in computed], held)
        for one, token, cached in zip(computed, tokens, held, strict=True):
            if token is not None and one.computed is not None:
                one.computed()
            if token is not None and one.shared is not None:
                one.shared(cached)
            _settle(one.loop, one.answer, token)

    def _compute(self, in_place: Any, asks: list[Ask], seeds: list[int | None], held: list[int]) -> list[int | None]:
        import torch

        if self._generator is None:
            self._generator = torch.Generator()
            self._generator.seed()  # not torch's default seed
        names = [f"ttft-interlude-{next(self._names)}" for _ in asks]
        for name, seed in zip(names, seeds, strict=True):
            if seed is not None:
                self._seeds[name] = seed
        try:
            tokens = first_tokens(self._model, torch, in_place, asks, self._generator, names, held)
        except Exception as exc:  # the batch goes on without interludes: its own steps give every first token
            self._broken = True
            log.error("interlude_failed", error=f"{type(exc).__name__}: {exc}")
            return [None] * len(asks)
        finally:
            for name in names:
                self._seeds.pop(name, None)
        self.served += sum(token is not None for token in tokens)
        self.declined += sum(token is None for token in tokens)
        return tokens


def first_tokens(
    model: Any,
    torch: Any,
    in_place: Any,
    asks: Sequence[Ask],
    generator: Any,
    names: Sequence[str],
    held: list[int] | None = None,
) -> list[int | None]:
    """The first token of each of ``asks``' prompts, computed together in one pass over the decoder layers in C
    (a step of their own, over the paged cache of ``in_place``), each behind the longest prefix that cache shares
    with it; the KV of their new rows is written into the cache, and their whole blocks are registered for prefix
    sharing, under the request names ``names`` (released before it returns). None for a prompt of more than
    :data:`NEW_TOKENS` new tokens, or where the cache has no room for them: nothing of it is written. ``held``, if
    given, gets each prompt's tokens the cache held before."""
    cache = in_place.cache
    planned: list[tuple[int, list[int], int]] = []  # (which ask, its tokens, how many of them the cache shares)
    tokens: list[int | None] = [None] * len(asks)
    try:
        for i, ((token_ids, _, _), name) in enumerate(zip(asks, names, strict=True)):
            ids = list(token_ids)
            shared = cache.search_prefix_match(name, ids)  # the blocks it shares are held under name too
            if held is not None:
                held[i] = shared
            new = len(ids) - shared
            if new <= NEW_TOKENS and cache.can_store_request_tokens(_Pseudo(name, shared), new):
                planned.append((i, ids, shared))
        if not planned:
            return tokens
        logits = _step(model, torch, in_place, [(names[i], ids, shared) for i, ids, shared in planned])
        for i, ids, shared in planned:
            for allocator in cache.cache_allocators.values():
                complete = len(ids) // allocator.tokens_per_page - shared // allocator.tokens_per_page
                if complete > 0:
                    allocator.mark_complete_blocks(names[i], ids, complete)
    finally:
        for name in names:
            cache.free_blocks(name)  # whole blocks stay cached for the requests' own prefix match; the rest is freed
    for row, (i, _, _) in enumerate(planned):
        _, temperature, top_p = asks[i]
        tokens[i] = sampling.first_token(logits[row], temperature, top_p, generator)
    return tokens


def _step(model: Any, torch: Any, in_place: Any, prompts: Sequence[tuple[str, list[int], int]]) -> Any:
    """The logits after each of ``prompts`` (``(name, tokens, shared)``: its cache allocated under ``name``, its
    first ``shared`` tokens in the cache already): its new rows through the embedding, every decoder layer's one C
    call (as in a batched step: engine/library/stack.py), the final norm and the output layer for its last row."""
    from ttft_sse.engine.kernels import attention
    from ttft_sse.engine.library import stack

    cache, base = in_place.cache, model.base_model
    rows = [ids[shared:] for _, ids, shared in prompts]
    positions = [range(shared, len(ids)) for _, ids, shared in prompts]
    cu_q = torch.tensor([0, *itertools.accumulate(map(len, rows))], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(len(ids) for _, ids, _ in prompts)], dtype=torch.int32)
    steps: dict[int, attention.Step] = {}
    for layer, allocator in cache.layer_to_allocator.items():
        if allocator.index in steps:
            continue
        write = [
            i for name, ids, shared in prompts for i in allocator.get_write_indices(name, shared, len(ids) - shared)
        ]
        read = [i for name, ids, shared in prompts for i in allocator.get_read_indices(name, shared, len(ids) - shared)]
        keys = in_place.rows[layer][0]
        if max(write + read) >= keys.shape[0]:
            raise RuntimeError("an interlude's cache index reaches past the cache")
        steps[allocator.index] = attention.Step(
            torch.tensor(write, dtype=torch.int64), torch.tensor(read, dtype=torch.int64), cu_q, cu_k, len(prompts),
            keys.stride(0), keys.stride(1), int(keys.shape[0]), keys.dtype == torch.float16,
        )  # fmt: skip
    with torch.inference_mode():
        x = base.embed_tokens(torch.tensor([[t for r in rows for t in r]]))
        position_ids = torch.tensor([[p for r in positions for p in r]])
        cos, sin = (t.contiguous() for t in base.rotary_emb(x, position_ids=position_ids))
        x = x.contiguous()
        count = int(cu_q[-1])
        chain = getattr(base.layers[0], "chain", None)
        if chain is not None:  # every layer in one call
            x = stack.run_layers(chain, in_place, steps, x, count, cos, sin, between=False, positions=position_ids)
        else:
            for layer in base.layers:
                index = layer.self_attn.layer_idx
                keys, values = in_place.rows[index]
                x = stack.whole(layer, steps[cache.layer_to_allocator[index].index], x, count, cos, sin, keys, values)
        last = (cu_q[1:] - 1).to(torch.int64)
        return model.get_output_embeddings()(base.norm(x)[0, last])


def _settle(loop: asyncio.AbstractEventLoop, answer: asyncio.Future[int | None], token: int | None) -> None:
    def settle() -> None:
        if not answer.done():
            answer.set_result(token)

    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for it
        loop.call_soon_threadsafe(settle)
