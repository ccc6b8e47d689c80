"""A request's prompt as the model reads it: the chat template applied where there is one, then token ids.

Text the chat template made already holds the special tokens the template writes (a BOS among them, where the
model uses one), so it is tokenized without adding any, as transformers' own ``apply_chat_template`` does. Any
other text (a raw prompt, or a model without a chat template) is tokenized the way the model's tokenizer does by
default, its added special tokens (a BOS) included: without its BOS many models answer garbage.

**Text stays text.** A message's content is text: a special token's string in it (``<|im_end|>``, ``<s>``) is read
as those characters, never as the token, so that no content can close its turn and forge another; only the chat
template writes special tokens. The same holds for a prompt that goes through the template, and for the messages
of a model without one. A raw prompt is the caller's own format: its special-token strings are read as special
tokens (``parse_special``, the default for raw prompts at the HTTP layer) or, with ``parse_special`` false, as text.

How a templated conversation keeps content as text: each special-token string in a message's content is swapped
for a placeholder the template passes on untouched (private-use characters), the template is rendered, and the
text is tokenized piece by piece: the template's pieces as the tokenizer reads them (its markers become special
tokens), each placeholder's string as text. A conversation without such strings (nearly all) is tokenized in one
piece, exactly as before. Around a special-token string in content the text is split into tokens on its own, as
happens around any special token; a tokenizer that puts a space in front of each piece it is given (SentencePiece's
legacy mode) may show the model a space there.

A model without a chat template serves chat requests by a documented fallback: the messages' contents, one a line
in order, roles dropped, tokenized as a plain prompt (as text).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from ttft_sse.engine.base import ChatMessage, ModelInfo, Prompt
from ttft_sse.errors import InvalidRequest, PromptTooLong, quoted

# Placeholders: a private-use character (one no content of the request holds), a number, the same character. The
# number picks the special-token string it stands for.
_PLACEHOLDER_CHARACTERS = tuple(chr(code) for code in range(0xF0000, 0xF0040))


def prepare(
    tokenizer: Any,
    context_length: int,
    *,
    prompt: str | None,
    messages: Sequence[ChatMessage] | None,
    raw: bool,
    parse_special: bool = False,
) -> Prompt:
    """The prompt of a request that has ``prompt`` or ``messages``; ``raw`` skips the chat template, and
    ``parse_special`` reads special-token strings in a raw prompt as special tokens (else as text; messages and
    templated prompts are always text).

    Raises :class:`InvalidRequest` when the template refuses the conversation or the text encodes to no tokens,
    and :class:`PromptTooLong` when no room is left in ``context_length`` to generate."""
    if messages is None:
        assert prompt is not None
        messages = [ChatMessage("user", prompt)]
    param = "messages" if prompt is None else "prompt"
    if not raw and tokenizer.chat_template is not None:
        text, ids = _templated(tokenizer, messages, param)
    elif raw and parse_special:
        text = prompt if prompt is not None else "\n".join(m.content for m in messages)
        ids = tuple(tokenizer(text)["input_ids"])
    else:
        text = prompt if prompt is not None else "\n".join(m.content for m in messages)
        ids = _text_ids(tokenizer, text, add_special_tokens=True, param=param)
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens", param="prompt")
    if len(ids) >= context_length:
        raise PromptTooLong(
            f"the prompt is {len(ids)} tokens; the model's context is {context_length} tokens, and at least one must "
            "be left to generate",
            param=param,
            code="context_length_exceeded",
        )
    return Prompt(text=text, token_ids=ids)


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings of the tokenizer's special tokens (its added tokens marked special), longest first."""
    found = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special and token.content}
    return tuple(sorted(found, key=lambda s: (-len(s), s)))


def marker_ids(tokenizer: Any) -> frozenset[int]:
    """The ids no text may produce: the special tokens', less the unknown token's (which stands for text the
    vocabulary cannot spell, and is what such text gives)."""
    specials = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(specials - {tokenizer.unk_token_id})


