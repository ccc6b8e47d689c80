"""``ttft-sse bench``: its arguments, and the run that ties the phases together.

Phases, in order: cold start (``--cold-start``), load (always), soak (``--soak``). Then the results: a table on
stdout, ``results.json`` and the charts in ``--out``. This module is imported by ``ttft_sse.__main__`` to declare the
arguments, so it imports nothing heavy at module level; the phases import httpx (and matplotlib) when they run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ttft_sse.bench.protocol import Lengths

if TYPE_CHECKING:
    from ttft_sse.bench.client import Record, Target
    from ttft_sse.bench.protocol import Mode, Protocol


class UsageError(ValueError):
    """A bad combination of arguments; the message says what to give instead."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--url", action="append", required=True, metavar="URL", help="server to measure; give two to compare them")
    add(
        "--protocol",
        action="append",
        choices=("native", "openai"),
        help="native (/stream, /complete) or openai (/v1/chat/completions); once for every --url, or once per --url",
    )
    add("--model", help="model name sent to openai targets (default: the first of GET /v1/models)")
    add(
        "--api-key",
        action="append",
        metavar="KEY",
        help="sent as 'Authorization: Bearer KEY'; once for every --url, or once per --url (never written to results)",
    )
    add("--concurrency", default="1,8,32", metavar="1,8,32", help="requests in flight, one level after another")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=int, metavar="N", help="requests per target, mode and level (default 32)")
    amount.add_argument("--duration", type=float, metavar="S", help="seconds of load per target, mode and level")
    add("--prompts", type=Path, metavar="FILE", help="JSON Lines ({messages} or {prompt}) or text, a prompt a line")
    add(
        "--max-tokens",
        default="64",
        metavar="N|LOW-HIGH",
        help="max_tokens of each request: one value (default 64), or a range each request takes its own value from",
    )
    add(
        "--same-prompts",
        action="store_true",
        help="send the prompts as written, repeated at every level and in every arm (by default each request is a new "
        "conversation: a server that caches prompts' KV cannot answer it from that cache)",
    )
    add(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sent with every request (default 0: greedy, the same tokens every run; 1: an OpenAI client's default)",
    )
    add("--mode", default="stream", metavar="stream,batch", help="stream, batch (/complete or stream: false), or both")
    add("--out", type=Path, metavar="DIR", help="where results.json and the charts go (default ./ttft-bench-<time>)")
    add("--timeout", type=float, default=300.0, metavar="S", help="per request (default 300)")
    add("--no-charts", action="store_true", help="write no PNG charts")
    cold = parser.add_argument_group("cold start")
    cold.add_argument("--cold-start", metavar="CMD", help="start this server command (serving the first --url) N times")
    cold.add_argument("--cold-starts", type=int, default=3, metavar="N", help="starts to measure (default 3)")
    cold.add_argument(
        "--steady", type=int, default=5, metavar="N", help="requests after the first, per start (default 5)"
    )
    cold.add_argument(
        "--ready-path", default="/readyz", help="readiness endpoint (default /readyz; llama-server: /health)"
    )
    cold.add_argument("--ready-timeout", type=float, default=300.0, metavar="S", help="per start (default 300)")
    soak = parser.add_argument_group("soak")
    soak.add_argument("--soak", action="store_true", help="then send many sequential requests, reading server RSS")
    soak.add_argument("--soak-requests", type=int, default=200, metavar="N", help="(default 200)")
    soak.add_argument("--soak-every", type=int, default=20, metavar="N", help="read RSS every N requests (default 20)")
    soak.add_argument("--server-pid", type=int, metavar="PID", help="read RSS from /proc/PID when there is no /metrics")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--concurrency takes whole numbers separated by commas, like 1,8,32; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency levels must be 1 or more, got {text!r}")
    return tuple(dict.fromkeys(levels))


def _modes(text: str) -> tuple[Mode, ...]:
    modes = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not modes or any(m not in ("stream", "batch") for m in modes):
        raise UsageError(f"--mode takes stream, batch or stream,batch; got {text!r}")
    return modes  # type: ignore[return-value]  # checked just above


def _lengths(text: str) -> Lengths:
    low, sep, high = text.partition("-")
    try:
        return Lengths(int(low), int(high) if sep else int(low))
    except ValueError:
        raise UsageError(f"--max-tokens takes N or LOW-HIGH of 1 or more, like 64 or 32-96; got {text!r}") from None


def _per_url(flag: str, values: list[str] | None, urls: list[str], default: str) -> list[str]:
    given = values or [default]
    if len(given) == 1:
        given = given * len(urls)
    if len(given) != len(urls):
        raise UsageError(f"give {flag} once, or once per --url ({len(urls)}); got it {len(values or [])} times")
    return given


def _redacted(argv: list[str]) -> list[str]:
    """The command as run, with API keys replaced: results.json gets shared."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif arg.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


def _targets(urls: list[str], protocols: list[str] | None) -> list[tuple[str, Protocol]]:
    given = _per_url("--protocol", protocols, urls, "native")
    out: list[tuple[str, Protocol]] = []
    for url, proto in zip(urls, given, strict=True):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"--url must be like http://127.0.0.1:8000, got {url!r}")
        out.append((url.rstrip("/"), proto))  # type: ignore[arg-type]  # argparse choices
    return out


def _labels(pairs: list[tuple[str, Protocol]]) -> list[str]:
    labels = []
    for url, proto in pairs:
        parts = urlsplit(url)
        label = f"{parts.netloc}{parts.path} {proto}"
        while label in labels:
            label += "'"
        labels.append(label)
    return labels


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("cold_starts", "soak_requests", "soak_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be 1 or more")
    if args.steady < 0:
        raise UsageError("--steady must be 0 or more")
    if args.requests is not None and args.requests < 1:
        raise UsageError("--requests must be 1 or more")
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be more than 0")
    if args.timeout <= 0:
        raise UsageError("--timeout must be more than 0")
    if not 0 <= args.temperature <= 2:
        raise UsageError("--temperature must be between 0 and 2")


def main(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    try:
        _check_counts(args)
        pairs = _targets(args.url, args.protocol)
        keys = _per_url("--api-key", args.api_key, args.url, "")
        levels, modes = _levels(args.concurrency), _modes(args.mode)
        lengths = _lengths(args.max_tokens)
    except UsageError as exc:
        print(f"ttft-sse bench: {exc}", file=sys.stderr)
        return 2
    from ttft_sse.bench.coldstart import ColdStartError
    from ttft_sse.bench.prompts import PromptFileError

    try:
        command = _redacted(["ttft-sse", *(sys.argv[1:] if argv is None else argv)])
        return asyncio.run(_run(args, pairs, keys, levels, modes, lengths, command))
    except (PromptFileError, ColdStartError, LookupError) as exc:
        print(f"ttft-sse bench: {exc}", file=sys.stderr)
        return 1


def _progress(desc: str, total: int | None) -> tuple[Callable[[Record], None], Callable[[], None]]:
    """A tqdm bar on stderr (hidden when stderr is not a terminal) that counts requests and errors."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=None, leave=False)
    errors = 0

    def advance(record: Record) -> None:
        nonlocal errors
        errors += not record.ok
        bar.update(1)
        bar.set_postfix(errors=errors, refresh=False)

    return advance, bar.close


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


async def _run(
    args: argparse.Namespace,
    pairs: list[tuple[str, Protocol]],
    keys: list[str],
    levels: tuple[int, ...],
    modes: tuple[Mode, ...],
    lengths: Lengths,
    argv: list[str],
) -> int:
    from ttft_sse.bench import coldstart, load, prompts, report, soak
    from ttft_sse.bench.client import Target

    prompt_set = tuple(prompts.load(args.prompts))
    out_dir: Path = args.out or Path(f"ttft-bench-{datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    epoch = time.perf_counter()
    started_at = datetime.now(UTC)
    loadavg_start = _loadavg()
    labels = _labels(pairs)
    targets = [
        Target(url, proto, label, api_key=key, temperature=args.temperature)
        for (url, proto), label, key in zip(pairs, labels, keys, strict=True)
    ]
    requests = args.requests if args.requests is not None or args.duration is not None else 32
    # New conversations: tagged with this run's id, so that a server that ran an earlier bench has not seen them.
    prompt_tag = None if args.same_prompts else secrets.token_hex(3)

    document: dict[str, Any] = {"schema": report.SCHEMA}
    kept: coldstart.Launched | None = None
    cold: dict[str, Any] | None = None
    try:
        if args.cold_start:
            first = replace(targets[0], model=args.model or "")  # an openai model is looked up once the server is up
            trials, kept = await coldstart.measure(
                args.cold_start,
                first,
                starts=args.cold_starts,
                steady=args.steady,
                prompt=prompt_set[0],
                max_tokens=lengths,
                out_dir=out_dir,
                epoch=epoch,
                ready_path=args.ready_path,
                ready_timeout=args.ready_timeout,
                request_timeout=args.timeout,
                keep_last=True,
            )
            cold = {
                "command": args.cold_start,
                "summary": coldstart.summarize(trials),
                "trials": [t.as_dict() for t in trials],
            }
        targets = [await _with_model(t, args.model) if t.protocol == "openai" else t for t in targets]
        plan = load.Plan(
            targets=tuple(targets),
            modes=modes,
            concurrency=levels,
            prompts=prompt_set,
            max_tokens=lengths,
            requests=requests,
            duration_s=args.duration,
            timeout_s=args.timeout,
            prompt_tag=prompt_tag,
        )
        advance, close = _progress("load", plan.planned)
        try:
            runs = await load.run(plan, epoch=epoch, progress=advance)
        finally:
            close()
        soaked: dict[str, Any] | None = None
        if args.soak:
            pid = kept.pid if kept is not None else args.server_pid
            advance, close = _progress("soak", args.soak_requests)
            try:
                result, active_s = await soak.run(
                    targets[0],
                    prompt_set,
                    requests=args.soak_requests,
                    every=args.soak_every,
                    max_tokens=lengths,
                    pid=pid,
                    prompt_tag=prompt_tag,
                    epoch=epoch,
                    timeout_s=args.timeout,
                    progress=advance,
                )
            finally:
                close()
            soaked = {
                "target": targets[0].label,
                "pid": pid,
                "summary": result.summary(active_s),
                "samples": result.samples,
                "records": [r.as_dict() for r in result.records],
            }
    finally:
        if kept is not None:
            exit_code = await asyncio.to_thread(kept.stop)
            if cold is not None:
                cold["trials"][-1]["exit_code"] = exit_code

    rows = report.summary_rows(runs)
    compared = report.comparisons(rows)
    document.update(
        started_at=started_at.isoformat(timespec="seconds"),
        finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        command=argv,
        host={
            "cpus": os.cpu_count(),
            "loadavg_start": loadavg_start,
            "loadavg_end": _loadavg(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        config={
            "concurrency": list(levels),
            "modes": list(modes),
            "requests": plan.requests,
            "duration_s": plan.duration_s,
            "max_tokens": lengths.low if lengths.low == lengths.high else [lengths.low, lengths.high],
            "temperature": args.temperature,
            "timeout_s": args.timeout,
            "prompts": {
                "source": str(args.prompts) if args.prompts else "default",
                "count": len(prompt_set),
                "tag": prompt_tag,  # null: sent as written (--same-prompts)
            },
            "schedule": "continuous" if len(plan.arms) == 1 else "rounds",
        },
        targets=[{"label": t.label, "url": t.url, "protocol": t.protocol, "model": t.model or None} for t in targets],
        summary=rows,
        comparisons=compared,
        cold_start=cold,
        soak=soaked,
        records=[r.as_dict() for run in runs for r in run.records],
    )
    results = out_dir / "results.json"
    report.write_json(document, results)

    print(report.table(rows))
    for line in report.comparison_lines(compared):
        print(line)
    if cold is not None:
        print("\n".join(report.cold_start_lines(cold["summary"])))
    if soaked is not None:
        print("\n".join(report.soak_lines(soaked["summary"])))
    written = [results]
    if not args.no_charts:
        from ttft_sse.bench import charts

        try:
            written += charts.write(document, out_dir)
        except charts.ChartsUnavailable as exc:
            print(f"charts skipped: {exc}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


async def _with_model(target: Target, model: str | None) -> Target:
    from ttft_sse.bench.load import discover_model

    if target.model:
        return target
    return replace(target, model=model or await discover_model(target))
