"""The ledger exporter's collector: the budget ledger's cumulative state, re-read on every scrape.

A run's live metrics (``server/fedmeta/server/monitoring/live.py``) last only as long as the run;
the privacy
budget outlives runs. ``LedgerCollector`` re-reads the SQLite ledger (and the latest
``summary.json`` of each federation under the run directories) on every scrape and is served by
``fedmeta exporter`` (server/fedmeta/server/exporter.py). Labels: ``federation`` (and ``run`` on the
latest-run
records); ``db`` and a bounded ``reason`` on the health series.

It tells the truth or says it cannot:

* **Read-only.** The ledger is opened with ``BudgetLedger.open_readonly``, which writes nothing,
  so the exporter works on a read-only mount.
* **Every number is computed for the position it is reported with.** Epsilon is cached by
  (position, hash of the last record); rounds affordable is ``total - count`` where ``total``, the
  affordable count of the last recorded kind of round beside the *other* recorded rounds, is
  a pure function of those (searched in the background, cached by them), and ``count`` is read at
  the reported position. A search that finishes late can only fill in the ``total`` it was asked
  for, never a value for another position.
* **A replaced file is followed.** The file's (device, inode) is compared on every scrape, and the
  ledger refuses a file whose history no longer contains what it read (overwritten in place):
  both reopen the file.
* **Health.** ``fedmeta_ledger_readable{db, reason}`` is 1 when the file opened and every
  federation verified, else 0 with a reason from ``accounting.ledger.UNREADABLE_REASONS`` (or
  ``error``): a missing file, a non-SQLite file or a corrupted chain no longer makes the series
  silently vanish.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedmeta.accounting.ledger import UNREADABLE_REASONS
from fedmeta.accounting.ledger.storage import file_identity
from fedmeta.accounting.schemes import GaussianRound as Round
from fedmeta.server.monitoring.live import FED_LABELS, finite, remaining_budget

if TYPE_CHECKING:
    from fedmeta.accounting import BudgetLedger, GaussianRound
    from fedmeta.accounting.schemes import Unit
    from fedmeta.accounting.tuning_release import Recorded

log = logging.getLogger("fedmeta.metrics")

#: What the rounds still affordable depend on: budget, delta, unit, the other rounds, the event.
_TotalsKey: TypeAlias = tuple[
    float, float, "Unit", tuple[tuple["Recorded", int], ...], "GaussianRound"
]

#: Exporter (ledger) metric names.
LEDGER_METRICS: tuple[str, ...] = (
    "fedmeta_ledger_readable",
    "fedmeta_ledger_up",
    "fedmeta_ledger_epsilon_spent_task",
    "fedmeta_ledger_epsilon_spent_participant",
    "fedmeta_ledger_epsilon_budget",
    "fedmeta_ledger_delta",
    "fedmeta_ledger_budget_remaining_ratio",
    "fedmeta_ledger_rounds_affordable",
    "fedmeta_ledger_spends_total",
    "fedmeta_last_run_rounds_completed",
    "fedmeta_last_run_epsilon_spent_task",
    "fedmeta_last_run_epsilon_spent_participant",
    "fedmeta_last_run_final_metric",
    "fedmeta_last_run_stopped",
    "fedmeta_last_run_timestamp_seconds",
    "fedmeta_exporter_scrape_duration_seconds",
)
#: Values of the ``reason`` label of ``fedmeta_ledger_readable``: ``ok``, accounting's reasons for
#: an unreadable ledger, and ``error`` for anything unexpected (see the exporter's log).
READ_REASONS: tuple[str, ...] = ("ok", *UNREADABLE_REASONS, "error")
_TOTALS_KEPT = 1024  # affordable totals cached (one per distinct history); cleared beyond


@dataclass(frozen=True)
class FederationSnapshot:
    """One federation's numbers at one ledger position, or ``values is None`` when unreadable."""

    federation: str
    values: dict[str, float] | None


