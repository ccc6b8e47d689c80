"""The account of each GGUF type's path, which ``/readyz`` and the log show (:func:`by_type`), and why a layer the
file holds stays fp32 (:func:`why_not`). Layers are found in the file by name (engine/kernels/stored.py).
"""

from __future__ import annotations

from collections import Counter

from ttft_sse.engine.kernels.codes import DENSE, FORMATS
from ttft_sse.engine.kernels.stored import UNKNOWN

_NO_LAYOUT_K = frozenset({"Q2_K", "Q3_K"})


def why_not(kind: str) -> str:
    """Why a layer whose weight the file holds as ``kind`` (a GGUF type's name) stays fp32."""
    if kind in {f.name for f in FORMATS.values()}:
        return "its blocks do not give back the file's dequantisation bit for bit"
    if kind in {name for name, _ in DENSE.values()}:
        return "its values do not give back the file's weight bit for bit"
    if kind in _NO_LAYOUT_K:
        return "no kernel layout for 16-input scales and minimums"
    if kind == UNKNOWN:
        return "the file holds no tensor for it"
    return "no kernel layout for its blocks"


NOT_QUANTISED = "not quantised: int8 rows multiply quantised blocks"
"""Why a layer on the kernel keeps fp32 rows where int8 rows are asked for: its type is a dense one
(``Codes.unquantised``), and every quantised type has int8 records (engine/kernels/layouts.py's ``records``)."""


def by_type(kinds: dict[str, str], rows: dict[str, str], asked: str) -> dict[str, str]:
    """The path of each GGUF type's layers, by the type's name (:data:`UNKNOWN` for layers no matrix
    of the file holds), e.g. ``{"Q4_K": "blocks: 168", "F16": "fp32: 42 (not quantised)"}``. ``kinds``: each layer's
    type; ``rows``: the rows of each layer on the kernel, ``"fp32"`` or ``"int8"``; ``asked``: the rows asked for. A
    type whose layers take more than one path lists each, joined by "; ": on the kernel with the rows asked for, then
    with fp32 rows where int8 ones were asked for but the layer is not quantised, then fp32 layers, with the
    reason.
    """
    paths: dict[str, Counter[tuple[int, str]]] = {}
    for name, kind in kinds.items():
        row = rows.get(name)
        if row is None:
            path = (2, f"fp32: {{}} ({why_not(kind)})")
        elif row == asked:
            path = (0, "blocks: {}" if row == "fp32" else "blocks, int8 rows: {}")
        else:
            path = (1, f"blocks, fp32 rows: {{}} ({NOT_QUANTISED})")
        paths.setdefault(kind, Counter())[path] += 1
    return {
        kind: "; ".join(text.format(count) for (_, text), count in sorted(counted.items()))
        for kind, counted in sorted(paths.items())
    }
