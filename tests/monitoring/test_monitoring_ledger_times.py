"""No sub-round spend time leaves the ledger (issue 18, item 2): spends record the UTC day, and
the exporter publishes no spend timestamp."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from tests.monitoring.conftest import FED, spend


@pytest.mark.unit
def test_spends_record_the_day_and_the_exporter_publishes_no_spend_time(tmp_path: Path) -> None:
    from fedmeta.accounting import BudgetLedger
    from fedmeta.server.monitoring.ledger import LEDGER_METRICS, exporter_registry

    db = tmp_path / "ledger.sqlite"
    spend(db, "run-1", 2)
    with BudgetLedger.open_readonly(db, FED) as ledger:
        days = {r.created_at for r in ledger.records()}
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", day) for day in days), days
    registry, collector = exporter_registry(db, affordable=False)
    try:
        page = generate_latest(registry).decode()
    finally:
        collector.close()
    assert "fedmeta_ledger_spends_total" in page
    ledger_families = [n for n in LEDGER_METRICS if n.startswith("fedmeta_ledger_")]
    assert not any("timestamp" in name for name in ledger_families)
    assert "spend_timestamp" not in page