def _templated(tokenizer: Any, messages: Sequence[ChatMessage], param: str) -> tuple[str, tuple[int, ...]]:
    """The chat template's text of ``messages`` and its ids: the template's special tokens, the content as text."""
    specials = _pattern(special_strings(tokenizer))
    contents = [m.content for m in messages]
    held = specials is not None and any(specials.search(content) for content in contents)
    mark = ""
    if held:
        assert specials is not None
        mark = next(c for c in _PLACEHOLDER_CHARACTERS if not any(c in content for content in contents))
        strings: dict[str, int] = {}

        def placeholder(match: re.Match[str]) -> str:
            return f"{mark}{strings.setdefault(match.group(), len(strings))}{mark}"

        contents = [specials.sub(placeholder, content) for content in contents]
    try:
        rendered: str = tokenizer.apply_chat_template(
            [_as_template_message(m, content) for m, content in zip(messages, contents, strict=True)],
            add_generation_prompt=True,
            tokenize=False,
        )
    except Exception as exc:  # jinja raises its own TemplateError for conversations it refuses
        raise InvalidRequest(f"the model's chat template rejected the messages: {exc}", param="messages") from exc
    if not held:
        return rendered, tuple(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    by_number = {number: string for string, number in strings.items()}
    # re.split with one group: template text at even places, a placeholder's number at odd ones.
    pieces = re.split(f"{mark}([0-9]+){mark}", rendered)
    text: list[str] = []
    ids: list[int] = []
    for place, piece in enumerate(pieces):
        if place % 2:
            piece = by_number[int(piece)]
            ids.extend(_text_ids(tokenizer, piece, add_special_tokens=False, param=param))
        elif piece:
            ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        text.append(piece)
    return "".join(text), tuple(ids)


def _as_template_message(message: ChatMessage, content: str) -> dict[str, str]:
    fields = {"role": message.role, "content": content}
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    return fields


def _text_ids(tokenizer: Any, text: str, *, add_special_tokens: bool, param: str) -> tuple[int, ...]:
    """``text``'s ids, its special-token strings read as plain characters (transformers' ``split_special_tokens``);
    ``add_special_tokens`` adds what the tokenizer adds by default (a BOS).

    A vocabulary that spells a special token's string only as that token (a word-level one, say) would still
    turn the text into the token: such text is refused rather than read as a marker."""
    encoded = tokenizer(
        text, add_special_tokens=add_special_tokens, split_special_tokens=True, return_special_tokens_mask=True
    )
    ids = tuple(encoded["input_ids"])
    markers = marker_ids(tokenizer)
    for token, added in zip(ids, encoded["special_tokens_mask"], strict=True):
        if token in markers and not added:
            string = tokenizer.convert_ids_to_tokens(token)
            raise InvalidRequest(
                f"the text holds {quoted(string)}, which this model's tokenizer reads only as its special token; "
                "special tokens come from the chat template alone: leave it out",
                param=param,
            )
    return ids


@functools.lru_cache(maxsize=16)
def _pattern(strings: tuple[str, ...]) -> re.Pattern[str] | None:
    """A pattern that finds any of ``strings`` (longest first, as a tokenizer matches them); None for none."""
    return re.compile("|".join(re.escape(s) for s in strings)) if strings else None


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
    way text can. Never the prompt's last token: a request computes that one itself.

    A conversation whose last message is not the user's (a warm prompt's system prompt or few-shot examples, a
    conversation loaded before its user types) is followed by the user's next message: its prefix runs on through the
    template's start of that message, as if the user had typed nothing yet. Where the request sends something else
    after it, the tokens past the point where they part are computed for nothing; the ones before are found."""
    if messages and messages[-1].role != "user":
        messages = [*messages, ChatMessage("user", "")]
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


class TokenizedPrompts:
    """``prepare`` and ``prepare_prefix`` of an engine that holds its tokenizer (``_tokenizer``, set by its load)
    and knows its context (``info``): the functions above, for the single and llama.cpp engines alike."""

    _tokenizer: Any

    @property
    def info(self) -> ModelInfo:
        raise NotImplementedError

    def prepare(
        self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool, parse_special: bool = False
    ) -> Prompt:
        return prepare(
            self._tokenizer,
            self.info.context_length,
            prompt=prompt,
            messages=messages,
            raw=raw,
            parse_special=parse_special,
        )

    def prepare_prefix(self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool) -> Prompt:
        return prepare_prefix(self._tokenizer, self.info.context_length, prompt=prompt, messages=messages, raw=raw)
