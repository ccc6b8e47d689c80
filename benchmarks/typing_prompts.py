"""The prompt files behind docs/performance.md's "The first token while the user types".

    python benchmarks/typing_prompts.py OUT_DIR --tokenizer path/to/tokenizer.json

writes ``typed.jsonl`` and ``untyped.jsonl`` (6 conversations each: a system prompt of 1,100 tokens or a little more,
unique to the conversation — its sentences name the conversation's number — and a question of 61 to 64 characters) and
``short40.jsonl`` (6 one-line questions, 44 tokens each with the bundled model's chat template). No two conversations
of the three files share a system prompt, so that no run finds another's prompts in the server's cache. The
tokenizer is the bundled model's ``tokenizer.json`` (ttft-sse keeps it under ``~/.cache/ttft-sse/models/``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer

SUBJECTS = ["The harbour", "Our library", "The old mill", "A quiet orchard", "The night train", "The river"]
SUBJECTS += ["A mountain inn", "The market"]
VERBS = ["opens at dawn", "keeps its records", "welcomes travellers", "stores grain", "lights its lamps"]
VERBS += ["counts the boats", "sells fresh bread", "repairs the nets"]
TAILS = ["near the northern gate", "in every season", "under a slate roof", "beside the stone bridge"]
TAILS += ["for the whole valley", "after the autumn rain", "with careful hands", "before the bells ring"]
QUESTIONS = [
    "What should a visitor see first in this town, in a few words?",
    "Which place in this town opens earliest in the morning, briefly?",
]


def system_prompt(number: int, tokenizer: Tokenizer, tokens: int = 1100) -> str:
    """Varied sentences naming conversation ``number``, until the text holds ``tokens`` tokens."""
    out, k = [f"Context document {number}."], 0
    while len(tokenizer.encode(" ".join(out)).ids) < tokens:
        n = len(SUBJECTS)
        out.append(f"{SUBJECTS[(k + number) % n]} of district {number}-{k} {VERBS[(k * 3 + number) % n]} ")
        out[-1] += f"{TAILS[(k * 5 + number) % n]}."
        k += 1
    return " ".join(out)


def conversations(first: int, tokenizer: Tokenizer) -> list[dict[str, object]]:
    return [
        {
            "name": f"long-{i}",
            "messages": [
                {"role": "system", "content": system_prompt(i, tokenizer)},
                {"role": "user", "content": QUESTIONS[i % 2]},
            ],
        }
        for i in range(first, first + 6)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    args.out.mkdir(parents=True, exist_ok=True)
    short = [
        {"name": f"short-{i}", "prompt": f"Request {i}: which colour is a clear summer sky at noon?"} for i in range(6)
    ]
    for name, items in [
        ("typed", conversations(0, tokenizer)),
        ("untyped", conversations(100, tokenizer)),
        ("short40", short),
    ]:
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")


if __name__ == "__main__":
    main()
