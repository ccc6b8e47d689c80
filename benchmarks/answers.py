"""Greedy answers of several servers to the same prompts: which agree, and for how many tokens (issue 8).

    python benchmarks/answers.py --url fp32=http://127.0.0.1:8201 --url int8=http://127.0.0.1:8202 \\
        --url llama=http://127.0.0.1:8104

Each question (benchmarks/chat-questions.txt and a few more) is rendered once with the bundled model's chat template
and sent as that text to every server's ``/v1/completions`` (temperature 0, ``--max-tokens``), so every server sees
the same prompt whatever its own template handling. Prints, for every pair of servers, how many answers are the
same text, and how many first tokens they share (mean and median, by the bundled tokenizer): two arithmetics of
one model agree until a near-tie between two tokens falls the other way, and from there their texts part.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.engine_speed import QUESTIONS  # noqa: E402
from ttft_sse.bench import prompts  # noqa: E402
from ttft_sse.engine.models import bundled_gguf  # noqa: E402

MORE = [
    "Who wrote Romeo and Juliet?",
    "What is 12 times 7?",
    "Name three planets.",
    "How do I boil an egg?",
    "What is the largest ocean on Earth?",
    "Give me a tip for learning a new language.",
    "What does a bee do?",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is a noun?",
]
"""Short questions beside the file's and engine_speed.py's."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", action="append", required=True, help="NAME=URL of an OpenAI-style server; 2 or more")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    servers = dict(item.split("=", 1) for item in args.url)
    if len(servers) < 2:
        raise SystemExit("give two --url NAME=URL or more")

    from transformers import AutoTokenizer

    gguf = bundled_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    questions = [p.messages[-1]["content"] for p in prompts.load(ROOT / "benchmarks" / "chat-questions.txt")]
    questions += [q for q in dict.fromkeys([*MORE, *QUESTIONS]) if q not in questions]

    answers: dict[str, list[str]] = {name: [] for name in servers}
    with httpx.Client(timeout=300) as client:
        for question in questions:
            messages = [{"role": "user", "content": question}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            for name, url in servers.items():
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                response = client.post(url.rstrip("/") + "/v1/completions", json=body)
                response.raise_for_status()
                answers[name].append(response.json()["choices"][0]["text"])

    def shared(a: str, b: str) -> int:
        count = 0
        ours, theirs = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
        for x, y in zip(ours, theirs, strict=False):
            if x != y:
                break
            count += 1
        return count

    print(f"{len(questions)} questions, greedy, max_tokens {args.max_tokens}")
    print("| servers | same text | first tokens shared: mean / median |")
    print("|---|---|---|")
    for a, b in itertools.combinations(servers, 2):
        pairs = list(zip(answers[a], answers[b], strict=True))
        same = sum(x == y for x, y in pairs)
        common = [shared(x, y) for x, y in pairs]
        mean, median = statistics.mean(common), statistics.median(common)
        print(f"| {a} / {b} | {same}/{len(questions)} | {mean:.1f} / {median:.0f} |")
    first = questions[0]
    print(f"\n{first!r}:")
    for name in servers:
        print(f"  {name}: {answers[name][0][:120]!r}")


if __name__ == "__main__":
    main()
