"""The first request after a start, behind a 1,100-token system prompt, against a 44-token prompt on the same server:
docs/performance.md's "The first request after a restart".

    python benchmarks/first_request.py [--port 8000] [--model FILE.gguf] [--store-mb 64]

starts ``ttft-sse serve`` (its defaults, the bundled model) five times, one after another: cold; with
``TTFT_WARM_PROMPTS`` (a file of the system prompt); with the warm prompt file and ``TTFT_PREFIX_STORE_MB=64``, then
stopped with SIGTERM (which writes the prefix file); the same again (the warm prompts find the restored KV); and with
the prefix store alone. Each time it measures the first request's TTFT (the system prompt and a question, streamed,
``max_tokens`` 8), the median of five 44-token prompts' and then a later request behind the same system prompt, and
prints them with the start-up stages. Every question is one no earlier start has been asked, so that a restored file
holds the system prompt a server saw but not the request measured. The prefix file (in the cache directory) is
removed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from typing_prompts import system_prompt

from ttft_sse.engine.batched.prefix_store import path_of
from ttft_sse.engine.loading.sources import bundled_gguf, model_dir
from ttft_sse.settings import Settings

SHORT = "which colour is a clear summer sky at noon?"  # 44 tokens with the chat template, as short40.jsonl's
ASKED = [
    "What should a visitor see first in this town, in a few words?",
    "Which place in this town opens earliest in the morning, briefly?",
    "Where would a traveller find fresh bread here, in one sentence?",
    "Which district keeps the oldest records, and why, in brief?",
    "What happens near the northern gate after the autumn rain?",
    "Who repairs the nets in this town, in a few plain words?",
    "Which building has a slate roof, and what is it used for?",
    "When do the bells ring, and what should a visitor do then?",
    "What does the night train carry through the valley, briefly?",
    "Where is the stone bridge, and what stands beside it, please?",
]
"""Questions behind the system prompt, about as long as one another (11-15 tokens), two for each start."""


def first_token_ms(client: httpx.Client, body: dict[str, Any]) -> tuple[float, int]:
    """A streamed request's TTFT as the client sees it, and its ``cached_tokens``. The client's connection is open
    already, as a page's is: making an ``httpx.Client`` alone takes 35-75 ms (its TLS context), which is not the
    server's time."""
    started, first, cached, event = time.perf_counter(), 0.0, -1, ""
    with client.stream("POST", "/stream", json={**body, "max_tokens": 8}) as reply:
        for line in reply.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "token" and not first:
                first = (time.perf_counter() - started) * 1000
            elif line.startswith("data:") and event == "done":
                cached = json.loads(line[5:])["usage"]["cached_tokens"]
    return first, cached


def start(port: int, settings: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTFT_")} | {"TTFT_LOG_FORMAT": "json", **settings}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ttft_sse", "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            if ready.status_code == 200:
                return proc, ready.json().get("startup", {})
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the bundled model)")
    parser.add_argument("--store-mb", type=int, default=64, help="TTFT_PREFIX_STORE_MB (default 64)")
    args = parser.parse_args()
    gguf = args.model.resolve() if args.model else bundled_gguf()
    cache_dir = Settings.from_env().cache_dir
    tokenizer = Tokenizer.from_file(str(model_dir(gguf, cache_dir) / "tokenizer.json"))
    system = system_prompt(4242, tokenizer)

    def long(n: int) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": ASKED[n]}]}

    tmp = Path(tempfile.mkdtemp(prefix="first-request-"))
    warm = tmp / "warm.jsonl"
    warm.write_text(json.dumps({"messages": [{"role": "system", "content": system}]}) + "\n")
    store = {"TTFT_PREFIX_STORE_MB": str(args.store_mb)}
    model = {"TTFT_MODEL": str(gguf)} if args.model else {}
    runs = [
        ("cold", model, signal.SIGKILL),
        ("warm prompt file", {**model, "TTFT_WARM_PROMPTS": str(warm)}, signal.SIGKILL),
        ("warm prompt file, store on (writes)", {**model, "TTFT_WARM_PROMPTS": str(warm), **store}, signal.SIGTERM),
        ("warm prompt file + restored KV", {**model, "TTFT_WARM_PROMPTS": str(warm), **store}, signal.SIGKILL),
        ("restored KV alone", {**model, **store}, signal.SIGKILL),
    ]
    prefixes = path_of(cache_dir, str(gguf))
    prefixes.unlink(missing_ok=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for n, (name, settings, stop) in enumerate(runs):
            proc, startup = start(args.port, settings, tmp / f"{name.replace(' ', '-')}.log")
            try:
                with httpx.Client(base_url=base, timeout=300) as client:
                    client.get("/readyz").raise_for_status()  # the connection the requests reuse
                    first, cached = first_token_ms(client, long(2 * n))
                    short = [first_token_ms(client, {"prompt": f"{n * 5 + i} {SHORT}"})[0] for i in range(5)]
                    later, later_cached = first_token_ms(client, long(2 * n + 1))
                median = statistics.median(short)
            finally:
                os.killpg(proc.pid, stop)
                proc.wait(120)
            stages = {k.removesuffix("_ms"): round(v) for k, v in startup.items() if k.endswith("_ms")}
            print(
                f"{name}: first request {first:.0f} ms ({cached} cached), 44-token prompt {median:.0f} ms, "
                f"{first / median:.1f}x; a later request behind the system prompt {later:.0f} ms ({later_cached} "
                f"cached); load {os.getloadavg()[0]:.1f}; start-up ms {stages}",
                flush=True,
            )
    finally:
        prefixes.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
