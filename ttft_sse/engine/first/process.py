"""The prefill process: first tokens on another core while the batch decodes.

In the batched engine a request that arrives while others decode waits for the step in flight, then shares its own
prefill step with them: about two steps, where an idle server answers in one (figures: docs/engine.md). This process
computes such a request's first token beside the batch instead: a second copy of the model, in a process of its own
(threads of one process would share the GIL with the batching loop and slow its streams down). It keeps the KV of
its recent prompts, so a prompt behind a known prefix (the chat template's system prompt, a conversation's earlier
turns) computes its new tokens only.

The child computes a first token only where it is quick: for a prompt of at most :data:`NEW_TOKENS` tokens past the
longest prefix it knows (a chat message behind the chat template's system prompt, or behind a long system prompt it
has seen). A longer one (a document to summarise) it declines at once, and the batch gives that first token alone:
computed here, it would keep the child from the short prompts arriving behind it for as long as the batch takes for
it anyway. The child learns a declined prompt's KV instead, :data:`LEARN_ROWS` rows at a time while no prompt waits,
so that the prompts that follow it (the next question behind the same long system prompt) are quick.

The batch prefills the request all the same and goes on from there: whichever has the first token first gives it,
and the batch goes on from that token (:class:`~ttft_sse.engine.batched.engine.BatchedEngine`: if this one came
first, the batch's own step is made to pick it). A greedy first token is the argmax, which both compute alike, row
for row (the block kernel's linear layers and the C attention compute each row from its own inputs alone, so the
batch's argmax is this one, bit for bit, and greedy answers stay the single engine's). A sampled one is drawn here,
by the rule every engine draws by (engine/sampling.py), with the child's own random generator.

Parent and child speak pickles over the child's stdin and stdout (:class:`multiprocessing.connection.Connection`):
the child's first message is ``("ready", seconds)`` (or ``("failed", reason)``), then one reply ``("tokens", ids)``
per group of prompts (each ``(token_ids, temperature, top_p)``), in order, with None for each prompt it declined.
One group is in flight at a time. The child ends at the end of its stdin: when the parent closes it, or dies.
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import structlog

from ttft_sse.engine import sampling
from ttft_sse.settings import Settings

log = structlog.get_logger("ttft_sse.engine")

REPLY_SECONDS = 60.0
"""How long the parent waits for a group's first tokens before it counts the child as wedged and stops it."""
PROMPT_TOKENS = 2048
"""The longest prompt the child takes (seconds of prefill when it knows no prefix of it): for a longer one the batch,
which prefills in steps beside the others, is no slower, and the child would be busy for long."""
PREFIX_TOKENS = 16384
"""The prompt tokens whose KV the child keeps for reuse (for the bundled model, ~46 KB a token: 750 MB at most)."""
PREFIX_ENTRIES = 16
"""The prompts whose KV the child keeps for reuse."""
NEW_TOKENS = 64
"""The most tokens past the longest prefix the child knows that it computes for a first token (a chat question is
10-60); for a longer prompt it declines, and learns the prompt's KV while idle."""
LEARN_ROWS = 64
"""The tokens of a declined prompt the child learns at a time: a prompt that arrives meanwhile waits for at most
that many rows, then goes first."""
LEARN_PROMPTS = 4
"""The declined prompts the child keeps to learn (the oldest are dropped)."""
GROUP = 4
"""The most prompts the child computes together."""
GROUP_TOKENS = 256
"""The longest prompt the child computes with others (a longer one goes alone)."""
CHUNK_ROWS = 512
"""The most new rows of a forward pass in the child: the C attention's limit (``attention.LONG_ROWS``), as in the
batch's steps, so that every row is computed as the batch computes it."""

Ask = tuple[tuple[int, ...], float, float]
"""A prompt's token ids, and the temperature and top-p its first token is chosen at."""


