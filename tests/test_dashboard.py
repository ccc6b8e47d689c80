"""The Grafana dashboard and the alert rules query only metrics the server really exports.

Names are checked against a real ``/metrics`` scrape (after requests, so that labelled series exist), plus the
CUDA series that only a GPU engine exports (``gauges.CUDA_METRICS``) and the prefix and KV cache series that only
the batched engine exports (``gauges.BATCH_METRICS``; tests/test_metrics.py checks that it does).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.testclient import TestClient

from tests.support.promtool import ALERTS, run_promtool
from tests.support.scrape import scrape
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.gauges import BATCH_METRICS, CUDA_METRICS, KERNEL_METRICS
from ttft_sse.settings import Settings

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "ttft-sse.json"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels and durations left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    names = set()
    for match in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\s*(\()?", text):
        name, call = match.groups()
        if not call and name not in _KEYWORDS:
            names.add(name)
    return names


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{job=~"$job", x="y(z)"}[$__rate_interval])))'
        " > 3 * (sum(rate(b_total[1d] offset 15m)) / c) and on (job) d"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in data["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in panels(dashboard()) for target in panel.get("targets", [])]


def alert_exprs() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every sample name of a real scrape after an ok, a capped and an invalid request."""
    with TestClient(create_app(Settings(), FakeEngine()), raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 10
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the app did not become ready"
            time.sleep(0.01)
        client.post("/complete", json={"prompt": "hi"})
        client.post("/complete", json={"prompt": "hi", "max_tokens": 1})
        client.post("/complete", json={"prompt": "hi", "bogus": 1})
        return scrape(client).names() | set(CUDA_METRICS) | set(BATCH_METRICS) | set(KERNEL_METRICS)


def test_the_dashboard_parses_and_shows_ttft_throughput_queue_caches_and_memory() -> None:
    data = dashboard()
    assert data["uid"] == "ttft-sse"
    titles = [panel["title"] for panel in panels(data)]
    assert len(titles) == len(set(titles))
    assert len({panel["id"] for panel in panels(data)}) == len(titles)
    used = set().union(*map(metric_names, dashboard_exprs()))
    for needed in (
        "ttft_sse_time_to_first_token_seconds_bucket",  # TTFT percentiles
        "ttft_sse_requests_total",  # throughput
        "ttft_sse_generation_tokens_total",
        "ttft_sse_num_requests_waiting",  # queue
        "ttft_sse_queue_wait_seconds_bucket",
        "process_resident_memory_bytes",  # memory
        "ttft_sse_cuda_memory_reserved_bytes",
        "ttft_sse_prefix_cache_hits_tokens_total",  # batched engine
        "ttft_sse_kv_cache_usage_ratio",
        "ttft_sse_kernel_chunks_total",  # the kernel's helper threads
    ):
        assert needed in used, needed


def test_every_dashboard_query_selects_only_exported_metrics(exported: set[str]) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for expr in exprs:
        unknown = metric_names(expr) - exported
        assert not unknown, f"{expr}: not exported: {sorted(unknown)}"
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["query"]["query"])
            assert match and match.group(1) in exported, variable["query"]


def test_every_alert_selects_only_exported_metrics(exported: set[str]) -> None:
    for expr in alert_exprs():
        names = metric_names(expr)
        assert names, expr
        assert names <= exported, f"{expr}: not exported: {sorted(names - exported)}"


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule, Grafana's variables filled in as Grafana would."""
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "5m").replace("$job", ".+")}
        for i, expr in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
