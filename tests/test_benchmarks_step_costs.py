"""benchmarks/step_costs.py's arithmetic: the line through the steps, and the row cost that gives a ratio."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.step_costs import Window, line, multiply_adds, row_cost_for, rows_of


def test_line_recovers_a_and_b_from_steps_on_a_line() -> None:
    one = Window(1, 10.0, 600, {1: [0.015] * 50}, [])
    eight = Window(8, 10.0, 1800, {7: [0.027] * 10, 8: [0.029] * 40, 12: [0.5]}, [])  # 12 rows: not a decode step
    a, b = line([one, eight], 8)
    assert a == pytest.approx(0.013)
    assert b == pytest.approx(0.002)


def test_rows_of_counts_an_interludes_rows_by_its_time_past_a() -> None:
    eight = Window(8, 10.0, 1800, {8: [0.029] * 40}, [0.013 + 0.002 * 18, 0.010])
    assert rows_of(eight, 0.013, 0.002) == pytest.approx(320 + 18 + 0)


@pytest.mark.parametrize("ratio", [3.0, 4.0, 5.0])
def test_the_row_cost_found_gives_the_ratio_asked(ratio: float) -> None:
    a, b = 0.013, 0.002
    one = Window(1, 16.0, 1000, {1: [0.015] * 1000, 20: [0.051] * 30}, [])
    eight = Window(8, 18.0, 3000, {8: [0.029] * 375}, [0.013 + 0.002 * 18] * 100)
    need = row_cost_for(ratio, one, eight, a, b)
    r1, r8 = rows_of(one, a, b), rows_of(eight, a, b)
    t1 = one.seconds + r1 * (need - b)
    t8 = eight.seconds + r8 * (need - b)
    assert (eight.tokens / t8) / (one.tokens / t1) == pytest.approx(ratio)
    # The measured ratio is 3000/18 against 1000/16: 2.67x; more asks for cheaper rows, less allows dearer ones.
    assert (need < b) == (ratio > (3000 / 18) / (1000 / 16))


def test_multiply_adds_of_smollm2_135m() -> None:
    config = SimpleNamespace(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        vocab_size=49152,
        head_dim=64,
    )
    # 30 x (q 576x576, k and v 576x192, o 576x576, gate, up and down 576x1536) + the output layer 576x49152.
    assert multiply_adds(config) == 30 * (576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3) + 576 * 49152
