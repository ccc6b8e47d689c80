"""The llama.cpp engine with the real bundled model (a Q4_1 GGUF): against llama.cpp's own greedy answer, alone
against together, cancellation and stop sequences freeing the sequence, seeded sampling, and prefix reuse (the same
answers as without it, ``cached_tokens`` the prefix reused, salts kept apart).

Observed through the engine's state (``state()``, ``batch_log``, llama.cpp's KV cells), never through timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, llama_cpp_or_skip
from tests.support.servers import eventually
from tests.support.texts import STORY
from ttft_sse.engine.base import ChatMessage, Finished, Piece, Prompt, SamplingParams, Usage
from ttft_sse.engine.llamacpp import library
from ttft_sse.engine.llamacpp.engine import LlamaCppEngine
from ttft_sse.engine.llamacpp.schedule import salt_hash
from ttft_sse.engine.loading.sources import bundled_gguf
from ttft_sse.errors import EngineError
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

QUESTIONS = (
    "What is the capital of France?",
    "Tell me a story about a dragon.",
    "Write a poem about cats.",
    "Explain gravity to a child.",
    "List the numbers from 1 to 30, separated by commas.",
    "What is 2+2?",
)
SYSTEM = (
    "You are a meticulous assistant for a railway company. You answer questions about timetables, tickets, "
    "luggage, bicycles, pets and accessibility. You keep every answer short, you never invent a train that does "
    "not exist, and when you do not know something you say so and point the traveller to the help desk."
)


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[LlamaCppEngine]:
    llama_cpp_or_skip()
    engine = LlamaCppEngine(settings)
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def plain(settings: Settings) -> Iterator[LlamaCppEngine]:
    """The engine without prefix reuse (``TTFT_PREFIX_CACHE=0``): every prompt computed whole, the reference."""
    llama_cpp_or_skip()
    engine = LlamaCppEngine(settings.replace(prefix_cache=False))
    engine.load(StageClock())
    yield engine
    asyncio.run(engine.close())


def without_cached(usage: Usage) -> Usage:
    return replace(usage, cached_tokens=0)


def kept_cells_match(engine: LlamaCppEngine) -> bool:
    """Each free sequence's cells hold exactly the tokens the schedule says it keeps."""
    schedule = engine._schedule
    assert schedule is not None
    return all(engine.runner.last_position(seq) == len(kept.tokens) - 1 for seq, kept in enumerate(schedule.kept))


def prompts_of(engine: LlamaCppEngine) -> list[Prompt]:
    """Chat prompts of 30-40 tokens, and two longer than a step (a system prompt, a story): computed in several steps of
    at most library.ROWS_PER_STEP rows."""
    prompts = [engine.prepare(prompt=q, messages=None, raw=False) for q in QUESTIONS]
    long = [ChatMessage("system", SYSTEM), ChatMessage("user", "Can I take my bicycle on the night train?")]
    prompts.append(engine.prepare(prompt=None, messages=long, raw=False))
    prompts.append(engine.prepare(prompt=STORY, messages=None, raw=False))
    assert max(p.n_tokens for p in prompts) > library.ROWS_PER_STEP
    return prompts


def test_the_greedy_answer_is_llama_cpps_own_for_the_same_token_ids(engine: LlamaCppEngine) -> None:
    """The reference: llama-cpp-python's high-level ``Llama.generate`` at temperature 0 (its greedy sampler), with
    flash attention and prompt steps of the engine's size, as the engine runs llama.cpp."""
    import llama_cpp

    reference = llama_cpp.Llama(
        str(bundled_gguf()),
        n_ctx=1024,
        n_batch=library.ROWS_PER_STEP,
        n_ubatch=library.ROWS_PER_STEP,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=True,
        verbose=False,
    )
    for prompt in prompts_of(engine)[::2]:
        expected: list[int] = []
        for token in reference.generate(list(prompt.token_ids), temp=0.0, repeat_penalty=1.0, reset=True):
            expected.append(token)
            if token in engine._eos or len(expected) == 40:
                break
        text, finished = asyncio.run(collect(engine.stream(prompt, SamplingParams(max_tokens=40))))
        assert text == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert finished.usage.completion_tokens == len(expected)
    reference.close()


