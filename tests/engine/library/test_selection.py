"""The batched engine's per-request token selection (greedy, temperature, top-p, and first tokens the prefill process
gave first), on hand-made logits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ttft_sse.engine.first.claims import Claims
from ttft_sse.engine.library.selection import selection

torch = pytest.importorskip("torch")
INF = float("inf")


def run(selection: Any, scores: list[list[float]], rows: list[list[float]]) -> Any:
    """Run ``selection`` as the library's model runner does: one row of per-request values per processor."""
    args = torch.stack([torch.tensor(row, dtype=torch.float32).view(dtype=torch.int32) for row in rows])
    return selection(torch.zeros(len(scores), dtype=torch.long), torch.tensor(scores), args)


def select(scores: list[list[float]], temperature: list[float], top_p: list[float]) -> Any:
    """The whole selection: temperature, top-p, the temperature again for the draw, and no race."""
    chosen = selection(Claims())
    rows = [temperature, top_p, temperature, [0.0] * len(scores)]
    assert chosen.tensors_required == len(rows)
    return run(chosen, scores, rows)


def scaled_and_cut(scores: list[list[float]], temperature: list[float], top_p: list[float]) -> Any:
    """The selection's first two processors alone: what the draw samples from."""
    chosen = selection(Claims())
    chosen.logits_processor = chosen.logits_processor[:2]
    return run(chosen, scores, [temperature, top_p])


def test_a_greedy_row_is_left_to_the_argmax_which_picks_the_first_of_a_tie() -> None:
    out = select([[0.1, 2.0, -1.0, 2.0]], temperature=[0.0], top_p=[1.0])
    assert out.tolist() == [[pytest.approx(0.1), 2.0, -1.0, 2.0]]
    assert out.argmax(dim=-1).item() == 1


def test_a_sampled_row_is_divided_by_its_temperature_before_the_draw() -> None:
    out = scaled_and_cut([[1.0, 2.0, -4.0]], temperature=[0.5], top_p=[1.0])
    assert out.tolist() == [[2.0, 4.0, -8.0]]


def test_a_sampled_row_keeps_only_the_drawn_token_finite_and_draws_by_probability() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([0.1, 0.6, 0.3]).log().tolist()
    drawn = []
    for _ in range(2000):
        out = select([logits], temperature=[1.0], top_p=[1.0])
        assert out.isfinite().sum().item() == 1
        assert out.max().item() == 0.0
        drawn.append(out.argmax(dim=-1).item())
    shares = [drawn.count(i) / len(drawn) for i in range(3)]
    assert shares == [pytest.approx(p, abs=0.04) for p in (0.1, 0.6, 0.3)]


def test_top_p_keeps_a_token_while_the_probability_before_it_is_below_top_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().tolist()
    # Sorted: 0.5, 0.3, 0.15, 0.05; the mass before each: 0, 0.5, 0.8, 0.95.
    kept = scaled_and_cut([logits], temperature=[1.0], top_p=[0.7]).isfinite().tolist()
    assert kept == [[False, True, False, True]]
    kept = scaled_and_cut([logits], temperature=[1.0], top_p=[0.85]).isfinite().tolist()
    assert kept == [[False, True, True, True]]
    kept = scaled_and_cut([logits], temperature=[1.0], top_p=[0.4]).isfinite().tolist()
    assert kept == [[False, True, False, False]]
    for _ in range(50):  # and the draw takes only what top-p kept
        assert select([logits], temperature=[1.0], top_p=[0.7]).argmax(dim=-1).item() in (1, 3)


def test_each_row_of_a_batch_is_selected_with_its_own_values() -> None:
    rows = [[3.0, 1.0, 2.0], [3.0, 1.0, 2.0], [0.0, 0.0, 5.0]]
    out = scaled_and_cut(rows, temperature=[0.0, 2.0, 1.0], top_p=[1.0, 1.0, 0.5])
    assert out.tolist() == [[3.0, 1.0, 2.0], [1.5, 0.5, 1.0], [-INF, -INF, 5.0]]
    drawn = select(rows, temperature=[0.0, 2.0, 1.0], top_p=[1.0, 1.0, 0.5])
    assert drawn[0].tolist() == rows[0]  # greedy: untouched, for the argmax
    assert drawn[1].isfinite().sum().item() == 1  # sampled: one token left
    assert drawn[2].tolist() == [-INF, -INF, 0.0]  # sampled, and top-p left only one token to draw


