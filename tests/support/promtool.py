"""Prometheus's promtool on the alert rules in deploy/prometheus."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.processes import system_binary

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


ALERTS = RULES_DIR / "alerts.yml"


ALERTS_TEST = RULES_DIR / "alerts_test.yml"


def promtool() -> str:
    return system_binary("promtool", "prometheus")


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120, check=False)