async def test_requests_together_get_exactly_the_text_they_get_alone(engine: LlamaCppEngine) -> None:
    prompts = prompts_of(engine)
    params = SamplingParams(max_tokens=48)
    alone = [await collect(engine.stream(p, params)) for p in prompts]
    steps = engine.state().steps
    together = await asyncio.gather(*(collect(engine.stream(p, params)) for p in prompts))
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert [without_cached(f.usage) for _, f in together] == [without_cached(f.usage) for _, f in alone]
    assert [f.finish_reason for _, f in together] == [f.finish_reason for _, f in alone]
    # They did share steps: fewer steps than tokens.
    tokens = sum(f.usage.completion_tokens for _, f in together)
    assert engine.state().steps - steps < tokens
    assert max(len(keys) for keys in engine.batch_log[-tokens:]) == len(prompts)


async def test_a_closed_stream_leaves_at_the_next_step_and_frees_its_kv_cells(engine: LlamaCppEngine) -> None:
    prompt = engine.prepare(prompt=QUESTIONS[4], messages=None, raw=False)
    pieces = 0
    async with aclosing(engine.stream(prompt, SamplingParams(max_tokens=200))) as items:
        async for item in items:
            assert isinstance(item, Piece)
            pieces += 1
            if pieces == 3:
                break
    key = f"llama-{next(engine._ids) - 1}"
    steps_at_close = sum(key in keys for keys in engine.batch_log)
    eventually(lambda: engine.state().sequences == 0)
    # The step in flight when the stream closed may still have given it a token; no later one did.
    assert sum(key in keys for keys in engine.batch_log) <= steps_at_close + 1
    assert sum(key in keys for keys in engine.batch_log) < 10
    assert kept_cells_match(engine)  # its cells hold its prompt and the tokens fed back, for the next request


async def test_a_stop_sequence_ends_the_answer_and_frees_the_sequence(engine: LlamaCppEngine) -> None:
    prompt = engine.prepare(prompt=QUESTIONS[4], messages=None, raw=False)
    full, _ = await collect(engine.stream(prompt, SamplingParams(max_tokens=60)))
    assert ", 5," in full
    text, finished = await collect(engine.stream(prompt, SamplingParams(max_tokens=60, stop=(", 5,",))))
    assert text == full[: full.index(", 5,")]
    assert finished.finish_reason == "stop"
    eventually(lambda: engine.state().sequences == 0)
    assert kept_cells_match(engine)


async def test_a_seed_reproduces_a_sampled_answer_and_other_seeds_draw_others(engine: LlamaCppEngine) -> None:
    prompt = engine.prepare(prompt=QUESTIONS[1], messages=None, raw=False)
    seeded = SamplingParams(max_tokens=24, temperature=1.5, top_p=0.95, seed=7)
    first, _ = await collect(engine.stream(prompt, seeded))
    again, _ = await collect(engine.stream(prompt, seeded))
    assert first == again
    draws = set()
    for seed in range(4):
        text, _ = await collect(engine.stream(prompt, SamplingParams(max_tokens=24, temperature=1.5, seed=seed)))
        draws.add(text)
    assert len(draws) > 1


async def test_the_answer_ends_at_max_tokens_with_finish_reason_length(engine: LlamaCppEngine) -> None:
    prompt = engine.prepare(prompt=QUESTIONS[4], messages=None, raw=False)
    text, finished = await collect(engine.stream(prompt, SamplingParams(max_tokens=5)))
    assert isinstance(finished, Finished)
    assert finished.finish_reason == "length"
    assert finished.usage.completion_tokens == 5
    assert text


