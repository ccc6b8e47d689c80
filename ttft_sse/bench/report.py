"""What a benchmark run leaves behind: the results document (JSON), its terminal table and its comparisons.

The document (``SCHEMA``) holds every raw record and the summary computed from them, so any figure can be checked
or recomputed later; the charts (``charts.py``) and the terminal summary (:func:`terminal_lines`) are drawn from the
document alone. The cold start and soak phases hand in their own sections (``coldstart.section``, ``Soak.section``).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ttft_sse.bench import stats
from ttft_sse.bench.client import OUTCOMES
from ttft_sse.bench.load import ArmRun, Plan

SCHEMA = "ttft-sse-bench/1"


def document(
    plan: Plan,
    runs: list[ArmRun],
    *,
    command: list[str],
    started_at: datetime,
    loadavg_start: list[float] | None,
    temperature: float,
    prompt_file: Path | None,
    cold_start: dict[str, Any] | None,
    soak: dict[str, Any] | None,
) -> dict[str, Any]:
    """The results document of a run that has just finished (``finished_at`` and the end load average are read now).

    ``plan`` is the load phase's, its targets with their models; ``command`` has its API keys redacted already.
    Keys are written in this order, so that results.json reads from what was run to what it measured."""
    rows = summary_rows(runs)
    return {
        "schema": SCHEMA,
        "started_at": started_at.isoformat(timespec="seconds"),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "host": _host(loadavg_start),
        "config": _config(plan, temperature=temperature, prompt_file=prompt_file),
        "targets": [
            {"label": t.label, "url": t.url, "protocol": t.protocol, "model": t.model or None} for t in plan.targets
        ],
        "summary": rows,
        "comparisons": comparisons(rows),
        "cold_start": cold_start,
        "soak": soak,
        "records": [r.as_dict() for run in runs for r in run.records],
    }


def loadavg() -> list[float] | None:
    """The host's load averages over 1, 5 and 15 minutes; ``None`` where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _host(loadavg_start: list[float] | None) -> dict[str, Any]:
    """The machine the bench ran on: a busy or small host explains figures that differ between runs."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_start": loadavg_start,
        "loadavg_end": loadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _config(plan: Plan, *, temperature: float, prompt_file: Path | None) -> dict[str, Any]:
    """What the load phase was asked to do, as the flags gave it."""
    lengths = plan.max_tokens
    return {
        "concurrency": list(plan.concurrency),
        "modes": list(plan.modes),
        "requests": plan.requests,
        "duration_s": plan.duration_s,
        "max_tokens": lengths.low if lengths.low == lengths.high else [lengths.low, lengths.high],
        "temperature": temperature,
        "timeout_s": plan.timeout_s,
        "typing_cps": plan.typing_cps,  # 0: no typing; else the last message typed first (ttft_sse/bench/typist.py)
        "prompts": {
            "source": str(prompt_file) if prompt_file else "default",
            "count": len(plan.prompts),
            "tag": plan.prompt_tag,  # null: sent as written (--same-prompts)
        },
        "schedule": "continuous" if len(plan.arms) == 1 else "rounds",
    }


def summary_rows(runs: Iterable[ArmRun]) -> list[dict[str, Any]]:
    return [
        {
            "target": run.target.label,
            "protocol": run.target.protocol,
            "mode": run.mode,
            "concurrency": run.concurrency,
            **stats.summarize(run.records, active_s=run.active_s),
        }
        for run in runs
    ]


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stream against batch for each target, and every other target against the first, for each mode and level."""
    out: list[dict[str, Any]] = []
    index = {(r["target"], r["mode"], r["concurrency"]): r for r in rows}
    targets = list(dict.fromkeys(r["target"] for r in rows))
    levels = list(dict.fromkeys(r["concurrency"] for r in rows))
    for target in targets:
        for c in levels:
            stream, batch = index.get((target, "stream", c)), index.get((target, "batch", c))
            if stream is None or batch is None:
                continue
            out.append(
                {
                    "kind": "batch_over_stream",
                    "target": target,
                    "concurrency": c,
                    "ttft_p50_ms": [stream["ttft_ms"]["p50"], batch["ttft_ms"]["p50"]],
                    "ttft_p50_ratio": stats.ratio(batch["ttft_ms"]["p50"], stream["ttft_ms"]["p50"]),
                    "ttft_p99_ratio": stats.ratio(batch["ttft_ms"]["p99"], stream["ttft_ms"]["p99"]),
                    "total_p50_ratio": stats.ratio(batch["total_ms"]["p50"], stream["total_ms"]["p50"]),
                }
            )
    baseline = targets[0] if targets else None
    for other in targets[1:]:
        for (target, mode, c), row in index.items():
            base = index.get((baseline, mode, c))
            if target != other or base is None:
                continue
            out.append(
                {
                    "kind": "target_over_baseline",
                    "target": other,
                    "baseline": baseline,
                    "mode": mode,
                    "concurrency": c,
                    "ttft_p50_ratio": stats.ratio(row["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                    "ttft_p99_ratio": stats.ratio(row["ttft_ms"]["p99"], base["ttft_ms"]["p99"]),
                    "itl_p50_ratio": stats.ratio(row["itl_ms"]["p50"], base["itl_ms"]["p50"]),
                    "tokens_per_s_ratio": stats.ratio(row["tokens_per_s"], base["tokens_per_s"]),
                }
            )
    return out


def write_json(document: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(document, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


# -- terminal ----------------------------------------------------------------------------------------------------


def terminal_lines(document: dict[str, Any]) -> list[str]:
    """What stdout shows of a results document: the table, the comparisons, then the cold start and soak summaries
    of the runs that had them."""
    lines = [table(document["summary"]), *comparison_lines(document["comparisons"])]
    if document["cold_start"] is not None:
        lines += cold_start_lines(document["cold_start"]["summary"])
    if document["soak"] is not None:
        lines += soak_lines(document["soak"]["summary"])
    return lines


def _ms(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _triple(dist: dict[str, Any]) -> str:
    return "/".join(_ms(dist[f"p{q}"]) for q in stats.QUANTILES)


def _rate(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _errors(row: dict[str, Any]) -> str:
    if not row["errors"]:
        return "0"
    kinds = ", ".join(
        f"{kind} {row['outcomes'][kind]}" for kind in OUTCOMES if kind != "ok" and kind in row["outcomes"]
    )
    return f"{row['errors']} ({kinds})"


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as aligned text: one line per target, mode and concurrency; latencies as p50/p90/p99 in ms."""
    header = ["c", "target", "mode", "ok/n", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99", "total ms p50/p90/p99"]
    header += ["tok/s", "req/s", "errors"]
    lines = [header]
    for r in rows:
        lines.append(
            [
                str(r["concurrency"]),
                r["target"],
                r["mode"],
                f"{r['ok']}/{r['requests']}",
                _triple(r["ttft_ms"]),
                _triple(r["itl_ms"]),
                _triple(r["total_ms"]),
                _rate(r["tokens_per_s"]),
                _rate(r["requests_per_s"]),
                _errors(r),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    left = {1, 2, 9}
    out = []
    for line in lines:
        cells = [
            cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def comparison_lines(items: list[dict[str, Any]]) -> list[str]:
    lines = []
    for item in items:
        if item["kind"] == "batch_over_stream":
            stream_ms, batch_ms = item["ttft_p50_ms"]
            lines.append(
                f"c={item['concurrency']} {item['target']}: first text after {_ms(stream_ms)} ms streamed vs "
                f"{_ms(batch_ms)} ms batched (TTFT p50 batch/stream = {_x(item['ttft_p50_ratio'])}, "
                f"p99 = {_x(item['ttft_p99_ratio'])})"
            )
        else:
            lines.append(
                f"c={item['concurrency']} {item['mode']}: {item['target']} / {item['baseline']}: "
                f"TTFT p50 {_x(item['ttft_p50_ratio'])}, p99 {_x(item['ttft_p99_ratio'])}, "
                f"ITL p50 {_x(item['itl_p50_ratio'])}, tok/s {_x(item['tokens_per_s_ratio'])}"
            )
    return lines


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def cold_start_lines(summary: dict[str, Any]) -> list[str]:
    ready = summary["ready_ms"]
    stages = (
        ", ".join(f"{name} {_ms(value)}" for name, value in summary["startup_ms_median"].items()) or "none reported"
    )
    return [
        f"cold start ({summary['starts']} starts): process start -> ready p50 {_ms(ready['p50'])} ms "
        f"(min {_ms(ready['min'])}, max {_ms(ready['max'])})",
        f"  server's own stages (median ms): {stages}",
        f"  TTFT of the first request after ready p50 {_ms(summary['first_ttft_ms']['p50'])} ms; "
        f"steady state p50 {_ms(summary['steady_ttft_ms']['p50'])} ms; failed requests {summary['failed_requests']}",
    ]


def soak_lines(summary: dict[str, Any]) -> list[str]:
    def mib(value: Any) -> str:
        return "-" if value is None else f"{value / 2**20:.1f} MiB"

    if summary["rss_source"] == "none":
        memory = "RSS unavailable (no /metrics gauge, no server PID: use --cold-start or --server-pid)"
    else:
        memory = (
            f"RSS ({summary['rss_source']}) {mib(summary['rss_first_bytes'])} -> {mib(summary['rss_last_bytes'])}, "
            f"max {mib(summary['rss_max_bytes'])}, growth {mib(summary['rss_growth_bytes'])}"
        )
    return [
        f"soak ({summary['requests']} sequential requests, {summary['errors']} errors): {memory}",
        f"  TTFT p50 first tenth {_ms(summary['ttft_p50_ms_first_tenth'])} ms, "
        f"last tenth {_ms(summary['ttft_p50_ms_last_tenth'])} ms",
    ]
