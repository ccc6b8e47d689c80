"""Temperature and top-p sampling: the one rule every engine draws by.

The single-request engine (a seeded request's own generator), the batched engine's per-row selection and the
prefill process (the first token of a sampled request, drawn beside the batch) all keep the same tokens: a token
stays while the probability of the tokens before it, most probable first, is below ``top_p``. So a request's answer
comes from the same distribution whichever of them draws it.
"""

from __future__ import annotations

from typing import Any

CANDIDATES = 1024
"""The most probable tokens of a row looked at first. Where the top-p cut falls among them (their mass is above
``top_p``), the rest of the vocabulary is dropped without being sorted: a ``topk`` of 1024 costs a fraction of a sort
of the whole row, which would be a large part of a decode step (figures: docs/engine.md)."""


def outside_top_p(probs: Any, top_p: Any) -> Any:
    """Where ``probs`` (rows of probabilities) fall outside their row's ``top_p`` (a float, or a column of one per
    row): True for the tokens to drop, in the vocabulary's order.

    The same answer as sorting each whole row (the mass before each of the :data:`CANDIDATES` most probable tokens
    is summed in the same order), but only rows whose cut falls beyond them are sorted whole."""
    import torch

    rows, vocabulary = probs.shape
    limit = torch.as_tensor(top_p, dtype=probs.dtype, device=probs.device).reshape(-1, 1).expand(rows, 1)
    top, order = torch.topk(probs, min(CANDIDATES, vocabulary), dim=-1)
    mass = torch.cumsum(top, dim=-1)
    outside = torch.ones_like(probs, dtype=torch.bool).scatter_(-1, order, mass - top > limit)
    beyond = (mass[:, -1:] <= limit).squeeze(-1).nonzero().squeeze(-1)  # the next token would still be kept
    if beyond.numel():
        ordered, order = torch.sort(probs[beyond], dim=-1, descending=True)
        whole = torch.cumsum(ordered, dim=-1) - ordered > limit[beyond]
        outside[beyond] = torch.zeros_like(whole).scatter_(-1, order, whole)
    return outside


def pick(probs: Any, generator: Any = None) -> Any:
    """One token per row of ``probs`` (rows of weights, not necessarily summing to 1), each with a chance
    proportional to its weight, drawn with ``generator`` (torch's global one if None): a column of token ids.

    By the inverse of the cumulative weights: one uniform number a row, where ``torch.multinomial`` draws a number
    for every token."""
    import torch

    cumulative = torch.cumsum(probs, dim=-1)
    uniform = torch.rand((probs.size(0), 1), generator=generator, dtype=cumulative.dtype, device=probs.device)
    # right=True: the first token whose cumulative weight is above the number, never one of weight 0.
    chosen = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)
    return chosen.clamp_(max=probs.size(-1) - 1)


def first_token(logits: Any, temperature: float, top_p: float, generator: Any) -> int:
    """The token a prompt's last row of ``logits`` gives: its argmax at temperature 0 (greedy), else one
    :func:`draw`; as the batch's step would choose it (the prefill process's and interludes' first tokens)."""
    if temperature > 0:
        return int(draw(logits[None], temperature, top_p, generator).item())
    return int(logits.argmax())


def draw(logits: Any, temperature: float, top_p: float, generator: Any = None) -> Any:
    """One token per row of ``logits``, drawn at ``temperature`` (above 0) from the rows' top-p, with
    ``generator`` (torch's global one if None): a column of token ids."""
    import torch

    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = probs.masked_fill(outside_top_p(probs, top_p), 0.0)
    return pick(probs, generator)
