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

Nothing here calls llama.cpp: the engine's loop (engine/llamacpp/engine.py) runs the plan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Sequence:
    """One request inside the loop."""

    key: str
    prompt: tuple[int, ...]
    max_tokens: int
    salt: str = (
        ""  # whose kept tokens it may reuse: those of requests with the same salt (ttft_sse/admission/isolation.py)
    )
    seq: int = -1  # llama.cpp's sequence id, once admitted
    cached: int = 0  # leading prompt tokens whose KV the id kept from an earlier request (set at admission)
    computed: int = 0  # prompt tokens in the KV cache (cached ones included)
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
    """What a free sequence id's cells hold: ``tokens`` of a request of ``salt``."""

    salt: str = ""
    tokens: tuple[int, ...] = ()


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
    prompt_rows: int

    def __bool__(self) -> bool:
        return bool(self.rows)


class Schedule:
    """Waiting and running sequences, and the rows of the next step."""

    def __init__(self, *, sequences: int, cells: int, batch_tokens: int, chunk: int, reuse: bool = False) -> None:
        """``cells``: each sequence's KV cells. ``reuse``: a sequence id keeps its tokens when its request leaves."""
        if batch_tokens < sequences:
            raise ValueError(f"batch_tokens ({batch_tokens}) must hold a row for each of {sequences} sequences")
        self.cells = cells
        self.batch_tokens = batch_tokens
        self.chunk = chunk
        self.reuse = reuse
        # Free ids, the one left longest ago first (unused ones before any, 0 first).
        self._free = list(range(sequences))
        # By id: what its cells hold. Replaced whole, never changed in place, so that another thread may read it
        # (:meth:`cached`) while the loop runs; a running id's entry says nothing (it is not reusable).
        self.kept: list[Kept] = [Kept()] * sequences
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}

    @property
    def empty(self) -> bool:
        return not self.waiting and not self.running

    def fits(self, sequence: Sequence) -> bool:
        """Whether ``sequence``'s prompt and max_tokens fit a sequence's cells (else it must not be added)."""
        return sequence.cells <= self.cells

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def admit(self) -> list[Sequence]:
        """Give waiting sequences ids, in arrival order, while ids last: each the free id whose kept tokens share the
        longest prefix with its prompt (the caller then frees the id's cells past ``cached``)."""
        admitted = []
        while self.waiting and self._free:
            sequence = self.waiting.popleft()
            shared = [self._shared(seq, sequence.prompt, sequence.salt) for seq in self._free]
            best = max(range(len(shared)), key=lambda i: (shared[i], -i))  # the longest; on a tie, left longest ago
            sequence.seq = self._free.pop(best)
            sequence.cached = sequence.computed = max(0, min(shared[best], len(sequence.prompt) - 1))
            self.kept[sequence.seq] = Kept()
            self.running[sequence.key] = sequence
            admitted.append(sequence)
        return admitted

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

    def _shared(self, seq: int, prompt: tuple[int, ...], salt: str) -> int:
        kept = self.kept[seq]
        if kept.salt != salt:
            return 0
        return _common_prefix(kept.tokens, prompt)

    def remove(self, key: str) -> Sequence | None:
        """Take a sequence out (finished or cancelled); its id is free again. With ``reuse``, the id keeps the
        sequence's tokens; else the caller frees its KV cells."""
        for waiting in self.waiting:
            if waiting.key == key:
                self.waiting.remove(waiting)
                return None
        sequence = self.running.pop(key, None)
        if sequence is not None:
            if self.reuse:
                self.kept[sequence.seq] = Kept(sequence.salt, sequence.held)
            self._free.append(sequence.seq)
        return sequence

    def plan(self) -> Plan:
        rows: list[Row] = []
        outputs: list[tuple[int, Sequence]] = []
        decoding = [s for s in self.running.values() if s.decoding]
        for sequence in decoding:
            position = len(sequence.prompt) + len(sequence.generated) - 1
            outputs.append((len(rows), sequence))
            rows.append(Row(sequence.seq, sequence.generated[-1], position, True))
        budget = self.batch_tokens - len(rows)
        prompt_rows = 0
        for sequence in _prefilling(self.running.values()):
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
            budget -= take
            prompt_rows += take
        return Plan(tuple(rows), tuple(outputs), prompt_rows)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _prefilling(sequences: Iterable[Sequence]) -> list[Sequence]:
    return [s for s in sequences if s.computed < len(s.prompt)]