@dataclass(frozen=True)
class LedgerSnapshot:
    """What one read of the ledger file found."""

    readable: bool
    reason: str
    federations: tuple[FederationSnapshot, ...] = ()


def _reason(error: BaseException) -> str:
    reason = str(getattr(error, "reason", "error"))
    return reason if reason in READ_REASONS else "error"


class LedgerCollector(Collector):
    """Re-reads the SQLite ledger (and run directories) on every scrape, read-only.

    Ledger reads run on one reader thread (SQLite connections belong to the thread that opened
    them; the HTTP server answers each scrape on a new thread); rounds-affordable searches (PLD,
    seconds) on a second thread, so a search never delays a read. A read slower than
    ``read_timeout_s`` serves the previous snapshot, which is consistent in itself.
    """

    def __init__(
        self,
        db: str | Path,
        runs_dirs: Iterable[str | Path] = (),
        *,
        affordable: bool = True,
        read_timeout_s: float = 8.0,
    ) -> None:
        self.db = Path(db).absolute()
        self.runs_dirs = [Path(d) for d in runs_dirs]
        self.affordable = affordable
        self.read_timeout_s = read_timeout_s
        self._lock = threading.Lock()  # one scrape at a time
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedmeta-ledger-read")
        self._searcher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fedmeta-ledger-search"
        )
        self._inflight: Future[LedgerSnapshot] | None = None
        self._snapshot: LedgerSnapshot | None = None
        # Reader thread only.
        self._ledgers: dict[str, BudgetLedger] = {}
        self._identity: tuple[int, int] | None = None
        self._eps: dict[str, tuple[int, str | None, float, float]] = {}
        self._last_problem: dict[str, str] = {}
        # Shared with the search thread.
        self._totals_lock = threading.Lock()
        self._totals: dict[_TotalsKey, int | None] = {}

    def describe(self) -> list[Metric]:
        """Describe nothing up front (an unchecked collector)."""
        return []  # unchecked collector: the families depend on the ledger's content

    # ------------------------------------------------------------ on the reader thread only
    def _close_all(self) -> None:
        for ledger in self._ledgers.values():
            try:
                ledger.close()
            except Exception:  # noqa: BLE001
                pass
        self._ledgers.clear()
        self._eps.clear()

    def _problem(self, key: str, message: str | None) -> None:
        """Log a problem when it starts or changes (not on every scrape), and when it ends."""
        previous = self._last_problem.get(key)
        if message == previous:
            return
        if message is None:
            log.info("%s: readable again", key)
            self._last_problem.pop(key, None)
        else:
            log.warning("%s: %s", key, message)
            self._last_problem[key] = message

    def _read(self) -> LedgerSnapshot:
        from fedmeta.accounting import LedgerReplaced

        try:
            return self._read_once()
        except LedgerReplaced as error:  # overwritten in place: follow it
            log.info("%s", error)
            self._close_all()
            return self._read_once()

    def _read_once(self) -> LedgerSnapshot:
        from fedmeta.accounting import BudgetLedger, LedgerUnreadable

        try:
            identity = file_identity(self.db)
        except OSError:  # unreadable counts as changed: the reopen below says why
            identity = None
        if identity != self._identity:  # replaced (a restore), removed or created: reopen
            self._close_all()
            self._identity = identity
        try:
            info = BudgetLedger.describe(self.db)
        except LedgerUnreadable as error:
            self._close_all()
            self._problem(str(self.db), str(error))
            return LedgerSnapshot(False, _reason(error))
        self._problem(str(self.db), None)
        feds, reasons = [], []
        for fed in info.federations:
            values, reason = self._federation(fed)
            feds.append(FederationSnapshot(fed, values))
            if values is None:
                reasons.append(reason)
        if reasons:
            return LedgerSnapshot(False, reasons[0], tuple(feds))
        return LedgerSnapshot(True, "ok", tuple(feds))

    def _federation(self, fed: str) -> tuple[dict[str, float] | None, str]:
        """One federation's numbers and ``"ok"``, or ``None`` and why it could not be read."""
        from fedmeta.accounting import BudgetLedger, LedgerReplaced

        try:
            ledger = self._ledgers.get(fed)
            if ledger is None:
                ledger = self._ledgers[fed] = BudgetLedger.open_readonly(self.db, fed)
            values = self._values(fed, ledger)
        except LedgerReplaced:
            raise
        except Exception as error:  # noqa: BLE001 - e.g. LedgerCorrupted: report down, keep serving
            self._problem(f"{self.db} federation {fed!r}", str(error))
            stale = self._ledgers.pop(fed, None)
            if stale is not None:
                stale.close()
            self._eps.pop(fed, None)
            return None, _reason(error)
        self._problem(f"{self.db} federation {fed!r}", None)
        return values, "ok"

    def _values(self, fed: str, ledger: BudgetLedger) -> dict[str, float]:
        records = ledger.records()
        position = len(records)
        budget = float(ledger.epsilon_budget)
        values: dict[str, float] = {
            "budget": budget,
            "delta": float(ledger.delta),
            "spends": float(position),
        }
        eps_task = eps_part = 0.0
        if records:
            head = records[-1].hash
            cached = self._eps.get(fed)
            if cached is not None and cached[:2] == (position, head):
                eps_task, eps_part = cached[2], cached[3]
            else:
                # Same methods as the round loop (server/fedmeta/server/privacy.py): task level PLD
                # (enforced),
                # participant level RDP (reported).
                eps_task = float(ledger.epsilon(unit="task", method="pld"))
                try:
                    eps_part = float(ledger.epsilon(unit="participant", method="rdp"))
                except ValueError:  # no participants, or no recorded cap
                    eps_part = math.nan
                self._eps[fed] = (position, head, eps_task, eps_part)
            if self.affordable:
                last = records[-1].event  # a tuning release is no round to count more of
                affordable = self._affordable(ledger, last) if isinstance(last, Round) else None
                if affordable is not None:
                    values["affordable"] = affordable
        values["eps_task"] = eps_task
        values["eps_part"] = eps_part
        values["remaining"] = remaining_budget(eps_task, budget) or 0.0
        return values

    def _affordable(self, ledger: BudgetLedger, event: GaussianRound) -> float | None:
        """More rounds like ``event`` at the position ``ledger`` was just read at, if known.

        ``total`` depends only on the other recorded rounds (``base``), so it is cached by them and
        searched once in the background; ``count`` is read now. Their difference belongs to now.
        """
        counts = dict(ledger.rounds())
        base = tuple(sorted(((e, c) for e, c in counts.items() if e != event), key=repr))
        key = (ledger.epsilon_budget, ledger.delta, ledger.unit, base, event)
        with self._totals_lock:
            known = key in self._totals
            total = self._totals.get(key)
            if not known:
                if len(self._totals) >= _TOTALS_KEPT:
                    self._totals.clear()
                self._totals[key] = None  # pending: submitted once
        if not known:
            self._searcher.submit(self._search, key)
        if total is None or total < 0:
            return None
        return float(max(0, total - counts.get(event, 0)))

    # ------------------------------------------------------------ on the search thread only
    def _search(self, key: _TotalsKey) -> None:
        from fedmeta.accounting import affordable_rounds

        budget, delta, unit, base, event = key
        try:
            total = int(affordable_rounds(base, event, budget, delta, unit))
        except Exception:  # noqa: BLE001 - never crash the worker; the gauge stays absent
            log.exception("could not compute rounds affordable")
            total = -1
        with self._totals_lock:
            self._totals[key] = total

    # --------------------------------------------------------------------------- scrape thread
    def collect(self) -> Iterator[Metric]:
        """Read the ledger and run records now (called on every scrape)."""
        t0 = time.perf_counter()
        with self._lock:
            yield from self._ledger_families(self._latest())
            yield from self._run_records()
        d = GaugeMetricFamily(
            "fedmeta_exporter_scrape_duration_seconds", "Time to read the ledger and run records."
        )
        d.add_metric([], time.perf_counter() - t0)
        yield d

    def _latest(self) -> LedgerSnapshot | None:
        """A fresh snapshot, or the previous one when the read is slow (one read in flight)."""
        if self._inflight is None or self._inflight.done():
            self._inflight = self._reader.submit(self._read)
        try:
            self._snapshot = self._inflight.result(self.read_timeout_s)
        except FutureTimeout:
            log.warning(
                "ledger read slower than %.1fs: serving the last snapshot", self.read_timeout_s
            )
        except Exception:  # noqa: BLE001 - a scrape never crashes the exporter
            log.exception("ledger read failed")
            self._snapshot = LedgerSnapshot(False, "error")
        return self._snapshot

    def _ledger_families(self, snapshot: LedgerSnapshot | None) -> Iterator[Metric]:
        readable = GaugeMetricFamily(
            "fedmeta_ledger_readable",
            "1 if the ledger file opened and every federation verified on this scrape, else 0; "
            "reason says why not.",
            labels=("db", "reason"),
        )
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
        }
        if snapshot is not None:
            readable.add_metric([str(self.db), snapshot.reason], 1 if snapshot.readable else 0)
            for fed in snapshot.federations:
                fams["up"].add_metric([fed.federation], 0 if fed.values is None else 1)
                for key, value in (fed.values or {}).items():
                    if key in fams and finite(value):
                        fams[key].add_metric([fed.federation], value)
        yield readable
        yield from fams.values()

    def _run_records(self) -> Iterator[Metric]:
        """Yield the latest ``summary.json`` per federation under the run directories."""
        latest = _latest_summaries(self.runs_dirs)
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
            "Day (Unix time of 00:00 UTC) the latest run's summary.json was written: no finer "
            "time is published (issue 39).",
            labels=labels,
        )
        for fed, (mtime, summary) in sorted(latest.items()):
            lab = [fed, str(summary.get("run_id", ""))]
            for key, fam in fams.items():
                value = _summary_value(summary, key)
                if isinstance(value, int | float) and finite(value):
                    fam.add_metric(lab, float(value))
            if summary.get("stopped_reason"):
                stopped.add_metric([*lab, str(summary["stopped_reason"])], 1)
            ts.add_metric(lab, float(int(mtime) // 86400 * 86400))
        yield from fams.values()
        yield stopped
        yield ts

    def close(self) -> None:
        """Close the open ledgers and stop the threads."""
        with self._lock:
            try:
                self._reader.submit(self._close_all).result(30)
            except Exception:  # noqa: BLE001
                log.exception("closing the ledgers failed")
            self._reader.shutdown(wait=False, cancel_futures=True)
            self._searcher.shutdown(wait=False, cancel_futures=True)


def _summary_value(summary: Mapping[str, Any], key: str) -> Any:
    """A summary's value for a gauge; epsilon is the implemented guarantee, as the summary's.

    One epsilon everywhere (issue 39): the accountant's value with the release's floating-point
    residual folded in (``implemented_guarantee``), when the summary has it.
    """
    implemented = summary.get("implemented_guarantee")
    if key == "epsilon_spent" and isinstance(implemented, Mapping):
        return implemented.get("epsilon")
    return summary.get(key)


def _latest_summaries(runs_dirs: Iterable[Path]) -> dict[str, tuple[float, dict[str, Any]]]:
    """Federation -> (mtime, summary) of its newest readable ``summary.json`` (two levels deep)."""
    latest: dict[str, tuple[float, dict[str, Any]]] = {}
    for root in runs_dirs:
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
    return latest


def exporter_registry(
    db: str | Path, runs_dirs: Iterable[str | Path] = (), *, affordable: bool = True
) -> tuple[CollectorRegistry, LedgerCollector]:
    """Return a registry holding only the ledger collector (no process/platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = LedgerCollector(db, runs_dirs, affordable=affordable)
    registry.register(collector)
    return registry, collector
