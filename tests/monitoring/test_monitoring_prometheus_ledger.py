"""A real Prometheus scraping ``fedmeta exporter`` subprocesses whose ledger is missing, not SQLite,
replaced on disk, or on a read-only mount: each case is visible in PromQL, none is silent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import tests.monitoring.test_monitoring_prometheus as prom
from tests.accounting.readonly_mount import need_readonly_mount
from tests.monitoring.conftest import FED, gaussian_round, spend
from tests.monitoring.helpers import ROOT, free_port, http_get, wait_for
from tests.monitoring.test_monitoring_prometheus import _stop, _wait_value

# The real-Prometheus fixture of test_monitoring_prometheus.py, shared (one definition).
prometheus = prom.prometheus

pytestmark = pytest.mark.integration


def _exporter(
    db: Path, port: int, log: Path, prefix: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "fedmeta.cli", "exporter", "--db", str(db), "--port",
         str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=open(log, "wb"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_for(
        lambda: proc.poll() is None and http_get(f"http://127.0.0.1:{port}/metrics"),
        60,
        what=f"the fedmeta exporter for {db.name}",
    )
    return proc


def test_unreadable_and_replaced_ledgers_through_real_prometheus(
    tmp_path: Path, prometheus
) -> None:
    from fedmeta.accounting import BudgetLedger, backup

    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a ledger" * 100)
    db = tmp_path / "ledger.sqlite"
    spend(db, "run-1", 3)
    restored = tmp_path / "restored.sqlite"
    backup(db, restored)
    spend(restored, "run-2", 4)
    ports = {name: free_port() for name in ("missing", "junk", "replaced")}
    dbs = {"missing": tmp_path / "missing.sqlite", "junk": junk, "replaced": db}
    procs = [_exporter(dbs[name], port, tmp_path / f"{name}.log") for name, port in ports.items()]
    try:
        base = prometheus({name: f"127.0.0.1:{port}" for name, port in ports.items()})
        for name, reason in (("missing", "missing"), ("junk", "not_sqlite")):
            _wait_value(base, f'fedmeta_ledger_readable{{job="{name}",reason="{reason}"}}', 0)
        sel = f'{{job="replaced",federation="{FED}"}}'
        _wait_value(base, 'fedmeta_ledger_readable{job="replaced",reason="ok"}', 1)
        _wait_value(base, f"fedmeta_ledger_spends_total{sel}", 3)
        staged = tmp_path / "staged.sqlite"
        shutil.copyfile(restored, staged)
        os.replace(staged, db)  # a restore: copy, then rename over the ledger
        _wait_value(base, f"fedmeta_ledger_spends_total{sel}", 7)
        with BudgetLedger.open_readonly(db, FED) as ledger:
            exact = ledger.rounds_affordable(gaussian_round())
            eps = ledger.epsilon()
        _wait_value(base, f"fedmeta_ledger_epsilon_spent_task{sel}", eps)
        _wait_value(base, f"fedmeta_ledger_rounds_affordable{sel}", exact)
    finally:
        for proc in procs:
            _stop(proc)


def test_a_ledger_on_a_read_only_mount_through_real_prometheus(tmp_path: Path, prometheus) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "ledger.sqlite"
    eps = spend(db, "run-1", 3)
    prefix = need_readonly_mount(state)
    port = free_port()
    proc = _exporter(db, port, tmp_path / "exporter.log", prefix)
    try:
        base = prometheus({"readonly": f"127.0.0.1:{port}"})
        _wait_value(base, 'fedmeta_ledger_readable{job="readonly",reason="ok"}', 1)
        _wait_value(base, f'fedmeta_ledger_epsilon_spent_task{{federation="{FED}"}}', eps[0])
        _wait_value(base, f'fedmeta_ledger_spends_total{{federation="{FED}"}}', 3)
    finally:
        _stop(proc)
    # Nothing new: the anchor was written by the spends before, not by reading.
    assert sorted(p.name for p in state.iterdir()) == ["ledger.sqlite", "ledger.sqlite.anchor"]
