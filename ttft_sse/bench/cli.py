"""``ttft-sse bench``: its arguments, and the run that ties the phases together.

Phases, in order: cold start (``--cold-start``), load (always), soak (``--soak``). Then the results: a table on
stdout, ``results.json`` and the charts in ``--out``. This module is imported by ``ttft_sse.__main__`` to declare the
arguments, so it imports nothing heavy at module level; the phases import httpx (and matplotlib) when they run.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ttft_sse.bench.protocol import Lengths

if TYPE_CHECKING:
    from ttft_sse.bench.client import Record, Target
    from ttft_sse.bench.coldstart import Launched, Trial
    from ttft_sse.bench.load import ArmRun, Plan
    from ttft_sse.bench.prompts import Prompt
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
    add(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true with every request (llama-server, vLLM: every answer is max_tokens long; this "
        "server refuses it)",
    )
    add(
        "--typing-cps",
        type=float,
        default=0.0,
        metavar="N",
        help="type each request's last message at N characters a second first, calling /prefill as the chat page "
        "does, and time the request from the end of typing (native protocol only; default 0: off)",
    )
    add("--mode", default="stream", metavar="stream,batch", help="stream, batch (/complete or stream: false), or both")
    add("--out", type=Path, metavar="DIR", help="where results.json and the charts go (default ./ttft-bench-<time>)")
    add("--timeout", type=float, default=300.0, metavar="S", help="per request (default 300)")
    add("--no-charts", action="store_true", help="write no PNG charts")
    _add_cold_start_arguments(parser)
    _add_soak_arguments(parser)


def _add_cold_start_arguments(parser: argparse.ArgumentParser) -> None:
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


def _add_soak_arguments(parser: argparse.ArgumentParser) -> None:
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
    if args.typing_cps < 0:
        raise UsageError("--typing-cps must be 0 (off) or more")


def main(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    try:
        _check_counts(args)
        pairs = _targets(args.url, args.protocol)
        if args.typing_cps and any(proto != "native" for _, proto in pairs):
            raise UsageError("--typing-cps calls this server's /prefill: give it with --protocol native only")
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


@contextmanager
def _progress(desc: str, total: int | None) -> Iterator[Callable[[Record], None]]:
    """A tqdm bar on stderr (hidden when stderr is not a terminal) that counts requests and errors; it is closed
    when the block ends, however it ends."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=None, leave=False)
    errors = 0

    def advance(record: Record) -> None:
        nonlocal errors
        errors += not record.ok
        bar.update(1)
        bar.set_postfix(errors=errors, refresh=False)

    try:
        yield advance
    finally:
        bar.close()


@dataclass(frozen=True)
class _Context:
    """What every phase of one run shares: the arguments, the prompts and lengths to send, where files go, the
    clock's zero (``epoch``: every record's ``start_s`` counts from it) and this run's prompt tag."""

    args: argparse.Namespace
    prompts: tuple[Prompt, ...]
    lengths: Lengths
    out_dir: Path
    epoch: float
    prompt_tag: str | None  # None: the prompts go as written (--same-prompts)

    @classmethod
    def start(cls, args: argparse.Namespace, lengths: Lengths) -> _Context:
        """Reads the prompts first, so that a bad prompt file leaves no output directory behind."""
        from ttft_sse.bench import prompts

        prompt_set = tuple(prompts.load(args.prompts))
        out_dir: Path = args.out or Path(f"ttft-bench-{datetime.now():%Y%m%d-%H%M%S}")
        out_dir.mkdir(parents=True, exist_ok=True)
        epoch = time.perf_counter()
        # New conversations: tagged with this run's id, so that a server that ran an earlier bench has not seen them.
        prompt_tag = None if args.same_prompts else secrets.token_hex(3)
        return cls(args, prompt_set, lengths, out_dir, epoch, prompt_tag)


@dataclass(frozen=True)
class _Measured:
    """What the phases measured, as the results document takes it."""

    plan: Plan  # its targets carry the models looked up at /v1/models
    runs: list[ArmRun]
    cold_start: dict[str, Any] | None  # None: no --cold-start
    soak: dict[str, Any] | None  # None: no --soak


async def _run(
    args: argparse.Namespace,
    pairs: list[tuple[str, Protocol]],
    keys: list[str],
    levels: tuple[int, ...],
    modes: tuple[Mode, ...],
    lengths: Lengths,
    argv: list[str],
) -> int:
    """The run behind :func:`main`: the phases, then results.json, the summary on stdout and the charts."""
    from ttft_sse.bench import report

    context = _Context.start(args, lengths)
    started_at = datetime.now(UTC)
    loadavg_start = report.loadavg()
    targets = _make_targets(pairs, keys, args.temperature, args.ignore_eos)
    measured = await _measure(context, targets, levels, modes)
    document = report.document(
        measured.plan,
        measured.runs,
        command=argv,
        started_at=started_at,
        loadavg_start=loadavg_start,
        temperature=args.temperature,
        prompt_file=args.prompts,
        cold_start=measured.cold_start,
        soak=measured.soak,
    )
    _write(document, context.out_dir, charts=not args.no_charts)
    return 0


