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


MARKER = "\uffffttft-typing\uffff"
"""Put after the last message's text to find where that text ends in the rendered prompt: no template writes it."""
PROBES = ("a", "A", " a", "1", " 1", ".", ",", "?", "!", "'", "-", " ", "\n", "é", "\u4e2d")
"""Text that may follow what is typed so far, one of each kind a tokenizer's pre-tokenizer tells apart (letters,
digits, punctuation, spaces, newlines, other scripts): the tokens every one of them leaves alone are stable."""


def prepare_prefix(
    tokenizer: Any,
    context_length: int,
    *,
    prompt: str | None,
    messages: Sequence[ChatMessage] | None,
    raw: bool,
) -> Prompt:
    """The tokens that every request completing the last message (``prompt``'s text, or the last of ``messages``)
    starts with: the prompt up to the end of that text, less the tokens whose split may change as text is added.

    The rendered prompt is cut where the message's text ends, less the word being typed (its last characters after
    whitespace, which may still grow into another token: "oil" → "oils") and the whitespace before it; each of
    :data:`PROBES` appended to that, and the whole prompt as it stands (the message sent as it is), is tokenized, and
    the tokens all of them share are the stable prefix. A tokenizer merges characters into tokens within a
    pre-token (a word, a run of digits, of punctuation or of spaces), and the probes start the next pre-token every
    way text can. Never the prompt's last token: a request computes that one itself."""
    whole = prepare(tokenizer, context_length, prompt=prompt, messages=messages, raw=raw)
    if messages is None:
        assert prompt is not None
        marked_prompt, marked = prompt + MARKER, None
    else:
        last = messages[-1]
        marked_prompt, marked = None, [*messages[:-1], ChatMessage(last.role, last.content + MARKER)]
    text = prepare(tokenizer, context_length + 64, prompt=marked_prompt, messages=marked, raw=raw).text
    cut = text.find(MARKER)
    head = text[:cut] if cut >= 0 else whole.text
    # The last word typed may still grow ("oil" → "oils" is another token), and so may the spaces before it.
    head = _without_last_word(head) if cut >= 0 else head
    templated = not raw and tokenizer.chat_template is not None
    stable = list(whole.token_ids[:-1])
    for probe in PROBES:
        ids = tokenizer(head + probe, add_special_tokens=not templated)["input_ids"]
        stable = stable[: _common(stable, ids)]
    return Prompt(text=head, token_ids=tuple(stable))


def _without_last_word(text: str) -> str:
    """``text`` less the characters after its last whitespace (a word being typed) and that whitespace."""
    end = len(text)
    while end and not text[end - 1].isspace():
        end -= 1
    while end and text[end - 1].isspace():
        end -= 1
    return text[:end]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