def test_rows_that_sample_without_top_p_are_left_whole_for_the_draw() -> None:
    scores = [[0.3, -0.2, 0.9]]
    out = scaled_and_cut(scores, temperature=[1.0], top_p=[1.0])
    assert out.tolist() == [[pytest.approx(v) for v in scores[0]]]


def step(
    selection: Any,
    requests: list[tuple[str, list[int]]],
    scores: list[list[float]],
    values: dict[str, Any] | None = None,
) -> Any:
    """A step of ``requests`` (request id, tokens generated so far; a row each), greedy or of ``values`` (each
    request's temperature and top_p), its per-request values prepared by the library's own code, then selected."""
    states = [
        SimpleNamespace(
            has_new_token=True,
            state=SimpleNamespace(
                request_id=request_id, generated_tokens=done, logit_processor_kwargs=(values or {}).get(request_id, {})
            ),
        )
        for request_id, done in requests
    ]
    storage = torch.zeros((selection.tensors_required, len(requests)), dtype=torch.int32)
    args = selection.prepare_tensor_args(states, storage)
    return selection(torch.zeros(len(scores), dtype=torch.long), torch.tensor(scores), args)


def test_a_first_token_the_prefill_process_gave_first_is_the_one_the_step_picks() -> None:
    claims = Claims()
    for request_id in ("process-first", "batch-first", "ended"):
        claims.open(request_id)
    assert claims.side("process-first", 2)
    claims.close("ended")
    assert not claims.side("ended", 2)  # an ended request's token goes nowhere
    scores = [[3.0, 1.0, 0.5]] * 4
    requests = [("process-first", []), ("batch-first", []), ("decoding", [7]), ("not-raced", [])]
    out = step(selection(claims), requests, scores)
    assert out[0].tolist() == [-INF, -INF, 0.0]
    assert out.argmax(dim=-1).tolist() == [2, 0, 0, 0]
    # The step settled the race it had not lost: the process's token, when it comes, is not used.
    assert not claims.wanted("batch-first")
    assert not claims.side("batch-first", 2)


def test_a_step_of_greedy_rows_passes_its_logits_by_untouched_and_its_values_unwritten() -> None:
    chosen = selection(Claims())
    scores = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.0, 3.0]])
    storage = torch.full((chosen.tensors_required, 2), -7, dtype=torch.int32)
    states = [
        SimpleNamespace(
            has_new_token=True,
            state=SimpleNamespace(request_id=name, generated_tokens=[3], logit_processor_kwargs={"temperature": 0.0}),
        )
        for name in ("a", "b")
    ]
    args = chosen.prepare_tensor_args(states, storage)
    assert args is storage and bool((storage == -7).all())  # no processor reads them
    assert chosen(torch.zeros(2, dtype=torch.long), scores, args) is scores
    # The next call, its step not prepared so, runs the processors: the first row samples at temperature 0.5.
    out = run(chosen, [[1.0, 2.0, -4.0]], [[0.5], [1.0], [0.5], [0.0]])
    assert out.isfinite().sum().item() == 1


def test_a_step_with_one_sampled_row_runs_the_processors_on_it_and_leaves_the_greedy_row() -> None:
    torch.manual_seed(0)
    values = {"sampled": {"temperature": 1.0, "top_p": 0.5}, "greedy": {"temperature": 0.0}}
    out = step(selection(Claims()), [("sampled", [1]), ("greedy", [1])], [[0.0, 3.0, 0.0], [0.1, 2.0, -1.0]], values)
    assert out[0].tolist() == [-INF, 0.0, -INF]  # top-p 0.5 keeps the one token of probability 0.82
    assert out[1].tolist() == [pytest.approx(0.1), 2.0, -1.0]