def _make_targets(
    pairs: list[tuple[str, Protocol]], keys: list[str], temperature: float, ignore_eos: bool = False
) -> list[Target]:
    from ttft_sse.bench.client import Target

    return [
        Target(url, proto, label, api_key=key, temperature=temperature, ignore_eos=ignore_eos)
        for (url, proto), label, key in zip(pairs, _labels(pairs), keys, strict=True)
    ]


async def _measure(
    context: _Context, targets: list[Target], levels: tuple[int, ...], modes: tuple[Mode, ...]
) -> _Measured:
    """The phases in order: cold start (``--cold-start``), load, soak (``--soak``). The server the cold start leaves
    running is stopped however the later phases end, and its exit code joins the last trial."""
    from ttft_sse.bench import coldstart

    args = context.args
    trials: list[Trial] = []
    kept: Launched | None = None
    if args.cold_start:
        trials, kept = await _cold_start(context, targets[0])
    try:
        targets = [await _with_model(t, args.model) if t.protocol == "openai" else t for t in targets]
        plan, runs = await _load(context, targets, levels, modes)
        soaked = None
        if args.soak:
            soaked = await _soak(context, targets[0], pid=kept.pid if kept is not None else args.server_pid)
    finally:
        if kept is not None:
            trials[-1].exit_code = await asyncio.to_thread(kept.stop)
    cold = coldstart.section(args.cold_start, trials) if args.cold_start else None
    return _Measured(plan, runs, cold, soaked)


async def _cold_start(context: _Context, target: Target) -> tuple[list[Trial], Launched | None]:
    """``--cold-starts`` starts of ``--cold-start``; the last one's server is kept for the load and soak phases."""
    from ttft_sse.bench import coldstart

    args = context.args
    first = replace(target, model=args.model or "")  # an openai model is looked up once the server is up
    return await coldstart.measure(
        args.cold_start,
        first,
        starts=args.cold_starts,
        steady=args.steady,
        prompt=context.prompts[0],
        max_tokens=context.lengths,
        out_dir=context.out_dir,
        epoch=context.epoch,
        ready_path=args.ready_path,
        ready_timeout=args.ready_timeout,
        request_timeout=args.timeout,
        keep_last=True,
    )


async def _load(
    context: _Context, targets: list[Target], levels: tuple[int, ...], modes: tuple[Mode, ...]
) -> tuple[Plan, list[ArmRun]]:
    from ttft_sse.bench import load

    plan = _plan(context, targets, levels, modes)
    with _progress("load", plan.planned) as advance:
        runs = await load.run(plan, epoch=context.epoch, progress=advance)
    return plan, runs


def _plan(context: _Context, targets: list[Target], levels: tuple[int, ...], modes: tuple[Mode, ...]) -> Plan:
    from ttft_sse.bench import load

    args = context.args
    return load.Plan(
        targets=tuple(targets),
        modes=modes,
        concurrency=levels,
        prompts=context.prompts,
        max_tokens=context.lengths,
        requests=args.requests if args.requests is not None or args.duration is not None else 32,
        duration_s=args.duration,
        timeout_s=args.timeout,
        prompt_tag=context.prompt_tag,
        typing_cps=args.typing_cps,
    )


async def _soak(context: _Context, target: Target, *, pid: int | None) -> dict[str, Any]:
    """``--soak-requests`` sequential requests to ``target``; ``pid``: where to read RSS if it has no /metrics."""
    from ttft_sse.bench import soak

    args = context.args
    with _progress("soak", args.soak_requests) as advance:
        result, active_s = await soak.run(
            target,
            context.prompts,
            requests=args.soak_requests,
            every=args.soak_every,
            max_tokens=context.lengths,
            pid=pid,
            prompt_tag=context.prompt_tag,
            epoch=context.epoch,
            timeout_s=args.timeout,
            progress=advance,
        )
    return result.section(target=target.label, pid=pid, active_s=active_s)


def _write(document: dict[str, Any], out_dir: Path, *, charts: bool) -> None:
    """results.json, then the summary on stdout, then the charts; the last line names every file written."""
    from ttft_sse.bench import report

    results = out_dir / "results.json"
    report.write_json(document, results)
    for line in report.terminal_lines(document):
        print(line)
    written = [results]
    if charts:
        written += _charts(document, out_dir)
    print("wrote " + ", ".join(str(p) for p in written))


def _charts(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """The charts written; none, with a note on stderr, without matplotlib."""
    from ttft_sse.bench import charts

    try:
        return charts.write(document, out_dir)
    except charts.ChartsUnavailable as exc:
        print(f"charts skipped: {exc}", file=sys.stderr)
        return []


async def _with_model(target: Target, model: str | None) -> Target:
    from ttft_sse.bench.load import discover_model

    if target.model:
        return target
    return replace(target, model=model or await discover_model(target))
