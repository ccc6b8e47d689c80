"""The Prometheus alert rules: valid (``promtool check rules``) and unit-tested (``promtool test rules``).

promtool comes from Debian's ``prometheus`` package, which ``.ci/run`` installs. Without it these tests skip on a
developer's machine and fail under CI, where a skip would hide that the rules were never checked.
"""

from __future__ import annotations

import yaml

from tests.support.promtool import ALERTS, ALERTS_TEST, run_promtool


def alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"]]


def test_the_four_alerts_of_the_production_checklist_are_defined() -> None:
    assert alert_names() == ["TTFTP99High", "GPUUnderutilised", "QueueWaitP99High", "GeneratedTokensPerRequestSurge"]


def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 4 rules found" in result.stdout


def test_promtool_test_rules() -> None:
    result = run_promtool("test", "rules", ALERTS_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_both_firing_and_silent() -> None:
    cases = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    checks = [check for case in cases for check in case["alert_rule_test"]]
    for name in alert_names():
        expectations = [check["exp_alerts"] for check in checks if check["alertname"] == name]
        assert any(expectations), f"{name} is never expected to fire"
        assert [] in expectations, f"{name} is never expected to stay silent"
        # The firing case also has series that must not fire: only some of the input's jobs/instances alert.
        firing = next(e for e in expectations if e)
        assert len(firing) == 1, name