async def test_a_failed_step_fails_its_requests_and_the_next_request_starts_the_loop_again(
    engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = engine.prepare(prompt=QUESTIONS[5], messages=None, raw=False)
    expected, _ = await collect(engine.stream(prompt, SamplingParams(max_tokens=8)))
    real = engine.runner.decode

    def broken(rows: object) -> None:
        monkeypatch.setattr(engine.runner, "decode", real)
        raise RuntimeError("decode failed")

    monkeypatch.setattr(engine.runner, "decode", broken)
    with pytest.raises(EngineError, match="generation failed: RuntimeError"):
        await collect(engine.stream(prompt, SamplingParams(max_tokens=8)))
    eventually(lambda: not engine.state().running)
    text, _ = await collect(engine.stream(prompt, SamplingParams(max_tokens=8)))
    assert text == expected
    assert engine.state().running


async def test_without_reuse_a_sequence_frees_its_cells_and_nothing_is_cached(plain: LlamaCppEngine) -> None:
    prompt = plain.prepare(prompt=QUESTIONS[0], messages=None, raw=False)
    for _ in range(2):
        _, finished = await collect(plain.stream(prompt, SamplingParams(max_tokens=8)))
        assert finished.usage.cached_tokens == 0
    eventually(lambda: plain.state().sequences == 0)
    assert plain.cached(prompt) == 0
    assert all(plain.runner.last_position(seq) == -1 for seq in range(plain.runner.shape.sequences))


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def test_the_same_prompt_again_reuses_all_but_its_last_token_and_answers_the_same(
    engine: LlamaCppEngine, plain: LlamaCppEngine
) -> None:
    prompt = engine.prepare(prompt=None, messages=[ChatMessage("system", SYSTEM), ChatMessage("user", "Hi")], raw=False)
    params = SamplingParams(max_tokens=32, cache_salt="same-prompt")  # a salt of its own: no other test's tokens
    expected_text, expected = await collect(plain.stream(prompt, params))
    first_text, first = await collect(engine.stream(prompt, params))
    assert engine.cached(prompt, "same-prompt") == prompt.n_tokens
    again_text, again = await collect(engine.stream(prompt, params))
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == prompt.n_tokens - 1  # the last token is computed, for its logits
    assert first_text == again_text == expected_text
    assert without_cached(first.usage) == without_cached(again.usage) == expected.usage
    assert first.finish_reason == again.finish_reason == expected.finish_reason


async def test_a_conversations_second_turn_reuses_the_first_turn_and_its_answer(
    engine: LlamaCppEngine, plain: LlamaCppEngine
) -> None:
    params = SamplingParams(max_tokens=40, cache_salt="conversation")
    turn = [ChatMessage("system", SYSTEM), ChatMessage("user", "Can I take my bicycle on the night train?")]
    first = engine.prepare(prompt=None, messages=turn, raw=False)
    answer, finished = await collect(engine.stream(first, params))
    eventually(lambda: engine.state().sequences == 0)
    schedule = engine._schedule
    assert schedule is not None
    [kept] = [k for k in schedule.kept if k.salt == salt_hash("conversation")]
    assert kept.tokens[: first.n_tokens] == first.token_ids
    assert len(kept.tokens) == first.n_tokens + finished.usage.completion_tokens - 1
    turn += [ChatMessage("assistant", answer), ChatMessage("user", "And my dog?")]
    second = engine.prepare(prompt=None, messages=turn, raw=False)
    shared = common_prefix(kept.tokens, second.token_ids)
    assert shared > first.n_tokens  # the prompt and some of the answer
    text, reused = await collect(engine.stream(second, params))
    expected_text, expected = await collect(plain.stream(second, params))
    assert reused.usage.cached_tokens == shared
    assert text == expected_text
    assert without_cached(reused.usage) == expected.usage
    assert kept_cells_match(engine)


async def test_kept_tokens_go_only_to_requests_of_the_same_salt(engine: LlamaCppEngine) -> None:
    prompt = engine.prepare(prompt=QUESTIONS[2], messages=None, raw=False)
    await collect(engine.stream(prompt, SamplingParams(max_tokens=8, cache_salt="key:alice")))
    assert engine.cached(prompt, "key:alice") == prompt.n_tokens
    assert engine.cached(prompt, "key:bob") == 0
    _, other = await collect(engine.stream(prompt, SamplingParams(max_tokens=8, cache_salt="key:bob")))
    assert other.usage.cached_tokens == 0
    _, again = await collect(engine.stream(prompt, SamplingParams(max_tokens=8, cache_salt="key:alice")))
    assert again.usage.cached_tokens == prompt.n_tokens - 1


def test_where_llama_cpp_cannot_free_part_of_a_sequence_every_prompt_is_computed_whole(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama_cpp_or_skip()
    engine = LlamaCppEngine(settings)
    engine.load(StageClock())
    try:
        prompt = engine.prepare(prompt=QUESTIONS[5], messages=None, raw=False)
        params = SamplingParams(max_tokens=8)
        expected, _ = asyncio.run(collect(engine.stream(prompt, params)))
        monkeypatch.setattr(engine.runner, "keep", lambda seq, tokens: False)  # as for a recurrent model's memory
        with capture_logs() as logs:
            text, finished = asyncio.run(collect(engine.stream(prompt, params)))
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["llamacpp_prefix_reuse_off"]
        assert (text, finished.usage.cached_tokens) == (expected, 0)
        again, finished = asyncio.run(collect(engine.stream(prompt, params)))
        assert (again, finished.usage.cached_tokens, engine.cached(prompt)) == (expected, 0, 0)
        eventually(lambda: engine.state().sequences == 0)
        assert all(engine.runner.last_position(seq) == -1 for seq in range(engine.runner.shape.sequences))
    finally:
        asyncio.run(engine.close())
