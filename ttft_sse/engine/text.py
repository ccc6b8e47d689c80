"""From token ids to the pieces of text a client sees: eager incremental decoding and stop sequences.

These classes are pure (no torch) and are used by every engine, so the fake and the real engines frame text the
same way. :class:`TokenText` puts the two together for engines that see token ids (one per step).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ttft_sse.engine.base import Finished, FinishReason, Usage

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns token ids, one at a time, into new text as soon as it is decodable.

    Deliberate divergence from transformers' ``TextStreamer``: that one holds text back until a space or a
    newline (it fears an incomplete word), which delays the first visible text by a whole decode step. Here a
    token's text is released at once; only an incomplete UTF-8 sequence (a byte-level token that decodes to
    U+FFFD on its own) is held back until the token that completes it.

    Decoding uses a small window (``prefix`` .. end) rather than the whole history, so the cost per token stays
    flat; the window starts one token back so that tokenizers which strip a leading space on the first token
    (SentencePiece) produce the same spacing as a full decode.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this index have had their text released

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence at the very end)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not final and text.endswith(REPLACEMENT):
            return ""
        # A skipped special token decodes to nothing new; text never repeats and never goes backwards.
        new = text[len(before) :] if len(text) > len(before) else ""
        self._prefix, self._read = self._read, len(self._ids)
        return new


class StopMatcher:
    """Cuts generated text where a stop sequence first appears; the stop text itself is never released.

    Text that could still grow into a stop sequence is held back until it either completes one (generation
    stops, the held text is dropped) or cannot become one any more (it is released).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched = False

    def feed(self, text: str) -> str:
        if not self._stops:
            return text
        buffer = self._pending + text
        hits = [i for stop in self._stops if (i := buffer.find(stop)) != -1]
        if hits:
            self.matched = True
            self._pending = ""
            return buffer[: min(hits)]
        hold = self._partial_suffix(buffer)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return pending

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of ``buffer`` that is the beginning of some stop sequence."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best


class TokenText:
    """One generation's token ids, one at a time, in; the text to release out.

    End-of-sequence tokens are counted (they are completion tokens) but never shown. Once a stop sequence has
    matched, later tokens (a step that was already in flight) are ignored: they are neither counted nor shown.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str], eos: Collection[int]) -> None:
        self._decoder = IncrementalDecoder(decode)
        self.stops = StopMatcher(stops)
        self._eos = eos
        self.count = 0
        self.last_token: int | None = None

    @property
    def stopped(self) -> bool:
        """A stop sequence matched: generation must end now."""
        return self.stops.matched

    def push(self, token_id: int) -> str:
        if self.stops.matched:
            return ""
        self.count += 1
        self.last_token = token_id
        if token_id in self._eos:
            return ""
        return self.stops.feed(self._decoder.push(token_id))

    def finish(self) -> str:
        """The text still held back, at the end of a generation that was not stopped by a stop sequence."""
        if self.stops.matched:
            return ""
        text = self.stops.feed(self._decoder.flush())
        return text if self.stops.matched else text + self.stops.flush()

    def finish_reason(self, max_tokens: int) -> FinishReason:
        if not self.stops.matched and self.last_token not in self._eos and self.count >= max_tokens:
            return "length"
        return "stop"

    def finished(
        self,
        max_tokens: int,
        prompt_tokens: int,
        started: float,
        first_at: float | None,
        ended: float,
        degraded: bool,
        cached_tokens: int = 0,
    ) -> Finished:
        """The generation's last event: its reason, usage and timings (prefill: from ``started`` to the first token,
        ``first_at``, or to ``ended`` where none came; decode: from there to ``ended``; perf_counter seconds)."""
        first = first_at or ended
        return Finished(
            finish_reason=self.finish_reason(max_tokens),
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=self.count, cached_tokens=cached_tokens),
            timings={"prefill_ms": round((first - started) * 1000, 1), "decode_ms": round((ended - first) * 1000, 1)},
            degraded=degraded,
        )
