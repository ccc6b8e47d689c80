"""``--soak``: many sequential requests to one server, with its resident memory read at intervals.

Memory hygiene shows as a flat line: RSS grows during the first requests (allocator pools, caches) and should then
stay put. A line that keeps climbing is a leak.

Where RSS comes from, in this order (the choice is made once, at the start, and written into the results):

``metrics``  the server's own ``process_resident_memory_bytes`` gauge on ``GET /metrics`` (Prometheus' process
             collector; any server that exposes it, from any machine);
``proc``     ``VmRSS`` in ``/proc/<pid>/status``, when the server's PID is known — the server was started by
             ``--cold-start``, or ``--server-pid`` names it — and it runs on this (Linux) machine;
``none``     neither: the soak still runs and reports its requests, and says that memory could not be read.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from ttft_sse.bench import stats
from ttft_sse.bench.client import Record, Target, send
from ttft_sse.bench.prompts import Prompt
from ttft_sse.bench.protocol import Lengths

RSSSource = Literal["metrics", "proc", "none"]
RSS_METRIC = "process_resident_memory_bytes"


def metric_value(exposition: str, name: str) -> float | None:
    """The value of an unlabelled (or first labelled) sample ``name`` in Prometheus' text format."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)")
    for line in exposition.splitlines():
        if match := pattern.match(line):
            try:
                return float(match.group(1))
            except ValueError:
                return None
    return None


def process_rss_bytes(pid: int) -> int | None:
    """Resident set size of a process from ``/proc/<pid>/status`` (Linux); ``None`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class RSSReader:
    url: str
    pid: int | None
    source: RSSSource = "none"

    async def choose(self, client: httpx.AsyncClient) -> RSSSource:
        if await self._from_metrics(client) is not None:
            self.source = "metrics"
        elif self.pid is not None and process_rss_bytes(self.pid) is not None:
            self.source = "proc"
        else:
            self.source = "none"
        return self.source

    async def read(self, client: httpx.AsyncClient) -> int | None:
        if self.source == "metrics":
            return await self._from_metrics(client)
        if self.source == "proc" and self.pid is not None:
            return process_rss_bytes(self.pid)
        return None

    async def _from_metrics(self, client: httpx.AsyncClient) -> int | None:
        try:
            response = await client.get(self.url.rstrip("/") + "/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        value = metric_value(response.text, RSS_METRIC)
        return int(value) if value is not None else None


@dataclass
class Soak:
    source: RSSSource
    samples: list[dict[str, Any]] = field(default_factory=list)  # {"after_requests", "t_s", "rss_bytes"}
    records: list[Record] = field(default_factory=list)

    def summary(self, active_s: float) -> dict[str, Any]:
        rss = [s["rss_bytes"] for s in self.samples if s["rss_bytes"] is not None]
        tenth = max(1, len(self.records) // 10)
        early = [r.ttft_ms for r in self.records[:tenth] if r.ok and r.ttft_ms is not None]
        late = [r.ttft_ms for r in self.records[-tenth:] if r.ok and r.ttft_ms is not None]
        return {
            "rss_source": self.source,
            "rss_first_bytes": rss[0] if rss else None,
            "rss_last_bytes": rss[-1] if rss else None,
            "rss_max_bytes": max(rss) if rss else None,
            "rss_growth_bytes": rss[-1] - rss[0] if rss else None,
            "ttft_p50_ms_first_tenth": stats.percentile(early, 50) if early else None,
            "ttft_p50_ms_last_tenth": stats.percentile(late, 50) if late else None,
            **stats.summarize(self.records, active_s=active_s),
        }

    def section(self, *, target: str, pid: int | None, active_s: float) -> dict[str, Any]:
        """The ``soak`` section of the results document: ``target`` is the label of the server soaked, ``pid`` its
        process id where one was known (``--cold-start`` or ``--server-pid``), else ``None``."""
        return {
            "target": target,
            "pid": pid,
            "summary": self.summary(active_s),
            "samples": self.samples,
            "records": [r.as_dict() for r in self.records],
        }


async def run(
    target: Target,
    prompts: tuple[Prompt, ...],
    *,
    requests: int,
    every: int,
    max_tokens: Lengths,
    pid: int | None,
    prompt_tag: str | None = None,
    epoch: float,
    timeout_s: float = 300.0,
    progress: Callable[[Record], None] | None = None,
) -> tuple[Soak, float]:
    """``requests`` sequential streamed requests; RSS before the first, after every ``every``, and after the last.
    Request *i* asks for ``max_tokens.at(i)``; with a ``prompt_tag`` each is a new conversation (``<tag>-soak-<i>``),
    so that the server's memory is measured while it takes prompts it has not seen, as it does in service."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10)) as client:
        reader = RSSReader(target.url, pid)
        soak = Soak(await reader.choose(client))
        started = time.perf_counter()

        async def sample(after: int) -> None:
            rss = await reader.read(client)
            soak.samples.append(
                {"after_requests": after, "t_s": round(time.perf_counter() - started, 3), "rss_bytes": rss}
            )

        await sample(0)
        for i in range(requests):
            prompt = prompts[i % len(prompts)]
            if prompt_tag is not None:
                prompt = prompt.tagged(f"{prompt_tag}-soak-{i}")
            record = Record(target.label, target.protocol, "stream", 1, i, prompt.name, phase="soak")
            await send(client, target, "stream", prompt, max_tokens=max_tokens.at(i), record=record, epoch=epoch)
            soak.records.append(record)
            if progress is not None:
                progress(record)
            if (i + 1) % every == 0 or i + 1 == requests:
                await sample(i + 1)
        return soak, time.perf_counter() - started
