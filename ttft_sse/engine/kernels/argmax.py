"""The greedy pick of the batched engine's steps: each row's argmax over the vocabulary, in C (``argmax.c``).

transformers' continuous batching picks a step's tokens with ``torch.argmax`` over its logits (the runner's private
``_sample``, with ``do_sample=False``: engine/library/selection.py draws sampled rows before it). On CPU that reads one
value at a time, a measurable part of a decode step over a vocabulary of tens of thousands of tokens (figures:
docs/engine.md). engine/library/hooks.py's ``pick_greedy`` gives the runner ``argmax.c``'s instead (:class:`Argmax`),
which reads a row 16 values at a time.
Its rule is torch's (the first index of the largest value; the first NaN, if any), and comparisons are exact, so the
tokens are the same. Where it cannot be built (no C compiler) the runner keeps torch's, and the log says why
(``argmax_torch``; else ``argmax_c``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import structlog

from ttft_sse.engine.kernels import compiler

log = structlog.get_logger("ttft_sse.engine")

SOURCE = Path(__file__).with_name("argmax.c")
# x, rows, n, stride, out
_ARGUMENTS = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


class Argmax:
    """``argmax.c``'s ``ttft_argmax``, built in ``directory``: each row's argmax of a 2-D fp32 CPU tensor."""

    def __init__(self, directory: Path) -> None:
        self._function = compiler.load(compiler.build(directory, (SOURCE,), "argmax"), "ttft_argmax", _ARGUMENTS)

    def takes(self, scores: Any, torch: Any) -> bool:
        """Whether :meth:`rows` reads ``scores`` as it is: 2-D fp32 on CPU, at least one column, rows of unit
        stride."""
        return bool(
            scores.dim() == 2
            and scores.dtype == torch.float32
            and scores.device.type == "cpu"
            and scores.size(1) > 0
            and scores.stride(1) == 1
        )

    def rows(self, scores: Any, torch: Any) -> Any:
        """The argmax of each row of ``scores`` (see :meth:`takes`), as an int64 tensor."""
        out = torch.empty(scores.size(0), dtype=torch.int64)
        if self._function(scores.data_ptr(), scores.size(0), scores.size(1), scores.stride(0), out.data_ptr()) != 0:
            raise RuntimeError("ttft_argmax refused its arguments")
        return out


def build(directory: Path) -> Argmax | None:
    """``argmax.c`` built in ``directory``, or None (logged as ``argmax_torch``, with the reason) where it cannot
    be."""
    try:
        picker = Argmax(directory)
    except (OSError, RuntimeError) as exc:
        log.warning("argmax_torch", reason=str(exc))
        return None
    log.info("argmax_c")
    return picker
