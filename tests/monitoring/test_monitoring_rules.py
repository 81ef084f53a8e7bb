"""promtool: the Prometheus configuration, the alert rules and their unit tests."""

from __future__ import annotations

import pytest
from tests.monitoring.helpers import PROM_DIR, RULE_TESTS, RULES, need, run

pytestmark = pytest.mark.integration


def test_prometheus_config_is_valid() -> None:
    promtool = need("promtool")
    result = run([promtool, "check", "config", str(PROM_DIR / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_are_valid() -> None:
    promtool = need("promtool")
    result = run([promtool, "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 7 rules found" in result.stdout


def test_alert_rule_unit_tests_pass_and_cover_every_alert() -> None:
    yaml = pytest.importorskip("yaml")

    promtool = need("promtool")
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    firing: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            if check.get("exp_alerts"):
                firing.add(check["alertname"])
    assert alerts == firing, f"alerts without a firing unit test: {alerts - firing}"
    result = run([promtool, "test", "rules", str(RULE_TESTS)], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
