"""What each step of the llama.cpp engine computes: continuous batching over llama.cpp's sequences, in pure Python.

A request becomes a :class:`Sequence` with one of llama.cpp's sequence ids once an id is free, in arrival order. Each
sequence has KV cells of its own (``cells`` of them, llama.cpp's per-sequence streams), and a request whose prompt
and ``max_tokens`` do not fit them is never admitted: no step can run out of cells. Each step
(:meth:`Schedule.plan`) holds

* one row for every sequence that is decoding: its last token, whose logits give its next one;
* then prompt rows, oldest request first, up to ``batch_tokens`` rows in all. A prompt that fits in what is left
  goes whole; a longer one goes ``chunk`` rows a step while others decode (every decoding stream still gets a token
  every step), and as many as fit when nothing else runs. The row of a prompt's last token asks for logits: its first
  token comes from that step.

With prefix reuse on (``reuse``), a sequence id that a request leaves keeps its KV cells, and the schedule remembers
the tokens they hold (its prompt and every generated token fed back) and the request's cache salt. A request that
takes an id takes, of the free ones, the one whose kept tokens share the longest prefix with its prompt under the
same salt (else the one left longest ago, unused ones first): that prefix is ``cached``, counted as computed, and only
the rest of the prompt gets rows. At least the prompt's last token is always computed, for its logits. The engine
removes the id's cells past the prefix before the id's first step (:attr:`Sequence.cached`).

**Prefills** (``POST /prefill``; :attr:`Sequence.background`) compute a prompt's KV into a free id and leave it there
for the request that follows, as background work that never stands in a real request's way:

* they wait in a queue of their own and take a free id only where no request waits and their ``held`` is not set (a
  request waits for a slot at the gate); each takes the free id holding the longest prefix of its prompt, and only the
  rest is computed;
* a request that waits makes way: a prefill whose prompt the request's starts with ends (the request computes it,
  and finds in that prefill's id what it computed), and while requests outnumber the free ids, the prefills admitted
  last give their ids up and wait again (what they computed stays in the id's cells, to be found or evicted);
* a step gives them rows after every real one, and no more than keeps the step's prompt rows within ``chunk`` (a
  whole chunk where nothing else computes a prompt); none while ``held``;
* a newer prefill of the same ``owner`` ends the older (:meth:`Schedule.add`);
* done, its id keeps the prompt for ``keep_seconds`` (a warm prompt's, for good: :attr:`Sequence.keep`): meanwhile
  only a sequence whose prompt starts with all of it
  takes that id, unless no other id is free; then it is evicted like any kept prefix.

The prefills that ended (done, ended by a request or a newer prefill, cancelled, or with nothing to compute) are
listed in :attr:`Schedule.ended` for the engine to answer.

**The prefix store** (engine/llamacpp/prefix_store.py) copies the free ids' cells out on drain, the most useful first
(:meth:`Schedule.ranked`), and puts them back at start into free ids (:meth:`Schedule.vacant`, :meth:`Schedule.hold`).

Nothing here calls llama.cpp: the engine's loop (engine/llamacpp/engine.py) runs the plan.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace


@dataclass
class Sequence:
    """One request inside the loop."""

    key: str
    prompt: tuple[int, ...]
    max_tokens: int
    salt: str = ""  # whose kept tokens it may reuse: the same salt's (the engine gives the cache salt's salt_hash)
    background: bool = False  # a prefill: its prompt's KV computed for a request to come, no token generated
    owner: str = ""  # a prefill's: whose newer prefill ends it
    keep: float | None = None  # a prefill's: seconds its prompt is kept once done (None: the schedule's keep_seconds)
    seq: int = -1  # llama.cpp's sequence id, once admitted
    cached: int = 0  # leading prompt tokens whose KV the id kept from an earlier request (set at admission)
    computed: int = 0  # prompt tokens in the KV cache (cached ones included)
    rows: int = 0  # prompt rows computed for it, over every admission (a prefill's work)
    generated: list[int] = field(default_factory=list)

    @property
    def cells(self) -> int:
        """KV cells the sequence may need at most: its prompt and every token it may generate (the last one's are
        never written, but llama.cpp's positions run to it)."""
        return len(self.prompt) + self.max_tokens

    @property
    def decoding(self) -> bool:
        return bool(self.generated)

    @property
    def held(self) -> tuple[int, ...]:
        """The tokens whose KV is in the sequence's cells, in position order: the prompt as far as it is computed,
        then every generated token but the last (the last one is never fed back)."""
        if not self.generated:
            return self.prompt[: self.computed]
        return self.prompt + tuple(self.generated[:-1])


@dataclass(frozen=True)
class Kept:
    """What a free sequence id's cells hold: ``tokens`` of a request of ``salt``; for a prefill's, kept for the
    request that follows it until ``until`` (the schedule's clock; 0: not kept), ``owner``'s."""

    salt: str = ""
    tokens: tuple[int, ...] = ()
    owner: str = ""
    until: float = 0.0


@dataclass(frozen=True)
class Row:
    seq: int
    token: int
    position: int
    logits: bool


@dataclass(frozen=True)
class Plan:
    rows: tuple[Row, ...]
    outputs: tuple[tuple[int, Sequence], ...]  # (row index, sequence) of the rows that ask for logits
    prompt_rows: int  # real requests' (not prefills')
    prefilled: tuple[Sequence, ...] = ()  # prefills whose prompt the step completes (the engine then removes them)

    def __bool__(self) -> bool:
        return bool(self.rows)


class Schedule:
    """Waiting and running sequences, and the rows of the next step."""

    def __init__(
        self,
        *,
        sequences: int,
        cells: int,
        batch_tokens: int,
        chunk: int,
        reuse: bool = False,
        keep_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``cells``: each sequence's KV cells. ``reuse``: a sequence id keeps its tokens when its request leaves.
        ``keep_seconds``: how long a prefill's prompt is kept for the request that follows it."""
        if batch_tokens < sequences:
            raise ValueError(f"batch_tokens ({batch_tokens}) must hold a row for each of {sequences} sequences")
        self.cells = cells
        self.batch_tokens = batch_tokens
        self.chunk = chunk
        self.reuse = reuse
        self.keep_seconds = keep_seconds
        self._clock = clock
        # Free ids, the one left longest ago first (unused ones before any, 0 first).
        self._free = list(range(sequences))
        # By id: what its cells hold. Replaced whole, never changed in place, so that another thread may read it
        # (:meth:`cached`) while the loop runs; a running id's entry says nothing (it is not reusable).
        self.kept: list[Kept] = [Kept()] * sequences
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # prefills computing included
        self.prefills: deque[Sequence] = deque()  # prefills waiting for an id
        self.ended: list[Sequence] = []  # prefills ended since the engine last took them

    @property
    def empty(self) -> bool:
        return not self.waiting and not self.running and not self.prefills

    def fits(self, sequence: Sequence) -> bool:
        """Whether ``sequence``'s prompt and max_tokens fit a sequence's cells (else it must not be added)."""
        return sequence.cells <= self.cells

    def add(self, sequence: Sequence) -> None:
        """Queue a request, or a prefill: that one ends the prefill of its ``owner`` before it, and the keep of that
        prefill's prompt (the newer prompt replaces it)."""
        if not sequence.background:
            self.waiting.append(sequence)
            return
        if sequence.owner:
            for older in [s for s in (*self.prefills, *self.running.values()) if s.owner == sequence.owner]:
                self.remove(older.key)
            self.kept = [replace(k, owner="", until=0.0) if k.owner == sequence.owner else k for k in self.kept]
        self.prefills.append(sequence)

    def admit(self, held: bool = False) -> list[Sequence]:
        """Give waiting sequences ids while ids last: requests first, in arrival order (prefills making way for them
        first), then, unless ``held`` or a request still waits, prefills; each the free id whose kept tokens share the
        longest prefix with its prompt (the caller then frees the id's cells past ``cached``)."""
        self._make_way()
        admitted = []
        while self.waiting and self._free:
            admitted.append(self._take(self.waiting.popleft()))
        while self.prefills and self._free and not held and not self.waiting:
            prefill = self.prefills.popleft()
            if self.cached(prefill.prompt, prefill.salt) >= len(prefill.prompt):
                self._keep_held(prefill)
                self.ended.append(prefill)  # a free id holds all of it already
                continue
            admitted.append(self._take(prefill))
        return admitted

    def _take(self, sequence: Sequence) -> Sequence:
        free, now = self._free, self._clock()
        shared = [self._shared(seq, sequence.prompt, sequence.salt) for seq in free]
        # An id that keeps a prefill's prompt for the request that follows goes to a sequence that starts with all
        # of it, or where no other id is free.
        open_ = [
            i for i, seq in enumerate(free) if self.kept[seq].until <= now or shared[i] >= len(self.kept[seq].tokens)
        ]
        best = max(open_ or range(len(free)), key=lambda i: (shared[i], -i))  # the longest; on a tie, left longest ago
        sequence.seq = free.pop(best)
        last = len(sequence.prompt) - (0 if sequence.background else 1)  # a request computes its last token's logits
        sequence.cached = sequence.computed = max(0, min(shared[best], last))
        self.kept[sequence.seq] = Kept()
        self.running[sequence.key] = sequence
        return sequence

    def _make_way(self) -> None:
        """Prefills make way for the waiting requests: one whose prompt a request's starts with (the same salt) ends,
        and while requests outnumber the free ids, those admitted last give their ids up (what they computed stays in
        the ids' cells) and wait again, first in their queue."""
        if not self.waiting:
            return
        for prefill in [*self.prefills, *(s for s in self.running.values() if s.background)]:
            n = len(prefill.prompt)
            if any(r.salt == prefill.salt and r.prompt[:n] == prefill.prompt for r in self.waiting):
                self.remove(prefill.key)
        computing = [s for s in self.running.values() if s.background]
        while computing and len(self.waiting) > len(self._free):
            prefill = computing.pop()
            self._leave(self.running.pop(prefill.key))
            prefill.seq, prefill.cached, prefill.computed = -1, 0, 0
            self.prefills.appendleft(prefill)

    def cached(self, prompt: tuple[int, ...], salt: str) -> int:
        """The most leading tokens of ``prompt`` that a free id holds for requests of ``salt``. Safe from any
        thread (a hint: the loop may take that id meanwhile)."""
        return max((self._shared(seq, prompt, salt) for seq in range(len(self.kept))), default=0)

    def end_reuse(self, admitted: list[Sequence]) -> None:
        """Reuse no more (llama.cpp cannot free part of a sequence's cells; the caller freed those of every id but the
        running ones): nothing is kept, and the sequences just ``admitted`` compute their whole prompts."""
        self.reuse = False
        self.kept = [Kept()] * len(self.kept)
        for sequence in admitted:
            sequence.cached = sequence.computed = 0
        for prefill in [*self.prefills, *(s for s in self.running.values() if s.background)]:
            self.remove(prefill.key)  # nothing to compute into any more

    def _shared(self, seq: int, prompt: tuple[int, ...], salt: str) -> int:
        kept = self.kept[seq]
        if kept.salt != salt:
            return 0
        return _common_prefix(kept.tokens, prompt)

    def remove(self, key: str) -> Sequence | None:
        """Take a sequence out (finished or cancelled; a prefill also when done, or ended: it goes to :attr:`ended`);
        its id is free again. With ``reuse``, the id keeps the sequence's tokens (a prefill done keeps them for
        ``keep_seconds``); else the caller frees its KV cells."""
        for queue in (self.waiting, self.prefills):
            for waiting in queue:
                if waiting.key == key:
                    queue.remove(waiting)
                    if waiting.background:
                        self.ended.append(waiting)
                    return None
        sequence = self.running.pop(key, None)
        if sequence is not None:
            self._leave(sequence)
            if sequence.background:
                self.ended.append(sequence)
        return sequence

    def _keep_held(self, prefill: Sequence) -> None:
        """A prefill whose whole prompt a free id holds already: that id keeps it at least as long as the prefill
        would have (a warm prompt's, for good, over a prefix the store put back)."""
        keep = self.keep_seconds if prefill.keep is None else prefill.keep
        for seq in self._free:
            kept = self.kept[seq]
            if keep > 0 and kept.salt == prefill.salt and kept.tokens[: len(prefill.prompt)] == prefill.prompt:
                self.kept[seq] = replace(kept, until=max(kept.until, self._clock() + keep))
                return

    def _leave(self, sequence: Sequence) -> None:
        if self.reuse:
            keep = self.keep_seconds if sequence.keep is None else sequence.keep
            done = sequence.background and sequence.computed == len(sequence.prompt) and keep > 0
            until = self._clock() + keep if done else 0.0
            self.kept[sequence.seq] = Kept(sequence.salt, sequence.held, sequence.owner if done else "", until)
        self._free.append(sequence.seq)

    def ranked(self) -> list[int]:
        """The free ids whose cells hold tokens, the most useful first: those a prefill (or a warm prompt) computed
        and no request has taken since, the newest prefill first; then the others, the one left last first."""
        held = [seq for seq in reversed(self._free) if self.kept[seq].tokens]
        return sorted(held, key=lambda seq: -self.kept[seq].until)  # stable: the one left last first on a tie

    def vacant(self) -> list[int]:
        """The free ids, those that hold nothing first, then the one left longest ago first: where to put back what
        the prefix store read."""
        return sorted(self._free, key=lambda seq: bool(self.kept[seq].tokens))

    def hold(self, seq: int, salt: str, tokens: tuple[int, ...], keep: bool = False) -> None:
        """The free id ``seq``'s cells now hold ``tokens`` of ``salt`` (put back by the prefix store; nothing where
        ``tokens`` is empty): it becomes the id left last (left first where it holds nothing); with ``keep``, its
        tokens are kept ``keep_seconds`` for a request to come, as a prefill's prompt."""
        until = self._clock() + self.keep_seconds if keep and tokens and self.keep_seconds > 0 else 0.0
        self.kept[seq] = Kept(salt, tokens, "", until)
        self._free.remove(seq)
        if tokens:
            self._free.append(seq)
        else:
            self._free.insert(0, seq)

    def take_ended(self) -> list[Sequence]:
        """The prefills that ended since the last call."""
        ended, self.ended = self.ended, []
        return ended

    def plan(self, held: bool = False) -> Plan:
        """The next step's rows: the decoding streams', the requests' prompts', then (unless ``held``) prefills'."""
        rows: list[Row] = []
        outputs: list[tuple[int, Sequence]] = []
        real = [s for s in self.running.values() if not s.background]
        decoding = [s for s in real if s.decoding]
        for sequence in decoding:
            position = len(sequence.prompt) + len(sequence.generated) - 1
            outputs.append((len(rows), sequence))
            rows.append(Row(sequence.seq, sequence.generated[-1], position, True))
        budget = self.batch_tokens - len(rows)
        prompt_rows = 0
        for sequence in _prefilling(real):
            if budget <= 0:
                break
            left = len(sequence.prompt) - sequence.computed
            take = left if left <= budget else (min(self.chunk, budget) if decoding and self.chunk else budget)
            for position in range(sequence.computed, sequence.computed + take):
                last = position == len(sequence.prompt) - 1
                if last:
                    outputs.append((len(rows), sequence))
                rows.append(Row(sequence.seq, sequence.prompt[position], position, last))
            sequence.computed += take
            sequence.rows += take
            budget -= take
            prompt_rows += take
        # Prefills: what keeps the step's prompt rows within a chunk (a stream waits no longer for them than for a
        # request's chunk, and a request that comes waits at most a chunk's step).
        room = min(budget, self.chunk - prompt_rows) if self.chunk else budget
        prefilled = []
        for sequence in [] if held else _prefilling(s for s in self.running.values() if s.background):
            if room <= 0:
                break
            take = min(len(sequence.prompt) - sequence.computed, room)
            rows.extend(
                Row(sequence.seq, sequence.prompt[p], p, False)
                for p in range(sequence.computed, sequence.computed + take)
            )
            sequence.computed += take
            sequence.rows += take
            room -= take
            if sequence.computed == len(sequence.prompt):
                prefilled.append(sequence)
        return Plan(tuple(rows), tuple(outputs), prompt_rows, tuple(prefilled))


def salt_hash(salt: str) -> str:
    """What the schedule keeps of a request's cache salt (and the prefix store writes): a hash of it, "" for none."""
    if not salt:
        return ""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"ttft-llama-salt").hexdigest()


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _prefilling(sequences: Iterable[Sequence]) -> list[Sequence]:
    return [s for s in sequences if s.computed < len(s.prompt)]
