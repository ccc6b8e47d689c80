"""A GGUF model read from its file in place (engine/loading/assembly.py): every engine's greedy answers are the ones
they gave when the file was first expanded to an fp32 copy (tests/data/gguf-answers.json, written by the code before),
through the engines and through the server's surfaces; no weight is expanded, and the cache keeps no fp32 copy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ggufs
from tests.support.caches import Caches
from tests.support.engines import collect, llama_cpp_or_skip, prompt_of
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.loading import sources
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

torch = pytest.importorskip("torch")

ANSWERS = json.loads((Path(__file__).parents[2] / "data" / "gguf-answers.json").read_text())
QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "hello")
SYSTEMS = (None, "You are brief.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two tiny Q4_K_M Llamas the answers were recorded on (seeded: the same bytes every time)."""
    root = tmp_path_factory.mktemp("tiny-ggufs")
    bundled = sources.bundled_gguf()
    return {
        name: ggufs.write_llama(root / f"{name}.gguf", tokenizer_from=bundled, tied=tied, seed=7)
        for name, tied in (("tiny-llama", False), ("tiny-llama-tied", True))
    }


def engine_of(kind: str, settings: Settings) -> Any:
    if kind == "single":
        from ttft_sse.engine.single import SingleEngine

        return SingleEngine(settings)
    if kind == "batched":
        from ttft_sse.engine.batched.engine import BatchedEngine

        return BatchedEngine(settings)
    llama_cpp_or_skip()
    from ttft_sse.engine.llamacpp.engine import LlamaCppEngine

    return LlamaCppEngine(settings)


@pytest.mark.parametrize(
    ("kind", "model"),
    [("single", "tiny-llama"), ("single", "tiny-llama-tied"), ("batched", "tiny-llama"), ("llamacpp", "tiny-llama")],
)
async def test_each_engine_gives_the_answers_it_gave_before_the_file_was_read_in_place(
    settings: Settings, tmp_path: Path, tiny: dict[str, Path], kind: str, model: str, fresh_cache: Caches
) -> None:
    engine = engine_of(kind, replace(settings, model=str(tiny[model]), cache_dir=fresh_cache(tmp_path, tiny[model])))
    engine.load(StageClock())
    try:
        got = {}
        for question in QUESTIONS:
            for system in SYSTEMS:
                text, _ = await collect(engine.stream(prompt_of(engine, question, system), SamplingParams(24)))
                got[f"{system}|{question}"] = text
    finally:
        await engine.close() if hasattr(engine, "close") else None
    assert got == ANSWERS["llamacpp" if kind == "llamacpp" else "transformers"][model]
    folder = sources.model_dir(tiny[model], tmp_path)
    assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.npz"))  # no fp32 copy, no codes


def test_the_server_surfaces_give_the_bundled_model_its_answers(hf_server: str) -> None:
    """/stream, /complete and /v1/chat/completions, each the answer recorded before."""
    want = ANSWERS["transformers"]["bundled"]
    with httpx.Client(base_url=hf_server, timeout=60) as client:
        for question in QUESTIONS:
            messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": question}]
            expected = want[f"You are brief.|{question}"]
            body = {"messages": messages, "max_tokens": 24, "temperature": 0}
            assert client.post("/complete", json=body).json()["text"] == expected
            chat = client.post("/v1/chat/completions", json={**body, "model": "any"}).json()
            assert chat["choices"][0]["message"]["content"] == expected
            streamed = []
            with client.stream("POST", "/stream", json=body) as response:
                event = None
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:") and event == "token":
                        streamed.append(json.loads(line[5:])["text"])
            assert "".join(streamed) == expected


def test_readyz_reports_the_weights_the_kv_cache_and_the_load_s_peak(hf_server: str) -> None:
    memory = httpx.get(f"{hf_server}/readyz", timeout=30).json()["memory"]
    assert memory["kv_cache_tokens"] == 8192
    # SmolLM2's KV cache: 30 layers, 3 KV heads of 64, keys and values in fp32 (TTFT_KV_DTYPE=auto, a small file)
    assert memory["kv_cache_bytes"] == 8192 * 30 * 2 * 3 * 64 * 4
    assert memory["kv_cache_dtype"] == "float32"
    # the kernel's arrays (105 MB, the tied LM head's own codes of the Q8_0 table among them) and the embedding's
    # rows read from the file (that table: 30 MB): the file's 98 MB, and its table twice
    size = sources.bundled_gguf().stat().st_size
    assert 1.3 * size < memory["weights_bytes"] < 1.5 * size
    assert memory["load_peak_rss_bytes"] > memory["weights_bytes"]


@pytest.fixture
def unassembled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from ttft_sse.engine.loading import assembly

    monkeypatch.setattr(assembly, "PROCESSORS", frozenset())  # no processor is known: transformers loads the file
    yield


@pytest.mark.usefixtures("unassembled")
def test_a_file_whose_changes_are_not_reproduced_is_loaded_by_transformers_and_the_log_says_why(
    settings: Settings, tmp_path: Path, tiny: dict[str, Path], fresh_cache: Caches
) -> None:
    from structlog.testing import capture_logs

    from ttft_sse.engine.single import SingleEngine

    cache_dir = fresh_cache(tmp_path, tiny["tiny-llama"])
    engine = SingleEngine(replace(settings, model=str(tiny["tiny-llama"]), cache_dir=cache_dir))
    with capture_logs() as logs:
        engine.load(StageClock())
    reason = "transformers' LlamaTensorProcessor for llama splits or joins tensors"
    assert {"event": "gguf_loaded_by_transformers", "log_level": "warning", "reason": reason} in logs
    assert engine.info.weights_by_type == {} and not engine.info.weights.startswith("gguf-blocks")  # no kernel
