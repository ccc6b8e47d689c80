"""On a CUDA machine: the server on the GPU, each transformers engine in turn, checked end to end and measured.

    python benchmarks/cuda.py                          # a random-weight model of the bundled model's shape
    python benchmarks/cuda.py --model DIR              # a transformers model folder of your own
    python benchmarks/cuda.py --shape-of DIR           # random weights with DIR's config.json and tokenizer

For each engine (batched, single) it starts ``ttft-sse serve`` with ``TTFT_DEVICE=cuda``, prints ``/readyz`` (the
device, dtype and start-up stages), sends one request to ``/stream``, ``/complete`` and ``/v1/chat/completions``
and checks each answers with tokens, then runs ``ttft-sse bench`` at concurrency 1 and 8 and prints its table. Random
weights give the model's real cost per token, not its text (an answer is ``--max-tokens`` long, but for the rare
end-of-sequence token): the figures are the serving path's speed on this GPU, not an answer's quality.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from serve import ROOT, serving

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def bundled_folder() -> Path:
    """The bundled model's cache folder (its config and tokenizer), as ``ttft-sse prepare`` writes it."""
    sys.path.insert(0, str(ROOT))
    from ttft_sse.engine.loading import sources
    from ttft_sse.settings import Settings

    return sources.model_dir(sources.bundled_gguf(), Path(Settings.from_env().cache_dir))


def random_model(shape_of: Path, target: Path) -> Path:
    """A model with ``shape_of``'s config and tokenizer and random weights (seed 0), saved at ``target``."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(shape_of)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (shape_of / name).is_file():
            shutil.copy(shape_of / name, target)
    return target


def check_endpoints(base: str) -> dict[str, Any]:
    """One request to each generating endpoint; each must answer 200 with generated tokens."""
    got: dict[str, Any] = {}
    with httpx.Client(timeout=120) as client:
        complete = client.post(f"{base}/complete", json={"prompt": "The capital of France is", "max_tokens": 8})
        assert complete.status_code == 200, complete.text
        got["complete"] = complete.json()["usage"]
        with client.stream("POST", f"{base}/stream", json={"prompt": "Hello", "max_tokens": 8}) as response:
            assert response.status_code == 200, response.read()
            events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
        assert "token" in events and events[-1] == "done", events
        got["stream_events"] = len(events)
        chat = client.post(
            f"{base}/v1/chat/completions",
            json={"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )
        assert chat.status_code == 200, chat.text
        got["chat"] = chat.json()["usage"]
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a transformers model folder (default: random weights)")
    parser.add_argument("--shape-of", type=Path, help="config and tokenizer for the random weights (default: bundled)")
    parser.add_argument("--engines", default="batched,single")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu: this script's own smoke test)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/cuda"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ttft-cuda-") as scratch:
        model = args.model or random_model(args.shape_of or bundled_folder(), Path(scratch) / "model")
        for engine in args.engines.split(","):
            env = {"TTFT_MODEL": str(model), "TTFT_DEVICE": args.device, "TTFT_ENGINE": engine}
            with serving(env) as base:
                ready = httpx.get(f"{base}/readyz").json()
                print(f"== {engine}: /readyz", json.dumps(ready, sort_keys=True), flush=True)
                print(f"== {engine}: endpoints", json.dumps(check_endpoints(base)), flush=True)
                command = [
                    sys.executable, "-m", "ttft_sse", "bench", "--url", base, "--concurrency", "1,8",
                    "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                    "--no-charts", "--out", str(args.out / engine),
                ]  # fmt: skip
                subprocess.run(command, cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
