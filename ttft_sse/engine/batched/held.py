"""A step's outputs held back until the next step's decoder layers are in C.

The batching thread hands each step's outputs to the event loop (:class:`~ttft_sse.engine.threads.Mailboxes`), whose
Python then turns each token into text and an event for its client. Posted as the step ends, that Python takes the GIL
from the batching thread's next step, whose preparation (transformers' Python) comes first: the two run one after
the other, every step, although the decoder layers then run in C without the GIL for most of the step.
:class:`Held` keeps a step's outputs until the next step's layers are about to go into C
(:attr:`~ttft_sse.engine.library.in_place.StepHooks.before_kernel`, which the decoder layers in C call) and posts them
there, so that the event loop's work runs beside the kernel (figures: docs/engine.md).

Only what can wait that long (a step's preparation, about a millisecond) is held: a step's outputs that include a
request's first token (its time to first token), its last (finished or failed) are posted at once, with what was
held before them, in order. Outputs are held only after a step whose layers called :meth:`Held.release`, which a
step of the decoder layers in C over the paged cache read in place always does, before its first layer; a step
that did not call it (a model whose layers are not in C: nothing is held for it) posts what was held and its own
at once. All of it runs on the batching thread."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class Held:
    """The outputs held back, and whether the step in flight's layers went into C."""

    def __init__(self, post: Callable[[Sequence[Any]], None]) -> None:
        self._post = post
        self._outputs: list[Any] = []
        self._in_c = False  # the step in flight called release

    def release(self) -> None:
        """The step's layers go into C now: what was held is posted."""
        self._in_c = True
        self._flush()

    def deliver(self, outputs: Sequence[Any]) -> None:
        """A step's outputs (the library's, each with every token of its request so far): held where its layers
        went into C and none of them is urgent (:func:`urgent`); else posted now, after what was held."""
        in_c, self._in_c = self._in_c, False
        self._outputs.extend(outputs)
        if not in_c or any(urgent(output) for output in outputs):
            self._flush()

    def _flush(self) -> None:
        outputs, self._outputs = self._outputs, []
        if outputs:
            self._post(outputs)


def urgent(output: Any) -> bool:
    """An output that is not held: a request's first token, its last (finished) or its error."""
    return output.error is not None or bool(output.is_finished()) or len(output.generated_tokens) <= 1
