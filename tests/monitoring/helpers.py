"""Shared helpers for the monitoring tests: tool lookup, free ports, bounded waits, scraping."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedmeta.cli.deploy_local import free_port as free_port  # the one helper, re-exported

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROM_DIR = DEPLOY / "prometheus"
RULES = PROM_DIR / "rules" / "fedmeta-alerts.yml"
RULE_TESTS = PROM_DIR / "tests" / "fedmeta-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fedmeta.json"


def need(tool: str) -> str:
    """Path of ``tool`` or skip with a clear reason."""
    path = shutil.which(tool)
    if path is None:
        pytest.skip(
            f"`{tool}` is not installed (Debian package `prometheus`; .ci/run installs it with "
            "`apt-get install -y prometheus`)"
        )
    return path


def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def wait_for(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.25, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as error:  # noqa: BLE001 - retried until the deadline
            last_error = error
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what} (last error: {last_error})"
    )


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
        return response.read().decode()


def prom_query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(http_get(url))
    assert body["status"] == "success", body
    return list(body["data"]["result"])


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s")


def exposed_names(text: str) -> set[str]:
    """Metric family names in an exposition page, with and without sample suffixes."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            if m:
                names.add(m.group(1))
    return names


METRIC_IN_PROMQL = re.compile(r"\bfedmeta_[a-zA-Z0-9_:]*")
