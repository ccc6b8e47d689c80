"""Top-p and the draw (engine/sampling.py): the shortcut over the most probable tokens keeps exactly what sorting
whole rows keeps."""

from __future__ import annotations

from typing import Any

import pytest

from ttft_sse.engine import sampling

torch = pytest.importorskip("torch")


def sorted_whole(probs: Any, top_p: Any) -> Any:
    """The rule, sorting every whole row: a token stays while the mass before it is below ``top_p``."""
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    outside = torch.cumsum(ordered, dim=-1) - ordered > top_p
    return torch.zeros_like(outside).scatter_(-1, order, outside)


def rows(generator: Any, spread: float) -> Any:
    """8 rows of the bundled model's vocabulary size: logits of standard deviation ``spread`` (small: nearly flat,
    the top-p cut beyond the candidates; large: peaked, the cut among them)."""
    return torch.softmax(torch.randn(8, 49152, generator=generator) * spread, dim=-1)


@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.95, 0.999])
def test_top_p_keeps_what_sorting_the_whole_rows_keeps(spread: float, top_p: float) -> None:
    probs = rows(torch.Generator().manual_seed(int(spread * 10)), spread)
    assert torch.equal(sampling.outside_top_p(probs, top_p), sorted_whole(probs, top_p))


def test_each_row_has_its_own_top_p_and_some_rows_are_cut_beyond_the_candidates() -> None:
    probs = torch.cat([rows(torch.Generator().manual_seed(1), 0.5)[:4], rows(torch.Generator().manual_seed(2), 8)[:4]])
    top_p = torch.tensor([[0.9], [0.2], [0.999], [0.5], [0.9], [0.2], [0.999], [0.5]])
    top = torch.topk(probs, sampling.CANDIDATES, dim=-1).values.sum(-1, keepdim=True)
    beyond = (top <= top_p).squeeze(-1).tolist()
    assert True in beyond and False in beyond  # both ways are taken
    assert torch.equal(sampling.outside_top_p(probs, top_p), sorted_whole(probs, top_p))


def test_a_draw_takes_only_tokens_inside_top_p() -> None:
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    generator = torch.Generator().manual_seed(0)
    drawn = {sampling.draw(logits, 1.0, 0.7, generator).item() for _ in range(200)}
    assert drawn == {1, 3}


def test_a_pick_follows_the_weights_and_never_takes_a_token_of_weight_zero() -> None:
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])  # weights need not sum to 1
    generator = torch.Generator().manual_seed(0)
    picked = torch.cat([sampling.pick(probs, generator) for _ in range(4000)], dim=-1)
    assert set(picked[0].tolist()) == {1, 3}
    assert set(picked[1].tolist()) == {4}
    assert (picked[0] == 1).float().mean().item() == pytest.approx(0.3, abs=0.03)
