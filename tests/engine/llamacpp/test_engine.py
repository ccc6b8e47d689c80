"""The llama.cpp engine with the real bundled model (a Q4_1 GGUF): against llama.cpp's own greedy answer, alone
against together, cancellation and stop sequences freeing the sequence, seeded sampling.

Observed through the engine's state (``state()``, ``batch_log``, llama.cpp's KV cells), never through timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing

import pytest

from tests.support.engines import collect, llama_cpp_or_skip
from tests.support.servers import eventually
from tests.support.texts import STORY
from ttft_sse.engine.base import ChatMessage, Finished, Piece, Prompt, SamplingParams
from ttft_sse.engine.llamacpp import library
from ttft_sse.engine.llamacpp.engine import LlamaCppEngine
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
    assert [f.usage for _, f in together] == [f.usage for _, f in alone]
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
    assert all(engine.runner.last_position(seq) == -1 for seq in range(engine.runner.shape.sequences))


async def test_a_stop_sequence_ends_the_answer_and_frees_the_sequence(engine: LlamaCppEngine) -> None:
    prompt = engine.prepare(prompt=QUESTIONS[4], messages=None, raw=False)
    full, _ = await collect(engine.stream(prompt, SamplingParams(max_tokens=60)))
    assert ", 5," in full
    text, finished = await collect(engine.stream(prompt, SamplingParams(max_tokens=60, stop=(", 5,",))))
    assert text == full[: full.index(", 5,")]
    assert finished.finish_reason == "stop"
    eventually(lambda: engine.state().sequences == 0)
    assert all(engine.runner.last_position(seq) == -1 for seq in range(engine.runner.shape.sequences))


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