class PrefillProcess:
    """The parent's side: starts the child, asks it for first tokens, stops it. Methods other than :meth:`start`
    and :meth:`stop` are for the event loop."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._process: subprocess.Popen[bytes] | None = None
        self._send_to: Connection | None = None
        self._receive: Connection | None = None
        self._ready = False
        self._broken = False
        self._stopping = False
        self._waiting: list[tuple[Ask, Callable[[], bool], asyncio.Future[int | None]]] = []
        self._sender: asyncio.Task[None] | None = None
        self.served = 0
        """First tokens the child computed."""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the child (it loads and warms its model while the parent goes on)."""
        process = subprocess.Popen(
            [sys.executable, "-m", "ttft_sse.engine.first.process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert process.stdin is not None and process.stdout is not None
        self._process = process
        self._send_to = Connection(os.dup(process.stdin.fileno()), readable=False)
        self._receive = Connection(os.dup(process.stdout.fileno()), writable=False)
        process.stdin.close()
        process.stdout.close()
        self._send_to.send(self._settings)
        log.info("prefill_process_started", pid=process.pid)

    @property
    def state(self) -> str:
        """loading, ready, failed, or stopped."""
        if self._stopping:
            return "stopped"
        return "failed" if self._broken else "ready" if self.ready else "loading"

    @property
    def ready(self) -> bool:
        """The child has loaded its model and takes prompts (checked without waiting)."""
        if self._ready or self._broken or self._receive is None:
            return self._ready
        try:
            if not self._receive.poll(0):
                return False
            kind, detail = self._receive.recv()
        except (EOFError, OSError) as exc:
            self._fail(f"it ended before it was ready ({type(exc).__name__})")
            return False
        if kind != "ready":
            self._fail(f"it could not load the model: {detail}")
            return False
        self._ready = True  # the child logged prefill_process_ready itself, when it was
        return True

    async def first_token(
        self, token_ids: Sequence[int], wanted: Callable[[], bool], temperature: float = 0.0, top_p: float = 1.0
    ) -> int | None:
        """The first token after ``token_ids``: the argmax at ``temperature`` 0, else drawn at ``temperature`` from
        the ``top_p``. None if the prompt is longer than :data:`PROMPT_TOKENS`, the child declined it (more than
        :data:`NEW_TOKENS` new to it), the child is not ready or has failed, or nobody ``wanted`` it any more by the
        time the child was free.

        Prompts wait here while the child computes others, and go to it together (up to :data:`GROUP` of them, of
        at most :data:`GROUP_TOKENS` tokens each), in arrival order: prompts that arrive in the same instant (the
        requests of clients whose answers ended in the same step) cost the child one forward pass, not one each.
        """
        if len(token_ids) > PROMPT_TOKENS:
            return None
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[int | None] = loop.create_future()
        self._waiting.append(((tuple(token_ids), float(temperature), float(top_p)), wanted, answer))
        if self._sender is None or self._sender.done() or self._sender.get_loop() is not loop:
            self._sender = loop.create_task(self._send(), name="ttft-prefill-sender")
        return await asyncio.shield(answer)

    async def _send(self) -> None:
        """Hand the waiting prompts to the child, a group at a time, one group in flight, until none wait."""
        loop = asyncio.get_running_loop()
        while self._waiting:
            await asyncio.sleep(0)  # prompts added in this same instant join the group
            waiting, self._waiting = self._waiting, []
            group: list[tuple[Ask, asyncio.Future[int | None]]] = []
            for ask, wanted, answer in waiting:
                if not wanted() or not self.ready:
                    answer.set_result(None)
                elif not group or (len(group) < GROUP and max(len(ask[0]), len(group[0][0][0])) <= GROUP_TOKENS):
                    group.append((ask, answer))
                else:
                    self._waiting.append((ask, wanted, answer))
            if not group:
                continue
            tokens: list[int | None] = [None] * len(group)
            try:
                tokens[:] = await loop.run_in_executor(None, self._ask, [ask for ask, _ in group])
            except Exception as exc:
                self._fail(f"{type(exc).__name__}: {exc}")
            else:
                self.served += sum(token is not None for token in tokens)
            for (_, answer), token in zip(group, tokens, strict=True):
                answer.set_result(token)

    def _ask(self, prompts: list[Ask]) -> list[int | None]:
        assert self._send_to is not None and self._receive is not None
        self._send_to.send(prompts)
        if not self._receive.poll(REPLY_SECONDS):
            raise TimeoutError(f"no first token within {REPLY_SECONDS:.0f} s")
        kind, detail = self._receive.recv()
        if kind != "tokens":
            raise RuntimeError(f"the child failed: {detail}")
        return [None if token is None else int(token) for token in detail]

    def _fail(self, reason: str) -> None:
        """Stop using the child (for good: requests go on without it), and kill it. Without waiting: this runs on
        the event loop; :meth:`stop` reaps it."""
        if self._broken or self._stopping:
            return
        self._broken, self._ready = True, False
        log.error("prefill_process_failed", pid=self.pid, reason=reason)
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the child's stdin (it exits at the end of it) and wait for it; kill it (its PID) if it does not.
        Blocks: call it off the event loop."""
        self._stopping, self._ready = True, False
        if self._send_to is not None:
            self._send_to.close()
            self._send_to = None
        process = self._process
        if process is None:
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if self._receive is not None:
            self._receive.close()
            self._receive = None


class Prefixes:
    """The child's recent prompts and their KV caches: a prompt reuses the longest prefix it shares with one of
    them, short of its last token, and is kept in turn. Bounded by :data:`PREFIX_ENTRIES` prompts and
    :data:`PREFIX_TOKENS` tokens; the least recently used go first."""

    def __init__(self, entries: int = PREFIX_ENTRIES, tokens: int = PREFIX_TOKENS) -> None:
        self._entries = entries
        self._tokens = tokens
        self._kept: OrderedDict[tuple[int, ...], Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def known(self, token_ids: tuple[int, ...]) -> int:
        """How many of ``token_ids`` :meth:`take` would give, all but the last one at most."""
        return min(self._best(token_ids)[1], len(token_ids) - 1)

    def _best(self, token_ids: tuple[int, ...]) -> tuple[tuple[int, ...] | None, int]:
        best, shared = None, 0
        for kept in self._kept:
            n = _common(kept, token_ids)
            if n > shared:
                best, shared = kept, n
        return best, shared

    def take(self, token_ids: tuple[int, ...], fresh: Callable[[], Any], limit: int | None = None) -> tuple[Any, int]:
        """A cache holding the KV of the first ``n`` of ``token_ids`` (a copy: the kept one stays as it is), and
        ``n``, at most ``limit`` (by default all but the last token); a ``fresh()`` cache and 0 when nothing is
        shared."""
        best, shared = self._best(token_ids)
        shared = min(shared, len(token_ids) - 1 if limit is None else limit)
        if best is None or shared < 1:
            return fresh(), 0
        self._kept.move_to_end(best)
        cache = copy.deepcopy(self._kept[best])
        if len(best) > shared:
            cache.crop(shared - len(best))  # a negative count: drop that many tokens from the end
        return cache, shared

    def keep(self, token_ids: tuple[int, ...], cache: Any) -> None:
        """Keep ``cache`` (the KV of ``token_ids``), in place of any kept prompt that begins ``token_ids``: whatever
        that one shares with a prompt, this one shares too (a prompt learned a chunk at a time holds one entry)."""
        for kept in [k for k in self._kept if len(k) < len(token_ids) and token_ids[: len(k)] == k]:
            del self._kept[kept]
        self._kept[token_ids] = cache
        self._kept.move_to_end(token_ids)
        while len(self._kept) > self._entries or sum(map(len, self._kept)) > self._tokens:
            self._kept.popitem(last=False)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def last_logits(model: Any, torch: Any, prefixes: Prefixes, prompts: Sequence[tuple[int, ...]]) -> Any:
    """The logits after each of ``prompts`` (a row each), computed together: behind the longest prefix ``prefixes``
    knows that they all share, their new tokens side by side (the shorter ones padded at the end, which no real row
    sees: attention is causal), in chunks of at most :data:`CHUNK_ROWS` rows. Each prompt is kept in ``prefixes``."""
    from ttft_sse.engine.library import half_cache

    def fresh() -> Any:
        return half_cache.dense(model)  # in f16 where the batch's cache is (TTFT_KV_DTYPE): the same keys and values

    shortest = min(map(len, prompts))
    together = min((_common(prompts[0], other) for other in prompts[1:]), default=shortest)
    cache, start = prefixes.take(prompts[0], fresh, limit=min(together, shortest - 1))
    if start and len(prompts) > 1:
        cache.batch_repeat_interleave(len(prompts))
    longest = max(map(len, prompts))
    ids = torch.tensor([[*p[start:], *[p[-1]] * (longest - len(p))] for p in prompts], dtype=torch.long)
    with torch.inference_mode():
        for begin in range(0, longest - start, CHUNK_ROWS):
            out = model.base_model(input_ids=ids[:, begin : begin + CHUNK_ROWS], cache=cache, use_cache=True)
        # Each prompt's last row (all in the last chunk: the shortest is at most CHUNK_ROWS rows behind).
        last = torch.tensor([len(p) - 1 - start for p in prompts]) - begin
        hidden = out.last_hidden_state[torch.arange(len(prompts)), last]
        logits = model.get_output_embeddings()(hidden)
    for i, prompt in enumerate(prompts):
        own = cache
        if len(prompts) > 1:
            own = copy.deepcopy(cache)
            own.batch_select_indices(torch.tensor([i]))
            if len(prompt) < longest:
                own.crop(len(prompt) - longest)
        prefixes.keep(prompt, own)
    return logits


def learn(model: Any, torch: Any, prefixes: Prefixes, token_ids: tuple[int, ...], rows: int = LEARN_ROWS) -> bool:
    """Compute the KV of up to ``rows`` more of ``token_ids`` (behind the longest prefix ``prefixes`` knows) and keep
    it there; True once ``prefixes`` knows all but its last token."""
    from ttft_sse.engine.library import half_cache

    cache, start = prefixes.take(token_ids, lambda: half_cache.dense(model))
    end = min(start + rows, len(token_ids) - 1)
    if end > start:
        with torch.inference_mode():
            model.base_model(input_ids=torch.tensor([token_ids[start:end]]), cache=cache, use_cache=True)
        prefixes.keep(token_ids[:end], cache)
    return end == len(token_ids) - 1


def first_tokens(
    model: Any, torch: Any, prefixes: Prefixes, asks: Sequence[Ask], generator: Any, declined: list[tuple[int, ...]]
) -> list[int | None]:
    """The first token of each of ``asks`` that has at most :data:`NEW_TOKENS` new tokens: the argmax of its logits
    (:func:`last_logits`) at temperature 0, else drawn with ``generator``. None for the others, which go to the end
    of ``declined`` (the last :data:`LEARN_PROMPTS` of it are kept)."""
    tokens: list[int | None] = [None] * len(asks)
    taken = [i for i, (token_ids, _, _) in enumerate(asks) if len(token_ids) - prefixes.known(token_ids) <= NEW_TOKENS]
    declined += [asks[i][0] for i in range(len(asks)) if i not in taken and asks[i][0] not in declined]
    del declined[:-LEARN_PROMPTS]
    if not taken:
        return tokens
    logits = last_logits(model, torch, prefixes, [asks[i][0] for i in taken])
    for row, i in enumerate(taken):
        _, temperature, top_p = asks[i]
        tokens[i] = sampling.first_token(logits[row], temperature, top_p, generator)
    return tokens


def main() -> None:
    """The child: settings from the parent, then a first token for each prompt until the end of stdin."""
    from ttft_sse import log as logs
    from ttft_sse.engine.loaded import LoadedModel
    from ttft_sse.stages import StageClock

    # Replies go out on a private copy of stdout; whatever prints (a library's warning) goes to stderr instead.
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    prompts = Connection(os.dup(0), writable=False)
    settings: Settings = prompts.recv()
    logs.configure(level=settings.log_level, fmt=settings.log_format)
    began = time.perf_counter()
    # Its first tokens are fp32 rows': the parent asks for none while the batch is degraded (engine/first/race.py),
    # so it holds no int8 records.
    loaded = LoadedModel(settings.replace(engine="single", kernel_helpers=0, degrade="off"))
    try:
        loaded.load(StageClock())
        import torch

        prefixes = Prefixes()
        generator = torch.Generator()
        generator.seed()  # not torch's default seed, which every process starts from
        hello = loaded.prepare(prompt="Hello", messages=None, raw=False).token_ids
        # Warm both shapes of forward pass (one prompt from nothing, then two side by side behind a known prefix),
        # and the draw.
        declined: list[tuple[int, ...]] = []
        first_tokens(loaded.model, torch, prefixes, [(hello, 0.0, 1.0)], generator, declined)
        first_tokens(loaded.model, torch, prefixes, [(hello, 0.0, 1.0), (hello, 1.0, 0.95)], generator, declined)
    except Exception as exc:
        replies.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    seconds = time.perf_counter() - began
    replies.send(("ready", seconds))
    log.info("prefill_process_ready", pid=os.getpid(), seconds=round(seconds, 2))
    while True:
        try:
            if declined and not prompts.poll(0):  # nothing waits: learn a declined prompt, a chunk at a time
                try:
                    if learn(loaded.model, torch, prefixes, declined[0]):
                        declined.pop(0)
                except Exception as exc:  # a prompt it cannot learn is not one to answer for: drop it, go on
                    log.error("prefill_learn_failed", error=f"{type(exc).__name__}: {exc}")
                    declined.pop(0)
                continue
            group = prompts.recv()
        except EOFError:
            return
        try:
            replies.send(("tokens", first_tokens(loaded.model, torch, prefixes, group, generator, declined)))
        except Exception as exc:
            replies.send(("failed", f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    main()
