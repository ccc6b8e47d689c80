from __future__ import annotations

from typing import Any

import pytest

from ttft_sse.engine.loading import sources
from ttft_sse.engine.text import IncrementalDecoder, StopMatcher
from ttft_sse.stages import StageClock


@pytest.fixture(scope="module")
def tokenizer(settings: Any) -> Any:
    from transformers import AutoTokenizer

    location = sources.materialize(sources.resolve("bundled"), settings.cache_dir, StageClock())
    return AutoTokenizer.from_pretrained(location)


def pieces_of(tokenizer: Any, text: str) -> list[str]:
    decoder = IncrementalDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    out = [decoder.push(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    out.append(decoder.flush())
    return out


def test_each_token_is_released_at_once_without_waiting_for_a_word_boundary(tokenizer: Any) -> None:
    text = "The capital of France is Paris. Its population is about 2,100,000 (2023)!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = pieces_of(tokenizer, text)
    assert "".join(pieces) == text
    # Every token that is a whole character sequence yields its own text on its own push.
    assert [p for p in pieces[:-1] if p] == [tokenizer.decode([i]) for i in ids]
    assert pieces[-1] == ""


def test_incomplete_utf8_is_held_back_until_completed(tokenizer: Any) -> None:
    text = "I like 🦀 and 東京 and naïve café"
    pieces = pieces_of(tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # The crab emoji is split over several byte-level tokens: those pushes release nothing until it is whole.
    assert len([p for p in pieces if p]) < len(ids)
    assert "🦀" in [p.strip() for p in pieces]


def test_special_tokens_release_no_text(tokenizer: Any) -> None:
    decoder = IncrementalDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    ids = tokenizer("Hi there", add_special_tokens=False)["input_ids"]
    released = [decoder.push(i) for i in ids] + [decoder.push(tokenizer.eos_token_id)]
    assert "".join(released) == "Hi there"
    assert released[-1] == ""


@pytest.mark.parametrize(
    ("stops", "chunks", "released", "matched"),
    [
        ([], ["Hello", " world"], ["Hello", " world"], False),
        (["END"], ["Hello E", "N", "D more"], ["Hello ", "", ""], True),
        (["END"], ["Hello E", "N", "x"], ["Hello ", "", "ENx"], False),
        (["\n\n", "User:"], ["a\n", "\nb"], ["a", ""], True),
        (["abc", "bcd"], ["xab", "cd"], ["x", ""], True),
        (["stop"], ["nonstop"], ["non"], True),
    ],
)
def test_stop_sequences_are_cut_and_never_released(
    stops: list[str], chunks: list[str], released: list[str], matched: bool
) -> None:
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        out.append(matcher.feed(chunk))
        if matcher.matched:
            break
    assert out == released
    assert matcher.matched is matched


def test_partial_stop_at_the_end_is_released_on_flush() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("answer </") == "answer "
    assert matcher.flush() == "</"
    assert not matcher.matched
