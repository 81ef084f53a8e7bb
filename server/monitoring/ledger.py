"""The ledger exporter's collector: the budget ledger's cumulative state, re-read on every scrape.

A run's live metrics (``server/monitoring/live.py``) last only as long as the run; the privacy
budget outlives runs. ``LedgerCollector`` re-reads the SQLite ledger (and the latest
``summary.json`` of each federation under the run directories) on every scrape and is served by
``fedmeta exporter`` (server/exporter.py). Labels: ``federation`` (and ``run`` on the latest-run
records).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.monitoring.live import FED_LABELS, _finite, _remaining

log = logging.getLogger("fedmeta.metrics")

#: Exporter (ledger) metric names.
LEDGER_METRICS: tuple[str, ...] = (
    "fedmeta_ledger_up",
    "fedmeta_ledger_epsilon_spent_task",
    "fedmeta_ledger_epsilon_spent_participant",
    "fedmeta_ledger_epsilon_budget",
    "fedmeta_ledger_delta",
    "fedmeta_ledger_budget_remaining_ratio",
    "fedmeta_ledger_rounds_affordable",
    "fedmeta_ledger_spends_total",
    "fedmeta_ledger_last_spend_timestamp_seconds",
    "fedmeta_last_run_rounds_completed",
    "fedmeta_last_run_epsilon_spent_task",
    "fedmeta_last_run_epsilon_spent_participant",
    "fedmeta_last_run_final_metric",
    "fedmeta_last_run_stopped",
    "fedmeta_last_run_timestamp_seconds",
    "fedmeta_exporter_scrape_duration_seconds",
)


class _FederationCache:
    """What one federation's gauges cost to compute, cached by ledger position."""

    def __init__(self) -> None:
        self.position = -1
        self.event: Any = None
        self.values: dict[str, float] = {}


