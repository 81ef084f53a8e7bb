"""The Grafana dashboard as data: schema essentials, PromQL through promtool, metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from tests.monitoring.helpers import DASHBOARD, DEPLOY, METRIC_IN_PROMQL, RULES, need, run

pytestmark = pytest.mark.integration

_DS = {
    "type": "object",
    "required": ["type", "uid"],
    "properties": {"type": {"const": "prometheus"}, "uid": {"const": "fedmeta-prometheus"}},
}
_GRID = {
    "type": "object",
    "required": ["x", "y", "w", "h"],
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 23},
        "y": {"type": "integer", "minimum": 0},
        "w": {"type": "integer", "minimum": 1, "maximum": 24},
        "h": {"type": "integer", "minimum": 1},
    },
}
#: The parts of Grafana's dashboard JSON model (schemaVersion 39) this dashboard uses.
DASHBOARD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "version": {"type": "integer"},
        "editable": {"type": "boolean"},
        "refresh": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "type"],
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                            "type": {
                                "enum": [
                                    "query",
                                    "custom",
                                    "constant",
                                    "datasource",
                                    "interval",
                                    "textbox",
                                ]
                            },
                            "datasource": _DS,
                            "multi": {"type": "boolean"},
                            "includeAll": {"type": "boolean"},
                        },
                    },
                }
            },
        },
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos", "targets", "datasource"],
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "type": {
                        "enum": [
                            "gauge",
                            "stat",
                            "timeseries",
                            "xychart",
                            "bargauge",
                            "table",
                            "text",
                        ]
                    },
                    "title": {"type": "string", "minLength": 1},
                    "description": {"type": "string"},
                    "gridPos": _GRID,
                    "datasource": _DS,
                    "fieldConfig": {
                        "type": "object",
                        "required": ["defaults", "overrides"],
                        "properties": {
                            "defaults": {"type": "object"},
                            "overrides": {"type": "array"},
                        },
                    },
                    "targets": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["refId", "expr"],
                            "properties": {
                                "refId": {"type": "string", "pattern": "^[A-Z]$"},
                                "expr": {"type": "string", "minLength": 1},
                                "legendFormat": {"type": "string"},
                                "datasource": _DS,
                            },
                        },
                    },
                },
            },
        },
    },
}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _dashboard()["panels"] for t in p["targets"]]


def _grafana_to_promql(expr: str) -> str:
    """Substitute Grafana's variables with what they expand to."""
    for var, value in (
        ("$__rate_interval", "1m"),
        ("$__interval", "1m"),
        ("$__range", "1h"),
        ("$federation", ".*"),
    ):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def test_dashboard_matches_schema_and_has_the_required_panels() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    dash = _dashboard()
    jsonschema.validate(dash, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
    text = json.dumps(dash)
    # The panel list, by the metric each one must show.
    for needed in (
        "fedmeta_ledger_budget_remaining_ratio",  # budget gauge
        "fedmeta_ledger_epsilon_spent_task",  # eps over time, task level
        "fedmeta_ledger_epsilon_spent_participant",  # ... participant level
        "fedmeta_validation_metric",  # validation metric vs eps
        "fedmeta_round_duration_seconds_bucket",  # round duration
        "fedmeta_participants_sampled_total",
        "fedmeta_participants_replied_total",
        "fedmeta_participants_failed_total",
        "fedmeta_replies_rejected_total",
        "fedmeta_clipped_tasks_ratio",
    ):
        assert needed in text, f"the dashboard has no panel on {needed}"
    assert any(p["type"] == "gauge" for p in dash["panels"])


def test_provisioning_points_at_the_dashboard_and_datasource() -> None:
    yaml = pytest.importorskip("yaml")
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in ds["datasources"] if d["type"] == "prometheus"}
    assert "fedmeta-prometheus" in uids
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/fedmeta.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_every_panel_query_passes_promtool(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    promtool = need("promtool")
    rules = [
        {"record": f"fedmeta:dashboard_panel_{i}", "expr": _grafana_to_promql(expr)}
        for i, (_title, expr) in enumerate(_exprs())
    ]
    # The variable query too.
    for var in _dashboard()["templating"]["list"]:
        m = re.match(r"label_values\((.*),\s*\w+\)$", var["definition"])
        assert m, var
        rules.append({"record": f"fedmeta:dashboard_var_{var['name']}", "expr": m.group(1)})
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = run([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def _used_metrics() -> set[str]:
    used = set()
    for _title, expr in _exprs():
        used |= set(METRIC_IN_PROMQL.findall(expr))
    for var in _dashboard()["templating"]["list"]:
        used |= set(METRIC_IN_PROMQL.findall(var["definition"]))
    used |= set(METRIC_IN_PROMQL.findall(RULES.read_text()))
    return used


def test_every_metric_used_by_a_panel_or_alert_is_exported(exposition: str) -> None:
    from tests.monitoring.helpers import exposed_names

    exported = exposed_names(exposition)
    missing = sorted(_used_metrics() - exported)
    assert not missing, f"used by the dashboard/alerts but not exported by fedmeta: {missing}"
