"""The same GGUF's logits from transformers' fp32 model (what ttft-sse's engines answer, tests/engine) and from
llama.cpp (llama-cpp-python, the ``llamacpp`` extra), token for token on the same ids.

    python benchmarks/logits_against_llama_cpp.py ~/.cache/ttft-sse/bench-models/gemma3-270m/gemma3-270m.Q4_K_M.gguf
    python benchmarks/logits_against_llama_cpp.py FILE.gguf --prompt "..." --tokens 16

For the first, middle and last position of the prompt it prints the correlation of the two logit vectors, their
largest difference, and each side's top three tokens with their logits; then each side's greedy continuation. Where
the two disagree on a greedy token, the top logits tell whether it is a near tie (llama.cpp multiplies with int8
activations, which move a logit by a few hundredths) or a different model (a low correlation). transformers' side
is its own GGUF loading (every tensor dequantised to fp32: the model ttft-sse's engines answer as, without the
memory they spare), so a small model's file is what this is for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttft_sse.engine.loading import sources
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

PROMPT = "The capital of France is a city where many people live and work every day, and"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens each side generates")
    args = parser.parse_args()
    import llama_cpp
    import torch
    import transformers

    folder = sources.materialize(sources.resolve(str(args.gguf)), Path(Settings.from_env().cache_dir), StageClock())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32, use_kernels=False
    )
    ids = tokenizer(args.prompt)["input_ids"]
    size = len(ids) + args.tokens + 8
    llm = llama_cpp.Llama(
        str(args.gguf), n_ctx=size, n_batch=size, n_ubatch=size, logits_all=True, n_threads=2, verbose=False
    )
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    with torch.no_grad():
        ours = model.eval()(torch.tensor([ids])).logits[0].numpy()
    print(f"{args.gguf.name}: {len(ids)} prompt tokens")
    for position in sorted({0, len(ids) // 2, len(ids) - 1}):
        a, b = ours[position], theirs[position]
        top_a, top_b = np.argsort(-a)[:3], np.argsort(-b)[:3]
        print(
            f"position {position}: correlation {np.corrcoef(a, b)[0, 1]:.5f}, largest difference "
            f"{np.abs(a - b).max():.4f} (logits' spread {a.std():.4f}); transformers top {top_a.tolist()} "
            f"{' '.join(f'{v:.4f}' for v in a[top_a])}, llama.cpp top {top_b.tolist()} "
            f"{' '.join(f'{v:.4f}' for v in b[top_b])}"
        )
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)[0][len(ids) :]
    llm.reset()
    theirs_greedy: list[int] = []
    for token in llm.generate(ids, temp=0.0, top_k=1):
        theirs_greedy.append(token)
        if len(theirs_greedy) == args.tokens:
            break
    print("transformers greedy:", greedy.tolist())
    print("llama.cpp greedy:   ", theirs_greedy)


if __name__ == "__main__":
    main()