class LedgerCollector(Collector):
    """Re-reads the SQLite ledger (and run directories) on every scrape.

    Reads go through accounting's public ``BudgetLedger.federations`` and
    ``BudgetLedger.open(..., create=False)``. All ledger work runs on one worker thread (SQLite
    connections belong to the thread that opened them; the HTTP server answers each scrape on a new
    thread). Epsilon is recomputed only when the ledger's position changed; rounds affordable
    (a PLD search, seconds) is updated exactly without a search while the new spends repeat the
    last recorded round (each costs one affordable round), and otherwise recomputed in the
    background and left out until known. A read slower than ``read_timeout_s`` serves the last
    snapshot.
    """

    def __init__(
        self,
        db: str | Path,
        runs_dirs: Iterable[str | Path] = (),
        *,
        affordable: bool = True,
        read_timeout_s: float = 8.0,
    ) -> None:
        self.db = Path(db)
        self.runs_dirs = [Path(d) for d in runs_dirs]
        self.affordable = affordable
        self.read_timeout_s = read_timeout_s
        self._ledgers: dict[str, Any] = {}
        self._cache: dict[str, _FederationCache] = {}
        self._snapshot: list[tuple[str, dict[str, float] | None]] = []
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedmeta-ledger")

    def describe(self) -> list[Metric]:
        """Describe nothing up front (an unchecked collector)."""
        return []  # unchecked collector: the families depend on the ledger's content

    # -------------------------------------------------------------- on the worker thread only
    def _ledger(self, fed: str) -> Any:
        from accounting import BudgetLedger  # light: stdlib + numpy/scipy/dp-accounting

        ledger = self._ledgers.get(fed)
        if ledger is None:
            ledger = BudgetLedger.open(self.db, fed, create=False)
            self._ledgers[fed] = ledger
        return ledger

    def _drop(self, fed: str) -> None:
        stale = self._ledgers.pop(fed, None)
        if stale is not None:
            try:
                stale.close()
            except Exception:  # noqa: BLE001
                pass
        self._cache.pop(fed, None)

    def _federation_values(self, fed: str) -> dict[str, float]:
        ledger = self._ledger(fed)
        cache = self._cache.setdefault(fed, _FederationCache())
        position = int(ledger.position())
        if position == cache.position:
            return cache.values
        records = ledger.records()
        budget = float(ledger.epsilon_budget)
        values: dict[str, float] = {
            "budget": budget,
            "delta": float(ledger.delta),
            "spends": float(position),
        }
        event = None
        if records:
            # Same methods as the round loop (server/privacy.py): task level PLD (enforced),
            # participant level RDP (reported).
            eps_task = float(ledger.epsilon(unit="task", method="pld"))
            try:
                eps_part = float(ledger.epsilon(unit="participant", method="rdp"))
            except Exception:  # noqa: BLE001 - e.g. a scheme without a participant-level bound
                eps_part = math.nan
            event = records[-1].event
            values["last_ts"] = _parse_ts(records[-1].created_at)
            if self.affordable:
                previous = cache.values.get("affordable")
                same = (
                    previous is not None
                    and 0 <= cache.position < position
                    and cache.event == event
                    and all(r.event == event for r in records[cache.position :])
                )
                if same:
                    values["affordable"] = max(0.0, previous - (position - cache.position))  # type: ignore[operator]
                else:
                    self._worker.submit(self._refresh_affordable, fed, position, event)
        else:
            eps_task, eps_part = 0.0, 0.0
        values["eps_task"] = eps_task
        values["eps_part"] = eps_part
        values["remaining"] = _remaining(eps_task, budget) or 0.0
        cache.position, cache.event, cache.values = position, event, values
        return values

    def _refresh_affordable(self, fed: str, position: int, event: Any) -> None:
        try:
            cache = self._cache.get(fed)
            if cache is None or cache.position != position:
                return  # superseded by a newer read
            value = float(self._ledger(fed).rounds_affordable(event))
            if cache.position == position:
                cache.values["affordable"] = value
        except Exception:  # noqa: BLE001 - never crash the worker
            log.exception("could not compute rounds affordable for %r", fed)

    def _read_ledgers(self) -> list[tuple[str, dict[str, float] | None]]:
        out: list[tuple[str, dict[str, float] | None]] = []
        if not self.db.is_file():
            return out
        try:
            from accounting import BudgetLedger

            feds = list(BudgetLedger.federations(self.db))
        except Exception:  # noqa: BLE001 - a scrape never crashes the exporter
            log.exception("could not list the federations in %s", self.db)
            return out
        for fed in feds:
            try:
                out.append((fed, dict(self._federation_values(fed))))
            except Exception:  # noqa: BLE001 - e.g. LedgerCorrupted: report down, keep serving
                log.exception("could not read federation %r from %s", fed, self.db)
                self._drop(fed)
                out.append((fed, None))
        return out

    # --------------------------------------------------------------------------- scrape thread
    def collect(self) -> Iterator[Metric]:
        """Read the ledger and run records now (called on every scrape)."""
        t0 = time.perf_counter()
        with self._lock:
            yield from self._collect()
        d = GaugeMetricFamily(
            "fedmeta_exporter_scrape_duration_seconds", "Time to read the ledger and run records."
        )
        d.add_metric([], time.perf_counter() - t0)
        yield d

    def _collect(self) -> Iterator[Metric]:
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "up": GaugeMetricFamily(
                "fedmeta_ledger_up",
                "1 if the federation's ledger was read and verified on this scrape, else 0.",
                labels=FED_LABELS,
            ),
            "eps_task": GaugeMetricFamily(
                "fedmeta_ledger_epsilon_spent_task",
                "Task-level epsilon spent (PLD, enforced).",
                labels=FED_LABELS,
            ),
            "eps_part": GaugeMetricFamily(
                "fedmeta_ledger_epsilon_spent_participant",
                "Participant-level epsilon spent (RDP, reported).",
                labels=FED_LABELS,
            ),
            "budget": GaugeMetricFamily(
                "fedmeta_ledger_epsilon_budget", "Task-level epsilon budget.", labels=FED_LABELS
            ),
            "delta": GaugeMetricFamily(
                "fedmeta_ledger_delta", "Delta of the guarantee.", labels=FED_LABELS
            ),
            "remaining": GaugeMetricFamily(
                "fedmeta_ledger_budget_remaining_ratio",
                "Fraction of the epsilon budget left.",
                labels=FED_LABELS,
            ),
            "affordable": GaugeMetricFamily(
                "fedmeta_ledger_rounds_affordable",
                "More rounds like the last recorded one the budget allows.",
                labels=FED_LABELS,
            ),
            "spends": CounterMetricFamily(
                "fedmeta_ledger_spends",
                "Spends (rounds) recorded in the ledger.",
                labels=FED_LABELS,
            ),
            "last_ts": GaugeMetricFamily(
                "fedmeta_ledger_last_spend_timestamp_seconds",
                "Unix time of the last recorded spend.",
                labels=FED_LABELS,
            ),
        }
        try:
            snapshot = self._worker.submit(self._read_ledgers).result(self.read_timeout_s)
            self._snapshot = snapshot
        except FutureTimeout:
            log.warning(
                "ledger read slower than %.1fs: serving the last snapshot", self.read_timeout_s
            )
            snapshot = self._snapshot
        except Exception:  # noqa: BLE001
            log.exception("ledger read failed")
            snapshot = []
        for fed, values in snapshot:
            fams["up"].add_metric([fed], 0 if values is None else 1)
            for key, value in (values or {}).items():
                if key in fams and _finite(value):
                    fams[key].add_metric([fed], value)
        yield from fams.values()
        yield from self._run_records()

    def _run_records(self) -> Iterator[Metric]:
        """Yield the latest ``summary.json`` per federation under the run directories."""
        latest: dict[str, tuple[float, dict[str, Any]]] = {}
        for root in self.runs_dirs:
            if not root.is_dir():
                continue
            for path in [
                root / "summary.json",
                *root.glob("*/summary.json"),
                *root.glob("*/*/summary.json"),
            ]:
                try:
                    mtime = path.stat().st_mtime
                    summary = json.loads(path.read_text())
                    fed = str(summary["federation_id"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                if fed not in latest or mtime > latest[fed][0]:
                    latest[fed] = (mtime, summary)
        labels = (*FED_LABELS, "run")
        fams = {
            "rounds_completed": GaugeMetricFamily(
                "fedmeta_last_run_rounds_completed",
                "Rounds completed by the latest finished run.",
                labels=labels,
            ),
            "epsilon_spent": GaugeMetricFamily(
                "fedmeta_last_run_epsilon_spent_task",
                "Task-level epsilon after the latest run.",
                labels=labels,
            ),
            "epsilon_participant_level": GaugeMetricFamily(
                "fedmeta_last_run_epsilon_spent_participant",
                "Participant-level epsilon after the latest run.",
                labels=labels,
            ),
            "final_metric": GaugeMetricFamily(
                "fedmeta_last_run_final_metric",
                "Final test metric of the latest run.",
                labels=labels,
            ),
        }
        stopped = GaugeMetricFamily(
            "fedmeta_last_run_stopped",
            "1 for the latest run's stop reason.",
            labels=(*labels, "reason"),
        )
        ts = GaugeMetricFamily(
            "fedmeta_last_run_timestamp_seconds",
            "Unix time the latest run's summary.json was written.",
            labels=labels,
        )
        for fed, (mtime, summary) in sorted(latest.items()):
            lab = [fed, str(summary.get("run_id", ""))]
            for key, fam in fams.items():
                value = summary.get(key)
                if isinstance(value, int | float) and _finite(value):
                    fam.add_metric(lab, float(value))
            if summary.get("stopped_reason"):
                stopped.add_metric([*lab, str(summary["stopped_reason"])], 1)
            ts.add_metric(lab, mtime)
        yield from fams.values()
        yield stopped
        yield ts

    def close(self) -> None:
        """Close the open ledgers and stop the worker."""
        with self._lock:

            def _close_all() -> None:
                for fed in list(self._ledgers):
                    self._drop(fed)

            try:
                self._worker.submit(_close_all).result(30)
            except Exception:  # noqa: BLE001
                log.exception("closing the ledgers failed")
            self._worker.shutdown(wait=False, cancel_futures=True)


def _parse_ts(text: str) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return math.nan


def exporter_registry(
    db: str | Path, runs_dirs: Iterable[str | Path] = (), *, affordable: bool = True
) -> tuple[CollectorRegistry, LedgerCollector]:
    """Return a registry holding only the ledger collector (no process/platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = LedgerCollector(db, runs_dirs, affordable=affordable)
    registry.register(collector)
    return registry, collector
