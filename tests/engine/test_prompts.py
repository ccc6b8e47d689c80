"""engine/prompts.py with a tokenizer that adds a BOS by default (tests/support/tinymodels.py): every path keeps
exactly one BOS, whether the model has a chat template or not."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ttft_sse.engine.base import ChatMessage
from ttft_sse.engine.prompts import prepare
from ttft_sse.errors import InvalidRequest, PromptTooLong

CONTEXT = 256
QUESTION = "what is the capital of france ?"
# A template that writes the BOS itself, as Llama's and Gemma's do: tokenizing its text with the tokenizer's
# special tokens as well would start the prompt with two.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_models: Callable[[str], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models("llama")))


@pytest.fixture(scope="module")
def templated(tokenizer: Any) -> Any:
    with_template = copy.deepcopy(tokenizer)
    with_template.chat_template = TEMPLATE
    return with_template


def ids(tokenizer: Any, *words: str) -> tuple[int, ...]:
    """The ids of ``words``, one token each (the tiny vocabulary has no sub-words)."""
    out = tuple(tokenizer.convert_tokens_to_ids(list(words)))
    assert tokenizer.unk_token_id not in out or "<unk>" in words, f"a word outside the tiny vocabulary: {words}"
    return out


def test_the_tiny_tokenizer_adds_a_bos_by_default_and_has_no_template(tokenizer: Any) -> None:
    assert tokenizer.chat_template is None
    assert tokenizer.bos_token_id == 0
    assert tuple(tokenizer("hello world")["input_ids"]) == ids(tokenizer, "<s>", "hello", "world")


def test_a_plain_prompt_keeps_the_bos(tokenizer: Any) -> None:
    prompt = prepare(tokenizer, CONTEXT, prompt="hello world", messages=None, raw=False)
    assert prompt.text == "hello world"
    assert prompt.token_ids == ids(tokenizer, "<s>", "hello", "world")


@pytest.mark.parametrize("with_template", [False, True], ids=["no-template", "template"])
def test_a_raw_prompt_keeps_the_bos_and_skips_any_template(tokenizer: Any, templated: Any, with_template: bool) -> None:
    chosen = templated if with_template else tokenizer
    prompt = prepare(chosen, CONTEXT, prompt=QUESTION, messages=None, raw=True)
    assert prompt.text == QUESTION
    assert prompt.token_ids == ids(tokenizer, "<s>", *QUESTION.split())


def test_messages_without_a_template_are_joined_one_a_line_roles_dropped_and_keep_the_bos(tokenizer: Any) -> None:
    messages = [
        ChatMessage("system", "answer short"),
        ChatMessage("user", "hello"),
        ChatMessage("assistant", "hi"),
        ChatMessage("user", "tell me a story"),
    ]
    prompt = prepare(tokenizer, CONTEXT, prompt=None, messages=messages, raw=False)
    assert prompt.text == "answer short\nhello\nhi\ntell me a story"
    assert prompt.token_ids == ids(tokenizer, "<s>", "answer", "short", "hello", "hi", "tell", "me", "a", "story")


def test_a_template_that_writes_the_bos_gives_exactly_one(tokenizer: Any, templated: Any) -> None:
    messages = [ChatMessage("user", "hello world")]
    prompt = prepare(templated, CONTEXT, prompt=None, messages=messages, raw=False)
    assert prompt.text == "<s>user : hello world\nassistant :"
    assert prompt.token_ids == ids(tokenizer, "<s>", "user", ":", "hello", "world", "assistant", ":")
    assert prompt.token_ids.count(tokenizer.bos_token_id) == 1
    # A plain prompt goes through the same template as a one-message conversation.
    plain = prepare(templated, CONTEXT, prompt="hello world", messages=None, raw=False)
    assert plain == prompt


def test_the_bos_counts_towards_the_context(tokenizer: Any) -> None:
    """3 tokens with the BOS: a context of 4 leaves one to generate, a context of 3 leaves none."""
    assert prepare(tokenizer, 4, prompt="hello world", messages=None, raw=False).token_ids == (0, 3, 4)
    with pytest.raises(PromptTooLong, match="the prompt is 3 tokens; the model's context is 3 tokens") as raised:
        prepare(tokenizer, 3, prompt="hello world", messages=None, raw=False)
    assert (raised.value.param, raised.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(PromptTooLong) as raised:
        prepare(tokenizer, 3, prompt=None, messages=[ChatMessage("user", "hello world")], raw=False)
    assert raised.value.param == "messages"


def test_text_that_encodes_to_no_tokens_is_refused(templated: Any) -> None:
    """Text from a template is tokenized without added specials, so a template that writes nothing leaves no
    tokens."""
    silent = copy.deepcopy(templated)
    silent.chat_template = "{% for m in messages %}{% endfor %}"
    with pytest.raises(InvalidRequest, match="the prompt encodes to no tokens") as raised:
        prepare(silent, CONTEXT, prompt="hello", messages=None, raw=False)
    assert not isinstance(raised.value, PromptTooLong)


def test_a_template_that_refuses_the_conversation_is_an_invalid_request(templated: Any) -> None:
    strict = copy.deepcopy(templated)
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequest, match="the model's chat template rejected the messages: roles must alternate"):
        prepare(strict, CONTEXT, prompt=None, messages=[ChatMessage("user", "hello")], raw=False)


TYPED = "Explain how a lighthouse lens focuses light, and why older ones used whale oil"
GOES_ON = ("s", " lamps", "!", "'s", "1850", ",", "\n\nthanks", "é", " 中文")


def test_the_prefix_of_a_message_being_typed_starts_every_request_that_completes_it(reference: Any) -> None:
    # The bundled model's BPE tokenizer and chat template: the prefix is the prompt up to the text typed so far, less
    # the tokens a continuation may re-split; every way the message can go on keeps it.
    system = ChatMessage("system", "You answer in one sentence.")
    head = reference.prepare_prefix(prompt=None, messages=[system, ChatMessage("user", TYPED)], raw=False)
    whole = reference.prepare(prompt=None, messages=[system, ChatMessage("user", TYPED)], raw=False)
    assert 0 < whole.n_tokens - head.n_tokens <= 10  # the end of the message and the template's tail
    for more in GOES_ON:
        final = reference.prepare(prompt=None, messages=[system, ChatMessage("user", TYPED + more)], raw=False)
        assert final.token_ids[: head.n_tokens] == head.token_ids, more
    # A plain prompt, through the template as a user message, and a raw one, likewise.
    for raw in (False, True):
        head = reference.prepare_prefix(prompt=TYPED, messages=None, raw=raw)
        for more in GOES_ON:
            final = reference.prepare(prompt=TYPED + more, messages=None, raw=raw)
            assert final.token_ids[: head.n_tokens] == head.token_ids, (raw, more)
