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
    seq: int = -1  # llama.cpp's sequence id, once admitted
    computed: int = 0  # prompt tokens in the KV cache
    generated: list[int] = field(default_factory=list)

    @property
    def cells(self) -> int:
        """KV cells the sequence may need at most: its prompt and every token it may generate (the last one's are
        never written, but llama.cpp's positions run to it)."""
        return len(self.prompt) + self.max_tokens

    @property
    def decoding(self) -> bool:
        return bool(self.generated)


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

    def __init__(self, *, sequences: int, cells: int, batch_tokens: int, chunk: int) -> None:
        """``cells``: each sequence's KV cells."""
        if batch_tokens < sequences:
            raise ValueError(f"batch_tokens ({batch_tokens}) must hold a row for each of {sequences} sequences")
        self.cells = cells
        self.batch_tokens = batch_tokens
        self.chunk = chunk
        self._free = list(range(sequences - 1, -1, -1))  # popped from the end: 0 first
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
        """Give waiting sequences ids, in arrival order, while ids last."""
        admitted = []
        while self.waiting and self._free:
            sequence = self.waiting.popleft()
            sequence.seq = self._free.pop()
            self.running[sequence.key] = sequence
            admitted.append(sequence)
        return admitted

    def remove(self, key: str) -> Sequence | None:
        """Take a sequence out (finished or cancelled); its id is free again. The caller frees its KV cells."""
        for waiting in self.waiting:
            if waiting.key == key:
                self.waiting.remove(waiting)
                return None
        sequence = self.running.pop(key, None)
        if sequence is not None:
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


def _prefilling(sequences: Iterable[Sequence]) -> list[Sequence]:
    return [s for s in sequences if s.computed < len(s.prompt)]
