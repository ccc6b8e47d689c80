"""Statistics over measured requests. Pure functions of their inputs; no clock, no I/O.

Percentiles interpolate linearly between the two nearest ranks (Hyndman & Fan type 7: numpy's and Excel's
``PERCENTILE.INC`` default), so p50 of ``[1, 2, 3, 4]`` is 2.5 and p100 is the maximum. Latency figures are taken
over ``ok`` requests only; every other outcome is counted in ``errors``, by kind, and in ``requests``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ttft_sse.bench.client import OUTCOMES, Record

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values``, interpolated linearly between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be between 0 and 100, got {q}")
    ordered = sorted(values)
    # (n - 1) * q is exact for whole q, so the rank and its fraction are exact too: p90 of 1..10 is 9.1, not 9.09999.
    rank, rest = divmod((len(ordered) - 1) * q, 100)
    low = int(rank)
    if rest == 0:
        return float(ordered[low])
    return float(ordered[low] + (ordered[low + 1] - ordered[low]) * rest / 100)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """``n``, ``p50``/``p90``/``p99``, ``mean``, ``min``, ``max``; the figures are ``None`` for no values."""
    out: dict[str, float | int | None] = {"n": len(values)}
    for q in QUANTILES:
        out[f"p{q}"] = _round(percentile(values, q)) if values else None
    out["mean"] = _round(statistics.fmean(values)) if values else None
    out["min"] = _round(min(values)) if values else None
    out["max"] = _round(max(values)) if values else None
    return out


def summarize(records: Iterable[Record], *, active_s: float) -> dict[str, Any]:
    """The figures of one arm. ``active_s``: the wall time during which this arm had requests in flight."""
    records = list(records)
    ok = [r for r in records if r.ok]
    kinds = Counter(r.outcome for r in records)
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "outcomes": {kind: kinds[kind] for kind in OUTCOMES if kinds[kind]},
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.gaps_ms]),
        "total_ms": distribution([r.total_ms for r in ok if r.total_ms is not None]),
        "headers_ms": distribution([r.headers_ms for r in ok if r.headers_ms is not None]),
        "tokens": tokens,
        "active_s": _round(active_s),
        "tokens_per_s": _round(tokens / active_s) if active_s > 0 else None,
        "requests_per_s": _round(len(ok) / active_s) if active_s > 0 else None,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` rounded to 3 places; ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return round(numerator / denominator, 3)


def _round(value: float) -> float:
    return round(value, 3) if math.isfinite(value) else value
