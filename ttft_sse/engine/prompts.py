"""A request's prompt as the model reads it: the chat template applied where there is one, then token ids.

Text the chat template made already holds the special tokens the template writes (a BOS among them, where the
model uses one), so it is tokenized without adding any, as transformers' own ``apply_chat_template`` does. Any
other text (a raw prompt, or a model without a chat template) is tokenized the way the model's tokenizer does by
default, special tokens included: without its BOS many models answer garbage.

A model without a chat template serves chat requests by a documented fallback: the messages' contents, one a line
in order, roles dropped, tokenized as a plain prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ttft_sse.engine.base import ChatMessage, Prompt
from ttft_sse.errors import InvalidRequest, PromptTooLong


def prepare(
    tokenizer: Any,
    context_length: int,
    *,
    prompt: str | None,
    messages: Sequence[ChatMessage] | None,
    raw: bool,
) -> Prompt:
    """The prompt of a request that has ``prompt`` or ``messages``; ``raw`` skips the chat template.

    Raises :class:`InvalidRequest` when the template refuses the conversation or the text encodes to no tokens,
    and :class:`PromptTooLong` when no room is left in ``context_length`` to generate."""
    if messages is None:
        assert prompt is not None
        messages = [ChatMessage("user", prompt)]
    templated = not raw and tokenizer.chat_template is not None
    if templated:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises its own TemplateError for conversations it refuses
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}", param="messages") from exc
    else:
        text = prompt if prompt is not None else "\n".join(m.content for m in messages)
    ids = tuple(tokenizer(text, add_special_tokens=not templated)["input_ids"])
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
    if len(ids) >= context_length:
        raise PromptTooLong(
            f"the prompt is {len(ids)} tokens; the model's context is {context_length} tokens, and at least one must "
            "be left to generate",
            param="messages" if prompt is None else "prompt",
            code="context_length_exceeded",
        )
    return Prompt(text=text, token_ids=ids)
