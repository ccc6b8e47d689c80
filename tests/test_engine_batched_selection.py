"""The batched engine's per-request token selection (greedy, temperature, top-p), on hand-made logits."""

from __future__ import annotations

from typing import Any

import pytest

from ttft_sse.engine.batched import _selection

torch = pytest.importorskip("torch")
INF = float("inf")


def select(scores: list[list[float]], temperature: list[float], top_p: list[float]) -> Any:
    """Run the selection as the library's model runner does: one row of per-request values per processor."""
    args = torch.stack(
        [
            torch.tensor(temperature, dtype=torch.float32).view(dtype=torch.int32),
            torch.tensor(top_p, dtype=torch.float32).view(dtype=torch.int32),
        ]
    )
    logits = torch.tensor(scores)
    return _selection()(torch.zeros(len(scores), dtype=torch.long), logits, args)


def test_a_greedy_row_keeps_only_its_argmax_and_the_first_of_a_tie() -> None:
    out = select([[0.1, 2.0, -1.0, 2.0]], temperature=[0.0], top_p=[1.0])
    assert out.tolist() == [[-INF, 0.0, -INF, -INF]]
    assert torch.multinomial(torch.softmax(out, dim=-1), 1).item() == 1  # the draw that follows is certain


def test_a_sampled_row_is_divided_by_its_temperature() -> None:
    out = select([[1.0, 2.0, -4.0]], temperature=[0.5], top_p=[1.0])
    assert out.tolist() == [[2.0, 4.0, -8.0]]


def test_top_p_keeps_a_token_while_the_probability_before_it_is_below_top_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().tolist()
    # Sorted: 0.5, 0.3, 0.15, 0.05; the mass before each: 0, 0.5, 0.8, 0.95.
    kept = select([logits], temperature=[1.0], top_p=[0.7]).isfinite().tolist()
    assert kept == [[False, True, False, True]]
    kept = select([logits], temperature=[1.0], top_p=[0.85]).isfinite().tolist()
    assert kept == [[False, True, True, True]]
    kept = select([logits], temperature=[1.0], top_p=[0.4]).isfinite().tolist()
    assert kept == [[False, True, False, False]]


def test_each_row_of_a_batch_is_selected_with_its_own_values() -> None:
    rows = [[3.0, 1.0, 2.0], [3.0, 1.0, 2.0], [0.0, 0.0, 5.0]]
    out = select(rows, temperature=[0.0, 2.0, 1.0], top_p=[1.0, 1.0, 0.5])
    assert out.tolist() == [[0.0, -INF, -INF], [1.5, 0.5, 1.0], [-INF, -INF, 5.0]]


def test_rows_that_sample_without_top_p_are_left_whole() -> None:
    scores = [[0.3, -0.2, 0.9]]
    assert select(scores, temperature=[1.0], top_p=[1.0]).tolist() == [[pytest.approx(v) for v in scores[0]]]
