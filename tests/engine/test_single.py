"""The transformers engine with the real bundled model (loaded once for this module)."""

from __future__ import annotations

import dataclasses
import threading
from contextlib import aclosing
from typing import Any

import pytest
from structlog.testing import capture_logs

from ttft_sse.engine.base import Finished, Piece, SamplingParams
from ttft_sse.engine.single import SingleEngine
from ttft_sse.errors import EngineError, PromptTooLong
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(settings: Settings) -> SingleEngine:
    engine = SingleEngine(settings)
    clock = StageClock()
    engine.load(clock)
    assert {"imports_ms", "tokenizer_ms", "model_ms"} <= set(clock.as_dict())
    return engine


async def run(engine: SingleEngine, params: SamplingParams, prompt: str = QUESTION) -> tuple[list[Piece], Finished]:
    prepared = engine.prepare(prompt=prompt, messages=None, raw=False)
    pieces: list[Piece] = []
    finished: list[Finished] = []
    async for item in engine.stream(prepared, params):
        (pieces if isinstance(item, Piece) else finished).append(item)  # type: ignore[arg-type]
    assert len(finished) == 1
    return pieces, finished[0]


def test_model_info(engine: SingleEngine) -> None:
    info = engine.info
    assert (info.name, info.device, info.dtype, info.threads) == ("SmolLM2-135M-Instruct", "cpu", "float32", 1)
    assert info.context_length == 8192
    assert info.weights == "gguf-blocks"  # every linear layer on the block kernel (tests/engine/kernels/test_kernel.py)
    assert info.weights_by_type == {"Q4_1": "blocks: 210", "Q8_0": "blocks: 1"}


def test_without_the_block_kernel_linear_weights_are_stored_transposed_and_packed(settings: Settings) -> None:
    import torch

    from ttft_sse.engine.kernels.weights import packed_linear_class

    engine = SingleEngine(dataclasses.replace(settings, gguf_kernel=False))
    engine.load(StageClock())
    assert engine.info.weights == "column-major+packed"
    assert engine.info.weights_by_type == {}  # the block kernel was not tried
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 30 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    for linear in linears:
        out_features, in_features = linear.weight.shape
        assert (out_features, in_features) == (linear.out_features, linear.in_features)
        assert linear.weight.stride() == (1, out_features)  # column-major: weight.T is contiguous
        assert type(linear) is packed_linear_class() and linear.packed_weight.is_mkldnn  # and pre-packed
    # The LM head holds the table in fp32; the embedding reads its rows from the file (Q8_0), the same values.
    embedding = model.get_input_embeddings()
    assert type(embedding).__name__ == "FileRowsEmbedding" and embedding.weight.numel() == 0
    ids = torch.tensor([[0, 5, 49151]])
    assert torch.equal(embedding(ids)[0], model.lm_head.weight[ids[0]])


def test_prompt_goes_through_the_chat_template_unless_raw(engine: SingleEngine) -> None:
    chat = engine.prepare(prompt=QUESTION, messages=None, raw=False)
    assert chat.text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert chat.n_tokens == 37
    raw = engine.prepare(prompt=QUESTION, messages=None, raw=True)
    assert raw.text == QUESTION and raw.n_tokens < chat.n_tokens


async def test_greedy_answer_and_usage(engine: SingleEngine) -> None:
    pieces, finished = await run(engine, SamplingParams(max_tokens=32))
    assert "".join(p.text for p in pieces) == "The capital of France is Paris."
    assert [p.index for p in pieces] == list(range(len(pieces)))
    assert all(p.text for p in pieces)
    assert finished.finish_reason == "stop"
    # 7 text tokens and the end-of-turn token that stopped generation.
    assert finished.usage.prompt_tokens == 37 and finished.usage.completion_tokens == 8
    assert finished.timings["prefill_ms"] > 0


async def test_max_tokens_gives_length(engine: SingleEngine) -> None:
    pieces, finished = await run(engine, SamplingParams(max_tokens=3))
    assert "".join(p.text for p in pieces) == "The capital of"
    assert (finished.finish_reason, finished.usage.completion_tokens) == ("length", 3)


async def test_stop_sequence_ends_generation_and_is_not_returned(engine: SingleEngine) -> None:
    pieces, finished = await run(engine, SamplingParams(max_tokens=32, stop=(" is",)))
    assert "".join(p.text for p in pieces) == "The capital of France"
    assert finished.finish_reason == "stop"
    # Generation stopped on the token that completed the stop text: no further forward pass ran.
    assert finished.usage.completion_tokens == 5


async def test_seeded_sampling_is_reproducible_and_differs_across_seeds(engine: SingleEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=7)
    a, _ = await run(engine, params, "Write a word.")
    b, _ = await run(engine, params, "Write a word.")
    assert [p.text for p in a] == [p.text for p in b]
    texts = set()
    for seed in range(4):
        pieces, _ = await run(engine, SamplingParams(max_tokens=12, temperature=1.0, seed=seed), "Write a word.")
        texts.add("".join(p.text for p in pieces))
    assert len(texts) > 1


def test_prompt_longer_than_the_context_is_refused(engine: SingleEngine) -> None:
    with pytest.raises(PromptTooLong, match=r"the prompt is \d+ tokens; the model's context is 8192"):
        engine.prepare(prompt="word " * 9000, messages=None, raw=False)


async def test_closing_the_stream_stops_generation_within_one_step(engine: SingleEngine) -> None:
    # Greedy, the model writes this story to the limit (200 tokens): only the consumer leaving can end it early.
    prepared = engine.prepare(prompt="Write a long story about a dragon who learns to fly.", messages=None, raw=False)
    with capture_logs() as logs:
        async with aclosing(engine.stream(prepared, SamplingParams(max_tokens=200))) as items:
            async for item in items:
                assert isinstance(item, Piece)
                if item.index == 2:
                    break
    assert engine.active == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("ttft-gen")]
    cancelled = [e for e in logs if e["event"] == "generation_cancelled"]
    assert len(cancelled) == 1
    # Three pieces were consumed when the consumer left; the thread may have decoded more while the cancel
    # crossed over (it counts what it decoded, and on a loaded machine the consumer can lag), but it stopped long
    # before max_tokens.
    assert 3 <= cancelled[0]["completion_tokens"] < 100


async def test_a_failure_inside_generate_reaches_the_consumer_as_engine_error(engine: SingleEngine) -> None:
    calls = {"n": 0}

    def explode(module: Any, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # prefill, one decode step, then the third forward pass fails
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    handle = engine.model.register_forward_hook(explode)
    prepared = engine.prepare(prompt=QUESTION, messages=None, raw=False)
    got: list[str] = []
    try:
        with pytest.raises(EngineError, match="generation failed: RuntimeError") as info:
            async for item in engine.stream(prepared, SamplingParams(max_tokens=32)):
                assert isinstance(item, Piece)
                got.append(item.text)
    finally:
        handle.remove()
    assert got == ["The", " capital"]
    assert "illegal memory" not in info.value.message  # internals stay in the log, not in the client's error
    assert engine.active == 0
