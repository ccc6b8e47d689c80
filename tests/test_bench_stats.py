"""The benchmark's statistics on inputs whose answers are known exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ttft_sse.bench.client import Record
from ttft_sse.bench.stats import distribution, percentile, ratio, summarize


def test_percentiles_of_one_to_ten_are_the_linear_interpolation_between_ranks() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == 9.1
    assert percentile(values, 99) == 9.91
    assert percentile(values, 100) == 10.0


def test_percentiles_land_on_values_when_the_rank_is_whole() -> None:
    values = [float(v) for v in range(0, 101, 10)]  # 0, 10, …, 100: rank (n-1)·q/100 = q/10
    assert [percentile(values, q) for q in (50, 90, 99)] == [50.0, 90.0, 99.0]
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_percentiles_match_numpys_default_method_on_random_samples() -> None:
    rng = random.Random(6)
    for n in (2, 3, 17, 100, 1001):
        values = [rng.expovariate(1 / 200) for _ in range(n)]
        for q in (1, 25, 50, 90, 99, 99.9):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_refuses_no_values_and_out_of_range_q() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)


def test_distribution_of_nothing_is_all_none_not_zero() -> None:
    assert distribution([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "min": None, "max": None}
    assert distribution([2.0, 4.0]) == {
        "n": 2,
        "p50": 3.0,
        "p90": 3.8,
        "p99": 3.98,
        "mean": 3.0,
        "min": 2.0,
        "max": 4.0,
    }


def _record(index: int, **fields: object) -> Record:
    record = Record("t", "native", "stream", 4, index, "p")
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_summary_counts_every_failure_by_kind_and_keeps_failures_out_of_the_latencies() -> None:
    records = [
        _record(0, ttft_ms=100.0, total_ms=1000.0, gaps_ms=[10.0, 30.0], chunks=3, completion_tokens=3),
        _record(1, ttft_ms=200.0, total_ms=2000.0, gaps_ms=[20.0], chunks=2),  # no usage: tokens = chunks
        _record(2, outcome="http_status", status=503, ttft_ms=None, total_ms=5.0),
        _record(3, outcome="error_event", ttft_ms=9000.0, total_ms=9500.0, chunks=5),  # fast or slow, not counted
        _record(4, outcome="dropped", ttft_ms=1.0, total_ms=2.0, chunks=1),
        _record(5, outcome="dropped", total_ms=3.0),
        _record(6, outcome="transport_error", total_ms=1.0),
    ]
    summary = summarize(records, active_s=2.5)
    assert (summary["requests"], summary["ok"], summary["errors"]) == (7, 2, 5)
    assert summary["outcomes"] == {"ok": 2, "http_status": 1, "error_event": 1, "dropped": 2, "transport_error": 1}
    assert summary["ttft_ms"] == {
        "n": 2,
        "p50": 150.0,
        "p90": 190.0,
        "p99": 199.0,
        "mean": 150.0,
        "min": 100.0,
        "max": 200.0,
    }
    assert summary["itl_ms"]["n"] == 3 and summary["itl_ms"]["p50"] == 20.0  # every gap of every ok request, pooled
    assert summary["total_ms"]["max"] == 2000.0
    assert summary["tokens"] == 5
    assert summary["tokens_per_s"] == 2.0  # 5 tokens of ok requests over 2.5 s
    assert summary["requests_per_s"] == 0.8


def test_ratio_is_none_where_a_side_is_missing() -> None:
    assert ratio(300.0, 100.0) == 3.0
    assert ratio(1.0, 3.0) == 0.333
    assert ratio(None, 1.0) is None
    assert ratio(1.0, 0.0) is None
