"""ttft-sse against llama.cpp's llama-server on any GGUF files: one server loaded at a time, the same requests.

    LLAMA_DIR=/path/to/build/cache python benchmarks/against_llama_server.py bundled qwen2.5-0.5b qwen3-0.6b
    python benchmarks/against_llama_server.py path/to/model.gguf --requests 64 --rounds 2

A model is a ``.gguf`` path, ``bundled`` (the SmolLM2 the package ships), or a family of ``benchmarks/family_models.py``
(its Q4_K_M file, built on first use). For each model and round, each server in turn — ttft-sse first in odd rounds,
llama-server first in even ones, so that a change in the machine's load hits both alike — is started with 8 slots
(llama-server ``-np 8 -c 8192``; ttft-sse's ``max_concurrency`` 8 and ``kv_cache_tokens`` 8192: ``--slots``,
``--kv-tokens``) on the machine's cores (llama-server ``-t``
the cores, or ``--llama-threads``; ttft-sse its defaults, torch on half the cores and the block kernel's helper on
the other, or ``--ours-threads``), measured with ``ttft-sse bench`` at c=1 then c=8 (new conversations from
``benchmarks/chat-questions.txt``, ``--max-tokens`` each, greedy, streamed through ``/v1/chat/completions``), and
stopped before the next one starts. ``--int8`` adds a third server, ttft-sse with int8 rows
(``TTFT_GGUF_ACTIVATIONS=int8``: llama.cpp's arithmetic for the rows, where the default keeps the fp32 model's), each
of its rows in the table beside llama-server's.

Answers are the same length on both: request *i* asks for the same ``max_tokens`` from each, and llama-server gets
``ignore_eos: true`` so that it generates all of them. ttft-sse has no ``ignore_eos`` (it refuses the field); its
answers end early only if the model says its end-of-turn token, which random weights rarely do: the ``short`` column
counts answers shorter than asked, for each server.

It prints one row per model and concurrency: tokens/s (all requests' tokens over the time the level ran, the mean over
rounds), TTFT p50/p99 (every request of every round), the ratios ttft-sse / llama-server, and the request counts
that failed; then each server's time from its process's start to ready and its process tree's peak resident memory
(sampled from /proc every 0.1 s, from start to stop). Then, for each model, what ttft-sse logged about its weights
(``weights_blocks``: the kernel's layout for each GGUF type) and decoder layers (``decoder_fused`` /
``decoder_not_fused``). results.json of each run, the servers' logs and ``table.md`` go under ``--out``.
llama-server is the one ``benchmarks/against_llama_server.sh`` builds (in ``LLAMA_DIR``; it builds it on the first
run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import family_models as families  # noqa: E402  (benchmarks/family_models.py, beside this file)
from serve import free_port  # noqa: E402  (benchmarks/serve.py)

from ttft_sse.bench.stats import percentile  # noqa: E402

SERVERS = ("ttft-sse", "llama-server")
INT8 = "ttft-sse int8"
"""ttft-sse with TTFT_GGUF_ACTIVATIONS=int8 (``--int8``)."""
LOGGED = ("weights_blocks", "weights_not_blocks", "decoder_fused", "decoder_not_fused", "attention_not_paged")


@dataclass
class Measured:
    """One model and server over every round: each round's tokens/s per level, and every request's record."""

    rates: dict[int, list[float]] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)  # process start to ready, each round
    peak_rss: list[int] = field(default_factory=list)  # the server's process tree at its most resident, each round

    def add(self, document: dict[str, Any]) -> None:
        self.ready_s.append(document["ready_s"])
        self.peak_rss.append(document["peak_rss_bytes"])
        for row in document["summary"]:
            if row["tokens_per_s"] is not None:
                self.rates.setdefault(row["concurrency"], []).append(row["tokens_per_s"])
        self.records += document["records"]

    def level(self, concurrency: int) -> dict[str, Any]:
        records = [r for r in self.records if r["concurrency"] == concurrency]
        ok = [r for r in records if r["outcome"] == "ok"]
        ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
        rates = self.rates.get(concurrency, [])
        return {
            "tokens_per_s": sum(rates) / len(rates) if rates else None,
            "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
            "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
            "errors": len(records) - len(ok),
            "short": sum(1 for r in ok if r["tokens"] < r["max_tokens"]),
            "requests": len(records),
        }


def model_path(spec: str) -> Path:
    if spec == "bundled":
        from ttft_sse.engine.loading.sources import bundled_gguf

        return bundled_gguf()
    if spec in families.BY_NAME:
        tree = families.llama_cpp_tree()
        return families.build(families.BY_NAME[spec], families.default_out(), tree, keep=False, tokenizer=[])
    path = Path(spec).expanduser()
    if not path.is_file() or path.suffix != ".gguf":
        raise SystemExit(f"{spec}: not a .gguf file, 'bundled', or one of {', '.join(families.BY_NAME)}")
    return path.resolve()


def llama_server() -> Path:
    """llama-server, built by benchmarks/against_llama_server.sh on its first run."""
    script = ROOT / "benchmarks" / "against_llama_server.sh"
    done = subprocess.run(["bash", str(script), "--print-server"], capture_output=True, text=True, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"{script} --print-server failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def start(
    server: str, gguf: Path, args: argparse.Namespace, port: int, log: Path, binary: Path
) -> subprocess.Popen[bytes]:
    if server != "llama-server":
        cmd = [sys.executable, "-m", "ttft_sse", "serve", "--port", str(port), "--model", str(gguf)]
        cmd += ["--threads", str(args.ours_threads)] if args.ours_threads else []
        env = {**os.environ, "TTFT_LOG_LEVEL": "info", "TTFT_MAX_CONCURRENCY": str(args.slots)}
        env["TTFT_KV_CACHE_TOKENS"] = str(args.kv_tokens)
        if server == INT8:
            env["TTFT_GGUF_ACTIVATIONS"] = "int8"
    else:
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.llama_threads)]
        cmd += ["-np", str(args.slots), "-c", str(args.kv_tokens)]
        env = dict(os.environ)
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


class TreeMemory:
    """The most a process tree (the server's session: llama-server, or ttft-sse and any process it starts) holds
    resident, summed over its processes, sampled every 0.1 s from /proc while it runs."""

    def __init__(self, session: int) -> None:
        import threading

        self.session, self.peak, self._stop = session, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.1):
            total = 0
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    if os.getsid(int(entry.name)) != self.session:
                        continue
                    total += int((entry / "statm").read_text().split()[1]) * page
                except (OSError, ValueError, IndexError):
                    continue
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    """Until the server answers ready; the first start of ttft-sse on a GGUF converts it (minutes for 1B)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-20:]
            raise SystemExit(f"the server exited with {proc.returncode}; the end of {log}:\n" + "\n".join(tail))
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not ready in {timeout:g} s; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(server: str, gguf: Path, args: argparse.Namespace, binary: Path, run_dir: Path) -> dict[str, Any]:
    """Start ``server`` on ``gguf``, run the bench against it, stop it; results.json as a dict."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = run_dir / "server.log"
    started = time.monotonic()
    proc = start(server, gguf, args, port, log, binary)
    memory = TreeMemory(proc.pid)  # its own session (start_new_session)
    try:
        wait_ready(proc, base + ("/health" if server == "llama-server" else "/readyz"), log, args.ready_timeout)
        ready_s = time.monotonic() - started
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(f"  {server}: {base}, load average {' '.join(load)}", flush=True)
        cmd = [sys.executable, "-m", "ttft_sse", "bench", "--url", base, "--protocol", "openai"]
        cmd += ["--concurrency", args.concurrency, "--requests", str(args.requests), "--max-tokens", args.max_tokens]
        cmd += ["--prompts", str(args.prompts), "--mode", "stream", "--no-charts", "--out", str(run_dir / "bench")]
        if server == "llama-server":
            cmd.append("--ignore-eos")
        with (run_dir / "bench.log").open("wb") as fh:
            done = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the bench exited with {done.returncode}; see {run_dir / 'bench.log'}")
    finally:
        stop(proc)
        peak = memory.stop()
    document: dict[str, Any] = json.loads((run_dir / "bench" / "results.json").read_text())
    return {**document, "ready_s": ready_s, "peak_rss_bytes": peak}


def logged(log: Path) -> list[str]:
    """ttft-sse's log lines about the model's weights and decoder layers, shortened to their fields."""
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") in LOGGED:
            fields = {k: v for k, v in event.items() if k not in ("event", "level", "timestamp")}
            lines.append(f"{event['event']} {json.dumps(fields)}")
    return lines


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def table(results: dict[str, dict[str, Measured]], levels: list[int]) -> list[str]:
    """One row per model, level and ttft-sse server, beside llama-server's figures."""
    rows = [
        "| model | c | server | tok/s | tok/s llama-server | tok/s ratio | TTFT p50/p99 ms "
        "| TTFT p50/p99 ms llama-server | TTFT p50 ratio | errors / llama-server's | short / llama-server's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, by_server in results.items():
        for c in levels:
            theirs = by_server["llama-server"].level(c)
            for server in (name for name in by_server if name != "llama-server"):
                ours = by_server[server].level(c)
                rows.append(
                    f"| {model} | {c} | {server} | {_num(ours['tokens_per_s'])} | {_num(theirs['tokens_per_s'])} "
                    f"| {_ratio(ours['tokens_per_s'], theirs['tokens_per_s'])} "
                    f"| {_num(ours['ttft_p50_ms'], 0)} / {_num(ours['ttft_p99_ms'], 0)} "
                    f"| {_num(theirs['ttft_p50_ms'], 0)} / {_num(theirs['ttft_p99_ms'], 0)} "
                    f"| {_ratio(ours['ttft_p50_ms'], theirs['ttft_p50_ms'])} "
                    f"| {ours['errors']} / {theirs['errors']} | {ours['short']} / {theirs['short']} |"
                )
    return rows


def memory_table(results: dict[str, dict[str, Measured]]) -> list[str]:
    """One row per model and server: start to ready, and the process tree's peak resident memory (the most of any
    round)."""
    rows = ["| model | server | ready s | peak resident GiB |", "|---|---|---|---|"]
    for model, by_server in results.items():
        for server, measured in by_server.items():
            ready = sum(measured.ready_s) / len(measured.ready_s)
            rows.append(f"| {model} | {server} | {ready:.1f} | {max(measured.peak_rss) / 2**30:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help=f"GGUF files, 'bundled', or families: {', '.join(families.BY_NAME)}")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1, help="llama-server -t (cores)")
    parser.add_argument("--ours-threads", type=int, default=0, help="ttft-sse --threads (default: its own)")
    parser.add_argument("--requests", type=int, default=32, help="per server, level and round (default 32)")
    parser.add_argument("--concurrency", default="1,8", help="levels, one after another (default 1,8)")
    parser.add_argument("--max-tokens", default="32-96", help="each request's max_tokens, the same on both")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each server per model (default 1)")
    parser.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "chat-questions.txt")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "against-llama-server-models")
    parser.add_argument("--ready-timeout", type=float, default=1200, help="seconds a server may take to start")
    parser.add_argument("--int8", action="store_true", help="ttft-sse with TTFT_GGUF_ACTIVATIONS=int8 too")
    parser.add_argument("--slots", type=int, default=8, help="generations at once on each server (default 8)")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="each server's KV cache, tokens (default 8192)")
    args = parser.parse_args(argv)
    servers = (SERVERS[0], INT8, SERVERS[1]) if args.int8 else SERVERS
    levels = [int(c) for c in args.concurrency.split(",")]
    binary = llama_server()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    ours = f"--threads {args.ours_threads}" if args.ours_threads else "its default threads"
    print(f"CPU: {cpu}, {os.cpu_count()} cores; ttft-sse {ours}; llama-server -t {args.llama_threads} ({binary})")
    paths = {spec: model_path(spec) for spec in args.models}
    results: dict[str, dict[str, Measured]] = {}
    notes: dict[str, list[str]] = {}
    for spec, gguf in paths.items():
        name = gguf.stem if spec != "bundled" else "bundled"
        results[name] = {server: Measured() for server in servers}
        print(f"== {name}: {gguf}", flush=True)
        for round_ in range(1, args.rounds + 1):
            order = servers if round_ % 2 else servers[::-1]
            for server in order:
                run_dir = args.out / name / f"{round_}-{server.replace(' ', '-')}"
                results[name][server].add(measure(server, gguf, args, binary, run_dir))
                if server != "llama-server":
                    notes.setdefault(f"{name}, {server}", logged(run_dir / "server.log"))
    rows = [*table(results, levels), "", *memory_table(results)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n" + "\n".join(rows))
    for name, lines in notes.items():
        print(f"\n{name}: its log")
        for line in lines:
            print(f"  {line}")


if __name__ == "__main__":
    main()
