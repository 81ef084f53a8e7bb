"""The exporter tells the truth or says it cannot (issue 13, item 4), scraped in-process.

Rounds affordable is computed for the position it is reported with; a replaced or overwritten
ledger file is followed; a missing, non-SQLite or corrupted file shows as
``fedmeta_ledger_readable 0`` with a reason; a ledger on a read-only mount is read normally.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from tests.accounting.readonly_mount import need_readonly_mount
from tests.monitoring.conftest import FED, gaussian_round, spend
from tests.monitoring.helpers import ROOT, wait_for

# Unit tests unless marked otherwise (tests/conftest.py).


def _scrape(registry: Any) -> str:
    from prometheus_client import generate_latest

    return str(generate_latest(registry).decode())


def _sample(text: str, name: str, **labels: str) -> float | None:
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return None


def _exact_affordable(db: Path) -> int:
    from fedmeta.accounting import BudgetLedger

    with BudgetLedger.open_readonly(db, FED) as ledger:
        return int(ledger.rounds_affordable(gaussian_round()))


def test_rounds_affordable_is_computed_for_the_position_it_is_reported_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug: a background search finished after more spends and was stored as the old
    position's value, so the new spends were subtracted twice (0 shown with 5 rounds left)."""
    import fedmeta.accounting.calibration as ledger_module  # where the search is looked up
    from fedmeta.accounting import BudgetLedger
    from fedmeta.server.monitoring.ledger import exporter_registry

    db = tmp_path / "ledger.sqlite"
    spend(db, "run-1", 2)
    gate, entered = threading.Event(), threading.Event()
    real_search = ledger_module.max_rounds
    real_affordable = BudgetLedger.rounds_affordable

    def in_exporter() -> bool:
        return threading.current_thread().name.startswith("fedmeta-ledger")

    def search(*args: Any, **kwargs: Any) -> int:
        if in_exporter():
            entered.set()
            assert gate.wait(120)
        return int(real_search(*args, **kwargs))

    def affordable(self: Any, event: Any) -> int:  # where an exporter used to start its search
        if in_exporter():
            entered.set()
            assert gate.wait(120)
        return int(real_affordable(self, event))

    monkeypatch.setattr(ledger_module, "max_rounds", search)
    monkeypatch.setattr(BudgetLedger, "rounds_affordable", affordable)
    registry, collector = exporter_registry(db)
    try:
        first = _scrape(registry)  # position 2: starts the background search, which waits
        assert _sample(first, "fedmeta_ledger_spends_total") == 2.0
        assert entered.wait(60)
        spend(db, "run-1", 3, start=2)  # three more spends land before the search finishes
        gate.set()
        exact = _exact_affordable(db)

        def with_affordable() -> str | None:
            page = _scrape(registry)
            return page if _sample(page, "fedmeta_ledger_rounds_affordable") is not None else None

        page = wait_for(with_affordable, 120, interval=0.5, what="rounds affordable")
        assert _sample(page, "fedmeta_ledger_spends_total") == 5.0
        assert _sample(page, "fedmeta_ledger_rounds_affordable") == exact
        spend(db, "run-1", 1, start=5)  # exact without a new search: one round fewer
        page = _scrape(registry)
        assert _sample(page, "fedmeta_ledger_rounds_affordable") == exact - 1
        assert _exact_affordable(db) == exact - 1
    finally:
        gate.set()
        collector.close()


def test_a_replaced_or_overwritten_ledger_file_is_followed(tmp_path: Path) -> None:
    from fedmeta.accounting import backup
    from fedmeta.server.monitoring.ledger import exporter_registry

    db = tmp_path / "ledger.sqlite"
    spend(db, "run-1", 3)
    bigger = tmp_path / "restored.sqlite"
    backup(db, bigger)
    spend(bigger, "run-2", 4)
    registry, collector = exporter_registry(db, affordable=False)
    try:
        assert _sample(_scrape(registry), "fedmeta_ledger_spends_total") == 3.0
        staged = tmp_path / "staged.sqlite"
        shutil.copyfile(bigger, staged)
        os.replace(staged, db)  # copy, then rename over it: what backups and restores do
        assert _sample(_scrape(registry), "fedmeta_ledger_spends_total") == 7.0
        spend(bigger, "run-3", 1)
        shutil.copyfile(bigger, db)  # overwritten in place: same inode, longer history
        page = _scrape(registry)
        assert _sample(page, "fedmeta_ledger_spends_total") == 8.0
        assert _sample(page, "fedmeta_ledger_readable", reason="ok") == 1.0
    finally:
        collector.close()


def test_an_unreadable_ledger_is_reported_with_its_reason(tmp_path: Path) -> None:
    from fedmeta.server.monitoring.ledger import exporter_registry

    cases: dict[str, Path] = {}
    cases["missing"] = tmp_path / "missing.sqlite"
    cases["not_sqlite"] = tmp_path / "junk.sqlite"
    cases["not_sqlite"].write_bytes(b"definitely not SQLite" * 40)
    cases["not_ledger"] = tmp_path / "other.sqlite"
    conn = sqlite3.connect(cases["not_ledger"])
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    cases["corrupted"] = tmp_path / "tampered.sqlite"
    spend(cases["corrupted"], "run-1", 2)
    conn = sqlite3.connect(cases["corrupted"])
    conn.execute("DROP TRIGGER spends_append_only_update")
    conn.execute("UPDATE spends SET round_index = 7 WHERE position = 0")
    conn.commit()
    conn.close()
    for reason, path in cases.items():
        registry, collector = exporter_registry(path, affordable=False)
        try:
            page = _scrape(registry)
        finally:
            collector.close()
        db = str(path.absolute())
        assert _sample(page, "fedmeta_ledger_readable", db=db, reason=reason) == 0.0, page
        assert "fedmeta_ledger_epsilon_spent_task{" not in page
        if reason == "corrupted":  # the federation itself is named as down
            assert _sample(page, "fedmeta_ledger_up", federation=FED) == 0.0


_READONLY_SCRAPE = textwrap.dedent(
    """
    import sys
    from prometheus_client import generate_latest
    from fedmeta.server.monitoring.ledger import exporter_registry
    registry, collector = exporter_registry(sys.argv[1], affordable=False)
    # One scrape that must read the ledger: a slow first read (a loaded machine) is waited for
    # rather than answered with the empty last snapshot that a live scrape gets after 8 s.
    collector.read_timeout_s = 240.0
    print(generate_latest(registry).decode())
    collector.close()
    """
)


@pytest.mark.integration
def test_a_ledger_on_a_read_only_mount_is_exported(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "ledger.sqlite"
    eps = spend(db, "run-1", 3)
    prefix = need_readonly_mount(state)
    before = (db.read_bytes(), db.stat().st_mtime_ns)
    result = subprocess.run(
        [*prefix, sys.executable, "-c", _READONLY_SCRAPE, str(db)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    page = result.stdout
    assert _sample(page, "fedmeta_ledger_readable", reason="ok") == 1.0, page
    assert _sample(page, "fedmeta_ledger_epsilon_spent_task", federation=FED) == eps[0]
    assert _sample(page, "fedmeta_ledger_spends_total", federation=FED) == 3.0
    assert (db.read_bytes(), db.stat().st_mtime_ns) == before
    # Nothing new: the anchor was written by the spends before, not by reading.
    assert sorted(p.name for p in state.iterdir()) == ["ledger.sqlite", "ledger.sqlite.anchor"]
