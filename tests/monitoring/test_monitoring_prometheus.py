"""A real Prometheus (Debian's package) on loopback scraping fedmeta: the exporter (ledger) and the
live metrics of a run -- synthetic round records (fast) and a live `fedmeta simulate` (e2e)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.monitoring.conftest import FED, spend, synthetic_run, write_summary
from tests.monitoring.helpers import ROOT, free_port, http_get, need, prom_query, wait_for

from fedmeta.accounting import BudgetLedger

pytestmark = pytest.mark.integration

SCRAPE_WAIT_S = 25.0  # Prometheus 2.42 delays the first scrape of new targets by ~5 s


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture()
def prometheus(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], str]]:
    """Start a Prometheus scraping ``{job: "127.0.0.1:port"}`` every second; return its base URL."""
    binary = need("prometheus")
    procs: list[subprocess.Popen[bytes]] = []

    def start(targets: dict[str, str]) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            for job, target in targets.items()
        )
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n{jobs}"
        )
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: proc.poll() is None and "Ready" in http_get(f"{base}/-/ready"),
            20,
            what="prometheus /-/ready",
        )
        return base

    try:
        yield start
    finally:
        for proc in procs:
            _stop(proc)


def _exporter(db: Path, runs: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedmeta.cli",
            "exporter",
            "--db",
            str(db),
            "--runs-dir",
            str(runs),
            "--port",
            str(port),
        ],
        cwd=ROOT,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
    )
    wait_for(
        lambda: proc.poll() is None and http_get(f"http://127.0.0.1:{port}/metrics"),
        30,
        what="the fedmeta exporter",
    )
    return proc


def _value(base: str, expr: str) -> float | None:
    result = prom_query(base, expr)
    return float(result[0]["value"][1]) if len(result) == 1 else None


def _wait_value(base: str, expr: str, expected: float, rel: float = 1e-9) -> None:
    wait_for(
        lambda: (v := _value(base, expr)) is not None and math.isclose(v, expected, rel_tol=rel),
        SCRAPE_WAIT_S,
        interval=0.5,
        what=f"{expr} == {expected}",
    )


def test_exporter_and_observer_through_real_prometheus(tmp_path: Path, prometheus) -> None:
    from fedmeta.server.monitoring.live import make_observer

    db, runs = tmp_path / "ledger.sqlite", tmp_path / "runs"
    eps1 = spend(db, "run-1", 4)
    write_summary(runs / "run-1", "run-1", 4, eps1)
    exporter_port = free_port()
    exporter = _exporter(db, runs, exporter_port, tmp_path / "exporter.log")
    observer = make_observer(SimpleNamespace(metrics=SimpleNamespace(port=0, bind="127.0.0.1")))
    try:
        synthetic_run(observer, "run-1", 4, eps1)
        base = prometheus(
            {
                "fedmeta-exporter": f"127.0.0.1:{exporter_port}",
                "fedmeta-run": f"127.0.0.1:{observer.port}",
            }
        )
        summary = json.loads((runs / "run-1" / "summary.json").read_text())
        sel = f'{{federation="{FED}"}}'
        _wait_value(base, f"fedmeta_ledger_epsilon_spent_task{sel}", summary["epsilon_spent"])
        _wait_value(base, 'fedmeta_rounds_completed{run="run-1"}', summary["rounds_completed"])
        _wait_value(base, 'fedmeta_epsilon_spent_task{run="run-1"}', summary["epsilon_spent"])
        _wait_value(base, f"fedmeta_last_run_rounds_completed{sel}", 4)
        _wait_value(base, f"fedmeta_ledger_spends_total{sel}", 4)
        # A second run on the same federation: the exporter shows the composed total.
        eps2 = spend(db, "run-2", 3)
        assert eps2[0] > eps1[0]
        write_summary(runs / "run-2", "run-2", 3, eps2)
        _wait_value(base, f"fedmeta_ledger_epsilon_spent_task{sel}", eps2[0])
        _wait_value(base, f"fedmeta_ledger_spends_total{sel}", 7)
        _wait_value(base, f"fedmeta_ledger_budget_remaining_ratio{sel}", 1 - eps2[0] / 8.0)
        _wait_value(base, 'fedmeta_last_run_rounds_completed{run="run-2"}', 3)
        # The failure-ratio expression of the alert evaluates on real data (1 of 4 failed).
        _wait_value(
            base,
            'sum(fedmeta_participants_failed_total{run="run-1"}) / '
            'sum(fedmeta_participants_sampled_total{run="run-1"})',
            0.25,
        )
    finally:
        observer.close()
        _stop(exporter)


@pytest.mark.e2e
def test_live_simulate_run_through_real_prometheus(tmp_path: Path, prometheus) -> None:
    """Two short private sinusoid runs (in-process backend) on one federation and ledger."""
    db, runs = tmp_path / "ledger.sqlite", tmp_path / "runs"
    metrics_port, exporter_port = free_port(), free_port()
    base = prometheus(
        {
            "fedmeta-exporter": f"127.0.0.1:{exporter_port}",
            "fedmeta-run": f"127.0.0.1:{metrics_port}",
        }
    )
    env = {**os.environ, "FEDMETA_METRICS_LINGER_S": "6", "FLWR_TELEMETRY_ENABLED": "0"}
    exporter = None

    def simulate(name: str, rounds: int) -> dict:
        out = runs / name
        cmd = [
            sys.executable,
            "-m",
            "fedmeta.cli",
            "simulate",
            "--out",
            str(out),
            "--set",
            f"rounds={rounds}",
            "--set",
            "federation.backend=inprocess",
            "--set",
            "privacy.noise_multiplier=2.0",
            "--set",
            f"privacy.ledger_path={db}",
            "--set",
            "dataset.test_tasks=20",
            "--set",
            "training.eval_every=2",
            "--set",
            "output.progress=false",
            "--set",
            "output.plots=false",
            "--set",
            f"metrics.port={metrics_port}",
        ]
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                # While the run lingers after summary.json, Prometheus must see its final values.
                wait_for(
                    lambda: (out / "summary.json").is_file() or proc.poll() is not None,
                    240,
                    interval=0.5,
                    what=f"{name}'s summary.json",
                )
                assert (out / "summary.json").is_file(), (tmp_path / f"{name}.log").read_text()
                summary = json.loads((out / "summary.json").read_text())
                sel = f'{{run="{summary["run_id"]}"}}'
                _wait_value(
                    base,
                    f"last_over_time(fedmeta_rounds_completed{sel}[5m])",
                    summary["rounds_completed"],
                )
                _wait_value(
                    base,
                    f"last_over_time(fedmeta_epsilon_spent_task{sel}[5m])",
                    summary["epsilon_spent"],
                    rel=1e-9,
                )
                proc.wait(timeout=60)
            finally:
                _stop(proc)
        return summary

    try:
        first = simulate("first", 3)
        assert first["rounds_completed"] == 3 and first["private"]
        exporter = _exporter(db, runs, exporter_port, tmp_path / "exporter.log")
        fed = f'{{federation="{first["federation_id"]}"}}'
        _wait_value(base, f"fedmeta_ledger_epsilon_spent_task{fed}", first["epsilon_spent"])
        second = simulate("second", 2)
        assert second["federation_id"] == first["federation_id"]
        # Each run publishes its own epsilon (issue 52, item 6: nothing released depends on what
        # its data spent before); the ledger, and the exporter's view of it, compose both runs.
        assert second["epsilon_spent"] < first["epsilon_spent"]
        with BudgetLedger.open_readonly(db, first["federation_id"]) as ledger:
            composed = ledger.epsilon()
        assert composed > first["epsilon_spent"]
        _wait_value(base, f"fedmeta_ledger_epsilon_spent_task{fed}", composed)
        _wait_value(base, f"fedmeta_ledger_spends_total{fed}", 5)
        _wait_value(base, f"fedmeta_last_run_rounds_completed{fed}", 2)
    finally:
        if exporter is not None:
            _stop(exporter)
