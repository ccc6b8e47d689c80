"""The batch's token selection, per request: greedy (``temperature`` 0) or temperature and top-p sampling, and
the first tokens given beside the batch (engine/first/claims.py's ``Claims``).

Four of the library's per-request processors (each has a row of the step's per-request values), applied to the
step's logits before the step's argmax (``do_sample=False``; engine/kernels/argmax.py's on CPU). Greedy rows pass
through untouched: the argmax picks their token (the first index on a tie, as ``generate``). A sampled row is

* divided by its temperature;
* cut to its top-p, only if its ``top_p < 1``: a token stays while the probability before it is below ``top_p``
  (engine/sampling.py: every engine's rule, so all sample from the same distribution);
* drawn from: softmax and one draw for the sampled rows only (:func:`~ttft_sse.engine.sampling.pick`), then
  only the drawn token is left finite, so the argmax returns it.

Last, a row that gives a raced request its first token settles the race (:meth:`Claims.batch`): where the side
came first, only its token is left finite.

The library's own sampling path runs softmax and a multinomial draw over the whole vocabulary of every row,
greedy ones included (figures: docs/engine.md). This module imports torch and transformers (the library's
processors through engine/library/internals.py): the batched engine imports it when it builds its batching loop, not
before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch
import transformers

from ttft_sse.engine import sampling
from ttft_sse.engine.library import internals

_PARTS = internals.batching()
ContinuousBatchingLogitsProcessor: Any = _PARTS.logits_processor
ContinuousBatchingLogitsProcessorList: Any = _PARTS.logits_processors


class Claims(Protocol):
    """Who gives each raced request its first token (engine/first/claims.py's ``Claims``), as a step's selection
    tells it and asks it."""

    def scheduled(self, request_ids: Sequence[str]) -> None:
        """These requests' first tokens are rows of the step being prepared."""

    def batch(self, request_ids: Sequence[str]) -> list[int | None]:
        """The token each of these rows must pick (None: its own argmax or draw)."""
        ...


def selection(claims: Claims) -> Any:
    """The processors as one list for the library's batch processor, with ``claims`` settling first tokens."""
    processors = [Temperature(), TopP(), Draw(), Claimed(claims)]
    chosen = Selection(transformers.LogitsProcessorList(processors))
    chosen.tensors_required = len(processors)  # one row of per-request values each (the library counts its own)
    return chosen


class Selection(ContinuousBatchingLogitsProcessorList):  # type: ignore[misc]
    """The library's list of processors, which a step of greedy rows only, none of them a raced first token, passes
    by: its processors would leave every score as it is (the argmax picks), yet cost a few torch calls each, in the
    step's preparation (a tensor of values each) and on its logits (a comparison and its nonzero each), ~0.3 ms a
    step of a small model's ~7 (figures: docs/engine.md). Which steps are such is known when the step is prepared
    (:meth:`prepare_tensor_args`), from the requests' own values; the step's logits then come back untouched. A call
    on logits whose step was not prepared so (every other) runs the processors."""

    plain: bool = False  # the step prepared last is greedy rows only, none a first token settled by a race

    def prepare_tensor_args(self, requests_in_batch: list[Any], arg_storage: Any) -> Any:
        with_token = [request for request in requests_in_batch if request.has_new_token]
        claimed = next(p for p in self.logits_processor if isinstance(p, Claimed))
        greedy = all(r.state.logit_processor_kwargs.get(Temperature.key, Temperature.default) <= 0 for r in with_token)
        if greedy and claimed.take_firsts(with_token) == []:
            self.plain = True
            return arg_storage  # read by no processor: __call__ does not run them
        self.plain = False
        return super().prepare_tensor_args(requests_in_batch, arg_storage)

    def __call__(self, input_ids: Any, scores: Any, logits_processor_args: Any) -> Any:
        plain, self.plain = self.plain, False
        return scores if plain else super().__call__(input_ids, scores, logits_processor_args)


class PerRequest(ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
    """One float per request (``key`` of ``add_request``'s keyword arguments), one row of the batch's args."""

    key: ClassVar[str]
    default: ClassVar[float]
    supported_kwargs: ClassVar[dict[str, type]] = {}
    ignored_kwargs: ClassVar[tuple[str, ...]] = ()

    def fill_defaults(self, int32_tensor: Any) -> None:
        default = torch.full_like(int32_tensor, self.default, dtype=torch.float32)
        int32_tensor.copy_(default.view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
        values = [r.state.logit_processor_kwargs.get(self.key, self.default) for r in requests_with_new_token]
        return torch.tensor(values, dtype=torch.float32).view(dtype=torch.int32)

    def values(self, scores: Any, tensor_arg: Any) -> Any:
        return tensor_arg[: scores.size(0)].view(dtype=torch.float32)


class Temperature(PerRequest):
    key, default = "temperature", 0.0
    supported_kwargs: ClassVar[dict[str, type]] = {"temperature": float}

    def __call__(self, scores: Any, tensor_arg: Any) -> Any:
        temperature = self.values(scores, tensor_arg)
        rows = (temperature > 0).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return scores
        scores = scores.clone()
        scores[rows] = scores[rows] / temperature[rows].unsqueeze(-1)
        return scores


class TopP(PerRequest):
    key, default = "top_p", 1.0
    supported_kwargs: ClassVar[dict[str, type]] = {"top_p": float}

    def __call__(self, scores: Any, tensor_arg: Any) -> Any:
        top_p = self.values(scores, tensor_arg)
        rows = (top_p < 1.0).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return scores
        picked = scores[rows]
        drop = sampling.outside_top_p(torch.softmax(picked, dim=-1), top_p[rows].unsqueeze(-1))
        scores = scores.clone()
        scores[rows] = picked.masked_fill(drop, float("-inf"))
        return scores


class Draw(Temperature):
    """Reads the temperature again: which rows sample."""

    def __call__(self, scores: Any, tensor_arg: Any) -> Any:
        rows = (self.values(scores, tensor_arg) > 0).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return scores
        picked = scores[rows]
        choice = sampling.pick(torch.softmax(picked, dim=-1))
        scores = scores.clone()
        scores[rows] = torch.full_like(picked, float("-inf")).scatter_(-1, choice, 0.0)
        return scores


class Claimed(ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
    """Reads the request ids of the rows that give a request its first token, recorded when the step is
    prepared, not a value: the race is settled when the step's logits are there, not before its forward."""

    supported_kwargs: ClassVar[dict[str, type]] = {}
    ignored_kwargs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, claims: Claims) -> None:
        self.claims = claims
        self.firsts: list[tuple[int, str]] = []  # (row, request id)

    def fill_defaults(self, int32_tensor: Any) -> None:
        int32_tensor.zero_()

    def take_firsts(self, requests_with_new_token: list[Any]) -> list[tuple[int, str]]:
        """Records the rows that give a request its first token (and tells the claims they are scheduled); returns
        them."""
        rows = enumerate(requests_with_new_token)
        self.firsts = [(row, r.state.request_id) for row, r in rows if not r.state.generated_tokens]
        self.claims.scheduled([request_id for _, request_id in self.firsts])
        return self.firsts

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
        self.take_firsts(requests_with_new_token)
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: Any, tensor_arg: Any) -> Any:
        firsts, self.firsts = self.firsts, []
        forced = [
            (row, token)
            for (row, _), token in zip(firsts, self.claims.batch([request_id for _, request_id in firsts]), strict=True)
            if token is not None
        ]
        if not forced:
            return scores
        scores = scores.clone()
        for row, token in forced:
            scores[row] = float("-inf")
            scores[row, token] = 0.0
        return scores
