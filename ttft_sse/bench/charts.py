"""PNG charts drawn from a results document (``report.SCHEMA``), with matplotlib's Agg backend (no display).

* ``ttft.png``: the TTFT distribution of every target and mode, one panel per concurrency level (box = p25 to p75,
  whiskers = 1.5 IQR, every request a dot);
* ``concurrency.png``: TTFT p50 and p99, and output tokens/s, against concurrency;
* ``soak.png`` (with ``--soak``): server RSS and TTFT over the sequential requests.

matplotlib is the ``bench`` extra (``pip install 'ttft-sse[bench]'``); without it, :func:`write` raises
``ChartsUnavailable`` and the rest of the run is unaffected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ChartsUnavailable(RuntimeError):
    pass


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ChartsUnavailable("charts need matplotlib: pip install 'ttft-sse[bench]'") from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def write(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """Draw every chart the document has data for; returns the files written."""
    plt = _pyplot()
    written = []
    rows = document["summary"]
    load = [r for r in document["records"] if r["phase"] == "load"]
    if rows:
        written.append(_ttft(plt, rows, load, out_dir / "ttft.png"))
        written.append(_concurrency(plt, rows, out_dir / "concurrency.png"))
    if document.get("soak"):
        written.append(_soak(plt, document["soak"], out_dir / "soak.png"))
    return written


def _arm(row: dict[str, Any]) -> str:
    return f"{row['target']}\n{row['mode']}"


def _ttft(plt: Any, rows: list[dict[str, Any]], records: list[dict[str, Any]], path: Path) -> Path:
    levels = sorted({r["concurrency"] for r in rows})
    arms = list(dict.fromkeys(_arm(r) for r in rows))
    fig, axes = plt.subplots(
        1, len(levels), figsize=(max(5.0, 2.2 + 1.6 * len(arms)) * len(levels) ** 0.7, 4.2), sharey=True, squeeze=False
    )
    values_all = [r["ttft_ms"] for r in records if r["outcome"] == "ok" and r["ttft_ms"]]
    for ax, level in zip(axes[0], levels, strict=True):
        data = [
            [
                r["ttft_ms"]
                for r in records
                if r["outcome"] == "ok" and r["ttft_ms"] and r["concurrency"] == level and _arm(r) == arm
            ]
            for arm in arms
        ]
        positions = list(range(1, len(arms) + 1))
        present = [(p, d) for p, d in zip(positions, data, strict=True) if d]
        if present:
            ax.boxplot([d for _, d in present], positions=[p for p, _ in present], widths=0.5, showfliers=False)
            for p, d in present:
                offsets = [p + (((i * 7919) % 21) - 10) / 60 for i in range(len(d))]  # deterministic jitter
                ax.scatter(offsets, d, s=7, alpha=0.45, color="tab:blue", linewidths=0)
        ax.set_xticks(positions, arms, fontsize=7)
        ax.set_title(f"concurrency {level}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if values_all and max(values_all) / max(min(values_all), 1e-3) > 20:
        axes[0][0].set_yscale("log")
    axes[0][0].set_ylabel("time to first token (ms)")
    fig.suptitle("TTFT per target and mode (ok requests)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _concurrency(plt: Any, rows: list[dict[str, Any]], path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in dict.fromkeys(_arm(r) for r in rows):
        mine = sorted((r for r in rows if _arm(r) == arm), key=lambda r: r["concurrency"])
        levels = [r["concurrency"] for r in mine]
        name = arm.replace("\n", " ")
        (line,) = left.plot(levels, [r["ttft_ms"]["p50"] for r in mine], marker="o", label=f"{name} p50")
        left.plot(
            levels,
            [r["ttft_ms"]["p99"] for r in mine],
            marker="x",
            ls="--",
            color=line.get_color(),
            label=f"{name} p99",
        )
        right.plot(levels, [r["tokens_per_s"] for r in mine], marker="o", color=line.get_color(), label=name)
    levels = sorted({r["concurrency"] for r in rows})
    for ax, title, unit in ((left, "TTFT vs concurrency", "ms"), (right, "output tokens/s vs concurrency", "tokens/s")):
        if len(levels) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _soak(plt: Any, soak: dict[str, Any], path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    samples = [s for s in soak["samples"] if s["rss_bytes"] is not None]
    if samples:
        top.plot([s["after_requests"] for s in samples], [s["rss_bytes"] / 2**20 for s in samples], marker="o")
    else:
        top.text(0.5, 0.5, "RSS unavailable", ha="center", va="center", transform=top.transAxes)
    top.set_ylabel(f"server RSS (MiB, {soak['summary']['rss_source']})")
    top.grid(alpha=0.3)
    ok = [r for r in soak["records"] if r["outcome"] == "ok" and r["ttft_ms"]]
    bottom.scatter([r["index"] + 1 for r in ok], [r["ttft_ms"] for r in ok], s=8)
    bottom.set_ylabel("TTFT (ms)")
    bottom.set_xlabel("requests completed")
    bottom.grid(alpha=0.3)
    growth = soak["summary"]["rss_growth_bytes"]
    change = f", RSS change {growth / 2**20:+.1f} MiB" if growth is not None else ""
    fig.suptitle(f"soak: {len(soak['records'])} sequential requests{change}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
