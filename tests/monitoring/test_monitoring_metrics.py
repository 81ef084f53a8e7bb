"""fedmeta.server.monitoring and fedmeta.server.exporter without Prometheus: names, labels, faults.
"""

from __future__ import annotations

import argparse
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tests.monitoring.conftest import FED, spend, synthetic_run, write_summary
from tests.monitoring.helpers import exposed_names, free_port, http_get

from fedmeta.server.report import RoundDiagnostics, RoundOutcome

pytestmark = pytest.mark.unit

ALLOWED_LABELS = {"federation", "run", "reason", "quantile", "le", "db"}


def _families(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def test_names_follow_prometheus_conventions(exposition: str) -> None:
    from fedmeta.server.monitoring.ledger import LEDGER_METRICS
    from fedmeta.server.monitoring.live import LIVE_METRICS

    families = _families(exposition)
    assert set(LIVE_METRICS) | set(LEDGER_METRICS) == set(families), "declared list is stale"
    for name, kind in families.items():
        assert name.startswith("fedmeta_"), name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
    # Base units only: no milliseconds, no percent.
    assert not any(re.search(r"_(ms|milliseconds|percent|minutes)\b", n) for n in families)


def test_labels_are_low_cardinality_and_never_ids(exposition: str) -> None:
    for line in exposition.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        labels = set(re.findall(r'(\w+)="', line.split("}")[0]))
        assert labels <= ALLOWED_LABELS, line
        assert "participant" not in line.split("{")[1].split("}")[0], line


def test_private_diagnostics_only_when_present() -> None:
    from prometheus_client import generate_latest

    from fedmeta.server.monitoring.live import PrometheusRunObserver

    obs = PrometheusRunObserver()
    synthetic_run(obs, "r-private", 2, (0.5, 5.0), diagnostics=False)
    text = generate_latest(obs.registry).decode()
    samples = {n for n in exposed_names(text) if not text.count(f"# TYPE {n} ")}
    assert "fedmeta_clipped_tasks_ratio" not in samples
    assert "fedmeta_pre_clip_norm" not in samples
    assert 'fedmeta_epsilon_spent_task{federation="sinusoid-test",run="r-private"} 0.5' in text
    obs2 = PrometheusRunObserver()
    synthetic_run(obs2, "r-diag", 2, (0.5, 5.0), diagnostics=True)
    text2 = generate_latest(obs2.registry).decode()
    assert 'fedmeta_clipped_tasks_ratio{federation="sinusoid-test",run="r-diag"} 0.25' in text2
    assert 'quantile="0.9"' in text2


def test_observer_never_raises_on_garbage() -> None:
    from fedmeta.server.monitoring.live import PrometheusRunObserver

    obs = PrometheusRunObserver()
    obs.run_started(object())  # type: ignore[arg-type]
    obs.round_finished(
        RoundOutcome(
            run_id="r",
            federation_id=FED,
            round=1,
            participants_registered=1,
            participants_sampled=1,
            participants_failed=1,
            train_loss=float("nan"),
            epsilon_task=float("inf"),
            diagnostics=RoundDiagnostics(
                1, 0, 0, 0, None, {0.5: float("nan")}, 0.1, 0.0, (float("nan"),)
            ),  # fmt: skip
        )
    )
    obs.run_finished(None)  # type: ignore[arg-type]


def test_make_observer_serves_and_survives_a_taken_port() -> None:
    from fedmeta.server.monitoring.live import make_observer

    cfg = SimpleNamespace(metrics=SimpleNamespace(port=0, bind="127.0.0.1"))
    obs = make_observer(cfg)
    try:
        assert obs.port
        synthetic_run(obs, "served", 2, (0.3, 3.0))
        text = http_get(f"http://127.0.0.1:{obs.port}/metrics")
        assert 'fedmeta_rounds_completed{federation="sinusoid-test",run="served"} 2.0' in text
        # A second observer on the same port: logged, no exception, the run goes on.
        taken = make_observer(
            SimpleNamespace(metrics=SimpleNamespace(port=obs.port, bind="127.0.0.1"))
        )
        assert taken.server is None
        synthetic_run(taken, "unserved", 1, (0.1, 1.0))
    finally:
        obs.close()


def test_exporter_reads_the_ledger_on_every_scrape(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from fedmeta.server.monitoring.ledger import exporter_registry

    db = tmp_path / "ledger.sqlite"
    registry, collector = exporter_registry(db, [tmp_path / "runs"])
    try:
        assert "fedmeta_ledger_up{" not in generate_latest(registry).decode()  # no ledger yet
        eps1 = spend(db, "run-1", 2)
        text = generate_latest(registry).decode()
        assert f'fedmeta_ledger_epsilon_spent_task{{federation="{FED}"}} {eps1[0]!r}' in text
        assert f'fedmeta_ledger_spends_total{{federation="{FED}"}} 2.0' in text
        eps2 = spend(db, "run-2", 3, start=0)
        write_summary(tmp_path / "runs" / "b", "run-2", 3, eps2)
        text = generate_latest(registry).decode()
        assert eps2[0] > eps1[0]
        assert f'fedmeta_ledger_epsilon_spent_task{{federation="{FED}"}} {eps2[0]!r}' in text
        assert f'fedmeta_ledger_spends_total{{federation="{FED}"}} 5.0' in text
        assert f'fedmeta_last_run_rounds_completed{{federation="{FED}",run="run-2"}} 3.0' in text
        # The search runs in the background: a scrape shows its result once it has finished.
        assert _affordable(registry) is not None
    finally:
        collector.close()


def _sample(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _affordable(registry: Any, timeout_s: float = 120) -> float | None:
    """The rounds-affordable gauge from the first scrape after the background search is done.

    The search is a PLD composition on a worker thread; on a loaded machine it can take seconds,
    and until it ends the gauge is absent by design.
    """
    from prometheus_client import generate_latest

    deadline = time.monotonic() + timeout_s
    while True:
        value = _sample(generate_latest(registry).decode(), "fedmeta_ledger_rounds_affordable")
        if value is not None or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_exporter_scrapes_from_many_threads_and_tracks_affordable_exactly(tmp_path: Path) -> None:
    import threading

    from prometheus_client import generate_latest
    from tests.monitoring.conftest import gaussian_round

    from fedmeta.accounting import BudgetLedger
    from fedmeta.server.monitoring.ledger import exporter_registry

    db = tmp_path / "ledger.sqlite"
    spend(db, "run-1", 2)
    registry, collector = exporter_registry(db)
    try:
        generate_latest(registry)
        for start in (2, 3, 5):
            spend(db, "run-1", 1 if start < 5 else 2, start=start)
            pages: list[str] = []
            threads = [
                threading.Thread(
                    target=lambda pages=pages: pages.append(generate_latest(registry).decode())
                )
                for _ in range(3)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert len(pages) == 3
            for page in pages:
                assert _sample(page, "fedmeta_ledger_up") == 1.0
            with BudgetLedger.open(db, FED, create=False) as ledger:
                exact = ledger.rounds_affordable(gaussian_round())
            assert _affordable(registry) == exact
    finally:
        collector.close()


def test_exporter_reports_a_tampered_ledger_as_down(tmp_path: Path) -> None:
    import sqlite3

    from prometheus_client import generate_latest

    from fedmeta.server.monitoring.ledger import exporter_registry

    db = tmp_path / "ledger.sqlite"
    spend(db, "run-1", 2)
    conn = sqlite3.connect(db)
    for trigger in ("spends_append_only_update", "spends_append_only_delete"):
        conn.execute(f"DROP TRIGGER IF EXISTS {trigger}")
    conn.execute("UPDATE spends SET round_index = 7 WHERE position = 0")
    conn.commit()
    conn.close()
    registry, collector = exporter_registry(db)
    try:
        text = generate_latest(registry).decode()
        assert f'fedmeta_ledger_up{{federation="{FED}"}} 0.0' in text
        assert "fedmeta_ledger_epsilon_spent_task{" not in text
    finally:
        collector.close()


def test_exporter_cli_registers_with_localhost_default() -> None:
    from fedmeta.server import exporter

    parser = argparse.ArgumentParser()
    exporter.register(parser.add_subparsers())
    args = parser.parse_args(["exporter", "--db", "x.sqlite"])
    assert args.bind == "127.0.0.1" and args.port == exporter.DEFAULT_PORT
    args = parser.parse_args(
        [
            "exporter",
            "--db",
            "x",
            "--port",
            "0",
            "--bind",
            "::1",
            "--runs-dir",
            "a",
            "--runs-dir",
            "b",
        ]
    )
    assert args.runs_dir == ["a", "b"] and args.port == 0


def test_free_port_helper_gives_a_bindable_port() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
