"""Temperature and top-p sampling: the one rule every engine draws by.

The single-request engine (a seeded request's own generator), the batched engine's per-row selection and the
prefill process (the first token of a sampled request, drawn beside the batch) all keep the same tokens: a token
stays while the probability of the tokens before it, most probable first, is below ``top_p``. So a request's answer
comes from the same distribution whichever of them draws it.
"""

from __future__ import annotations

from typing import Any


def outside_top_p(probs: Any, top_p: Any) -> Any:
    """Where ``probs`` (rows of probabilities) fall outside their row's ``top_p`` (a float, or a column of one per
    row): True for the tokens to drop, in the vocabulary's order."""
    import torch

    ordered, order = torch.sort(probs, dim=-1, descending=True)
    outside = torch.cumsum(ordered, dim=-1) - ordered > top_p
    return torch.zeros_like(outside).scatter_(-1, order, outside)


def draw(logits: Any, temperature: float, top_p: float, generator: Any = None) -> Any:
    """One token per row of ``logits``, drawn at ``temperature`` (above 0) from the rows' top-p, with
    ``generator`` (torch's global one if None): a column of token ids."""
    import torch

    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = probs.masked_fill(outside_top_p(probs, top_p), 0.0)
    return torch.multinomial(probs, num_samples=1, generator=generator)
