"""On a CUDA machine only: CUDA memory and GPU utilisation on ``/metrics``, and the allocator-cache janitor.

Skipped where torch sees no GPU (CI has none). The stand-in model is a tiny random Llama with the bundled model's
tokenizer: what is checked is the plumbing (SingleEngine on CUDA, GpuProbe, CacheJanitor), not the text. On a GPU
machine without the bundled model, ``CUDA_TEST_TOKENIZER_DIR`` names a folder holding its tokenizer files instead.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.paths import CACHE_DIR
from tests.support.scrape import scrape
from tests.support.servers import eventually, running
from ttft_sse.app import create_app
from ttft_sse.engine.loading import sources
from ttft_sse.settings import Settings

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EVERY = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    given = os.environ.get("CUDA_TEST_TOKENIZER_DIR")
    tokenizer_dir = Path(given) if given else sources.model_dir(sources.bundled_gguf(), CACHE_DIR)
    target = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target)
    return target


@pytest.fixture(scope="module", params=["batched", "single"])
def cuda_server(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, object]]:
    settings = Settings(
        model=str(tiny_model), engine=request.param, device="cuda", threads=1, cuda_empty_cache_every=EVERY
    )
    app = create_app(settings)
    with running(app) as base:
        yield base, app.state.runtime.engine


def test_cuda_memory_and_gpu_utilisation_are_exported(cuda_server: tuple[str, object]) -> None:
    base, _ = cuda_server
    with httpx.Client() as client:
        got = scrape(client, base)
    allocated = got.value("ttft_sse_cuda_memory_allocated_bytes", device="cuda:0")
    reserved = got.value("ttft_sse_cuda_memory_reserved_bytes", device="cuda:0")
    assert 0 < allocated <= reserved
    if importlib.util.find_spec("pynvml") is None:
        assert got.matching("ttft_sse_gpu_utilization_ratio") == {}
    else:
        assert 0 <= got.value("ttft_sse_gpu_utilization_ratio", device="cuda:0") <= 1


def generate(client: httpx.Client, base: str, janitor: Any, **body: Any) -> None:
    """One /complete, then wait for the worker thread to count it (that happens after the answer went out)."""
    before = janitor.generations
    response = client.post(f"{base}/complete", json={"max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 30
    while janitor.generations == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_allocator_cache_is_emptied_every_n_generations(cuda_server: tuple[str, object]) -> None:
    base, engine = cuda_server
    janitor = engine.janitor  # type: ignore[attr-defined]
    assert janitor.every == EVERY
    with httpx.Client(timeout=120) as client:
        while janitor.generations % EVERY != EVERY - 2:  # so that the long one is not the Nth
            generate(client, base, janitor, prompt="hi")
        emptied = janitor.emptied
        # A long prompt's activations leave the cache holding far more than the weights.
        generate(client, base, janitor, prompt="word " * 6000, raw=True)
        grown = torch.cuda.memory_reserved(0)
        assert janitor.emptied == emptied
        generate(client, base, janitor, prompt="hi")  # the Nth: the cache is emptied after it
    eventually(lambda: janitor.emptied == emptied + 1)  # the batched engine empties in a worker thread
    assert janitor.emptied == janitor.generations // EVERY
    assert torch.cuda.memory_reserved(0) < grown
