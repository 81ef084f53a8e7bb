"""Prometheus metrics: the only module that imports prometheus_client.

Two sources, one naming scheme (``fedmeta_`` prefix, base units, ``_total`` on counters):

* ``PrometheusRunObserver`` -- live per-run metrics, fed the round loop's records
  (server/report.py) and served by ``make_observer(config)`` on ``(metrics.bind, metrics.port)``
  while a run is alive. Labels: ``federation``, ``run`` (plus bounded enums: ``reason`` on rejected
  replies and stop reasons, ``quantile``).
* ``LedgerCollector`` -- the cumulative, per-federation budget state re-read from the SQLite ledger
  on every scrape, plus the latest run records (``summary.json``); served by ``fedmeta exporter``
  (server/exporter.py). Labels: ``federation`` (and ``run`` on the latest-run records).

Never a participant or task id as a label: unbounded cardinality, and it would publish who took
part. ``clipped_fraction`` and ``pre_clip_norm_quantiles`` are computed from private data and are
NOT covered by the DP guarantee; they are exported only when the round loop provides them
(non-private runs, or ``metrics.private_diagnostics = true``).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.report import RoundReport, RunFinished, RunStarted

log = logging.getLogger("fedmeta.metrics")

# No ``*_created`` series: they double the series count and no panel or alert uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

RUN_LABELS = ("federation", "run")
FED_LABELS = ("federation",)

#: Round duration buckets (seconds): sub-second simulation rounds up to multi-minute deployed ones.
ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SHORT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: Live (per-run) metric names, without the _total/_bucket/... suffixes the exposition adds.
LIVE_METRICS: tuple[str, ...] = (
    "fedmeta_runs_started_total",
    "fedmeta_runs_finished_total",
    "fedmeta_run_active",
    "fedmeta_run_private",
    "fedmeta_run_stopped",
    "fedmeta_run_start_timestamp_seconds",
    "fedmeta_epsilon_budget",
    "fedmeta_delta",
    "fedmeta_epsilon_spent_task",
    "fedmeta_epsilon_spent_participant",
    "fedmeta_budget_remaining_ratio",
    "fedmeta_rounds_affordable",
    "fedmeta_spends_recorded",
    "fedmeta_rounds_planned",
    "fedmeta_rounds_completed",
    "fedmeta_round_current",
    "fedmeta_last_round_timestamp_seconds",
    "fedmeta_participants_registered",
    "fedmeta_participants_sampled_total",
    "fedmeta_participants_replied_total",
    "fedmeta_participants_failed_total",
    "fedmeta_tasks_requested_total",
    "fedmeta_tasks_received_total",
    "fedmeta_replies_rejected_total",
    "fedmeta_train_loss",
    "fedmeta_validation_metric",
    "fedmeta_final_metric",
    "fedmeta_clip_bound",
    "fedmeta_noise_multiplier",
    "fedmeta_noise_std",
    "fedmeta_clipped_tasks_ratio",
    "fedmeta_pre_clip_norm",
    "fedmeta_round_duration_seconds",
    "fedmeta_aggregation_duration_seconds",
    "fedmeta_client_task_compute_duration_seconds",
)

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


def _finite(x: float | None) -> bool:
    return x is not None and isinstance(x, int | float) and math.isfinite(float(x))


def _remaining(spent: float | None, budget: float | None) -> float | None:
    if not _finite(spent) or not _finite(budget) or not budget:
        return None
    return max(0.0, 1.0 - float(spent) / float(budget))  # type: ignore[arg-type]


class PrometheusRunObserver:
    """A ``RunObserver`` that keeps live per-run metrics in its own registry. Never raises."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._budget: dict[tuple[str, str], float] = {}
        r = self.registry

        def g(name: str, doc: str, labels: tuple[str, ...] = RUN_LABELS) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def c(name: str, doc: str, labels: tuple[str, ...] = RUN_LABELS) -> Counter:
            return Counter(name, doc, labels, registry=r)

        # progress
        self.runs_started = c("fedmeta_runs_started", "Runs started in this process.", FED_LABELS)
        self.runs_finished = c(
            "fedmeta_runs_finished", "Runs finished in this process.", FED_LABELS
        )
        self.run_active = g("fedmeta_run_active", "1 while the run is in its round loop.")
        self.run_private = g("fedmeta_run_private", "1 = private run, 0 = NON-PRIVATE baseline.")
        self.run_stopped = g(
            "fedmeta_run_stopped", "1 for the reason the run stopped.", (*RUN_LABELS, "reason")
        )
        self.run_start_ts = g("fedmeta_run_start_timestamp_seconds", "Unix time the run started.")
        self.rounds_planned = g("fedmeta_rounds_planned", "Rounds planned by the configuration.")
        self.rounds_completed = g("fedmeta_rounds_completed", "Rounds completed by this run.")
        self.round_current = g(
            "fedmeta_round_current", "Index (1-based) of the last finished round."
        )
        self.last_round_ts = g(
            "fedmeta_last_round_timestamp_seconds", "Unix time the last round finished."
        )
        # privacy
        self.eps_budget = g("fedmeta_epsilon_budget", "Epsilon budget of the federation.")
        self.delta = g("fedmeta_delta", "Delta of the (epsilon, delta) guarantee.")
        self.eps_task = g(
            "fedmeta_epsilon_spent_task", "Task-level epsilon spent by the federation (PLD)."
        )
        self.eps_part = g(
            "fedmeta_epsilon_spent_participant",
            "Participant-level epsilon spent by the federation (reported, not enforced).",
        )
        self.remaining = g(
            "fedmeta_budget_remaining_ratio", "Fraction of the task-level epsilon budget left."
        )
        self.affordable = g(
            "fedmeta_rounds_affordable", "More rounds like the last one the budget allows."
        )
        self.spends = g("fedmeta_spends_recorded", "Spends recorded in the federation's ledger.")
        # participation
        self.registered = g("fedmeta_participants_registered", "Participants registered.")
        self.sampled = c(
            "fedmeta_participants_sampled", "Participants sampled, summed over rounds."
        )
        self.replied = c(
            "fedmeta_participants_replied", "Participants whose reply was accepted, over rounds."
        )
        self.failed = c(
            "fedmeta_participants_failed",
            "Participants that failed, timed out or were rejected, over rounds.",
        )
        self.tasks_requested = c("fedmeta_tasks_requested", "Tasks requested, over rounds.")
        self.tasks_received = c("fedmeta_tasks_received", "Task gradients received, over rounds.")
        self.rejected = c(
            "fedmeta_replies_rejected", "Replies rejected, by reason.", (*RUN_LABELS, "reason")
        )
        # learning
        self.loss = g("fedmeta_train_loss", "Meta-train loss of the last round.")
        self.validation = g("fedmeta_validation_metric", "Latest validation metric.")
        self.final = g("fedmeta_final_metric", "Final test metric of the run.")
        self.clip = g("fedmeta_clip_bound", "Per-task clip bound C.")
        self.z = g("fedmeta_noise_multiplier", "Noise multiplier z.")
        self.noise_std = g("fedmeta_noise_std", "Std of the Gaussian noise added to the sum (z*C).")
        self.clipped = g(
            "fedmeta_clipped_tasks_ratio",
            "Fraction of task gradients clipped in the last round. NOT covered by the DP "
            "guarantee; present only in non-private runs or with metrics.private_diagnostics.",
        )
        self.norms = g(
            "fedmeta_pre_clip_norm",
            "Quantiles of per-task gradient norms in the last round. NOT covered by the DP "
            "guarantee; present only in non-private runs or with metrics.private_diagnostics.",
            (*RUN_LABELS, "quantile"),
        )
        # timing
        self.round_seconds = Histogram(
            "fedmeta_round_duration_seconds",
            "Wall time of a round.",
            RUN_LABELS,
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.agg_seconds = Histogram(
            "fedmeta_aggregation_duration_seconds",
            "Server aggregation time of a round.",
            RUN_LABELS,
            buckets=SHORT_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "fedmeta_client_task_compute_duration_seconds",
            "Client compute time per task, as reported in replies.",
            RUN_LABELS,
            buckets=SHORT_BUCKETS,
            registry=r,
        )

    # ------------------------------------------------------------------------ RunObserver
    def run_started(self, event: RunStarted) -> None:
        """Record the plan of a run."""
        self._guard(self._run_started, event)

    def round_finished(self, report: RoundReport) -> None:
        """Record one completed round."""
        self._guard(self._round_finished, report)

    def run_finished(self, event: RunFinished) -> None:
        """Record how the run ended."""
        self._guard(self._run_finished, event)

    def _guard(self, fn: Callable[[Any], None], event: Any) -> None:
        try:
            fn(event)
        except Exception:  # noqa: BLE001 - observers never raise
            log.exception("metrics observer failed on %s", type(event).__name__)

    def _run_started(self, e: RunStarted) -> None:
        lab = (e.federation_id, e.run_id)
        self.runs_started.labels(e.federation_id).inc()
        self.run_active.labels(*lab).set(1)
        self.run_private.labels(*lab).set(1 if e.private else 0)
        now = time.time()
        self.run_start_ts.labels(*lab).set(now)
        self.last_round_ts.labels(*lab).set(now)  # "no progress" counts from the start
        self.rounds_planned.labels(*lab).set(e.planned_rounds)
        self.rounds_completed.labels(*lab).set(0)
        self.registered.labels(*lab).set(e.participants_registered)
        for counter in (
            self.sampled,
            self.replied,
            self.failed,
            self.tasks_requested,
            self.tasks_received,
        ):
            counter.labels(*lab)  # initialise at 0 so rate() has a start point
        if _finite(e.epsilon_budget):
            self._budget[lab] = float(e.epsilon_budget)  # type: ignore[arg-type]
            self.eps_budget.labels(*lab).set(float(e.epsilon_budget))  # type: ignore[arg-type]
        if _finite(e.delta):
            self.delta.labels(*lab).set(float(e.delta))  # type: ignore[arg-type]
        if _finite(e.noise_multiplier):
            self.z.labels(*lab).set(float(e.noise_multiplier))  # type: ignore[arg-type]
        if _finite(e.clip):
            self.clip.labels(*lab).set(float(e.clip))  # type: ignore[arg-type]
        if e.rounds_affordable is not None:
            self.affordable.labels(*lab).set(e.rounds_affordable)
        if e.private:
            self._set_eps(lab, e.epsilon_spent_task, e.epsilon_spent_participant)

    def _set_eps(self, lab: tuple[str, str], task: float | None, part: float | None) -> None:
        if _finite(task):
            self.eps_task.labels(*lab).set(float(task))  # type: ignore[arg-type]
            rem = _remaining(task, self._budget.get(lab))
            if rem is not None:
                self.remaining.labels(*lab).set(rem)
        if _finite(part):
            self.eps_part.labels(*lab).set(float(part))  # type: ignore[arg-type]

    def _round_finished(self, r: RoundReport) -> None:
        lab = (r.federation_id, r.run_id)
        self.rounds_completed.labels(*lab).set(r.round_index)
        self.round_current.labels(*lab).set(r.round_index)
        self.last_round_ts.labels(*lab).set(time.time())
        self.registered.labels(*lab).set(r.participants_registered)
        self.sampled.labels(*lab).inc(max(0, r.participants_sampled))
        self.replied.labels(*lab).inc(max(0, r.participants_replied))
        self.failed.labels(*lab).inc(max(0, r.participants_failed))
        # None in private runs without the diagnostics opt-in (see server/report.py).
        if r.tasks_requested is not None:
            self.tasks_requested.labels(*lab).inc(max(0, r.tasks_requested))
        if r.tasks_received is not None:
            self.tasks_received.labels(*lab).inc(max(0, r.tasks_received))
        for reason, n in (r.rejected_by_reason or {}).items():
            if n > 0:
                self.rejected.labels(*lab, str(reason)).inc(n)
        self._set_eps(lab, r.epsilon_spent_task, r.epsilon_spent_participant)
        if r.rounds_affordable is not None:
            self.affordable.labels(*lab).set(r.rounds_affordable)
        if r.spends_recorded is not None:
            self.spends.labels(*lab).set(r.spends_recorded)
        for gauge, value in (
            (self.loss, r.train_loss),
            (self.validation, r.validation_metric),
            (self.noise_std, r.noise_std),
            (self.clip, r.clip),
        ):
            if _finite(value):
                gauge.labels(*lab).set(float(value))  # type: ignore[arg-type]
        # Private diagnostics: exported only when the round loop provides them.
        if _finite(r.clipped_fraction):
            self.clipped.labels(*lab).set(float(r.clipped_fraction))  # type: ignore[arg-type]
        for q, v in (r.pre_clip_norm_quantiles or {}).items():
            if _finite(v):
                self.norms.labels(*lab, f"{float(q):g}").set(float(v))
        self.round_seconds.labels(*lab).observe(max(0.0, r.round_seconds))
        self.agg_seconds.labels(*lab).observe(max(0.0, r.aggregation_seconds))
        for s in r.client_compute_seconds_per_task:
            if _finite(s):
                self.compute_seconds.labels(*lab).observe(max(0.0, float(s)))

    def _run_finished(self, e: RunFinished) -> None:
        lab = (e.federation_id, e.run_id)
        self.runs_finished.labels(e.federation_id).inc()
        self.run_active.labels(*lab).set(0)
        self.rounds_completed.labels(*lab).set(e.rounds_completed)
        self.run_stopped.labels(*lab, str(e.stopped_reason)).set(1)
        self._set_eps(lab, e.epsilon_spent_task, e.epsilon_spent_participant)
        if _finite(e.final_metric):
            self.final.labels(*lab).set(float(e.final_metric))  # type: ignore[arg-type]


#: Keep serving this many seconds after ``run_finished`` before the process may exit, so that a
#: scraper sees a short run's final values (default 0: exit at once).
LINGER_ENV = "FEDMETA_METRICS_LINGER_S"


class ServedObserver(PrometheusRunObserver):
    """A ``PrometheusRunObserver`` with its HTTP server (``make_observer``)."""

    server: Any = None
    port: int | None = None

    def run_finished(self, event: RunFinished) -> None:
        """Record the end; with ``FEDMETA_METRICS_LINGER_S`` keep serving a while at exit."""
        super().run_finished(event)
        try:
            linger = float(os.environ.get(LINGER_ENV, "0") or 0)
        except ValueError:
            linger = 0.0
        if self.server is not None and linger > 0:
            # At interpreter exit, after summary.json is written: bounded wait, never a hang.
            deadline = time.monotonic() + min(linger, 600.0)
            atexit.register(lambda: time.sleep(max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        """Stop serving (tests; a run's process normally just exits)."""
        if self.server is not None:
            try:
                self.server.shutdown()
                self.server.server_close()
            except Exception:  # noqa: BLE001
                log.exception("metrics server shutdown failed")
            self.server = None


def serve(registry: CollectorRegistry, port: int, bind: str = "127.0.0.1") -> tuple[Any, int]:
    """Serve ``registry`` on ``(bind, port)`` in a daemon thread; return (server, bound port)."""
    server, _thread = start_http_server(port, addr=bind, registry=registry)
    return server, int(server.server_address[1])


def make_observer(config: Any) -> ServedObserver:
    """Return the round loop's observer, serving /metrics on ``(metrics.bind, metrics.port)``.

    Never raises: if the port cannot be bound the run goes on without metrics (logged).
    """
    obs = ServedObserver()
    try:
        port = int(config.metrics.port)
        bind = str(getattr(config.metrics, "bind", "127.0.0.1") or "127.0.0.1")
        obs.server, obs.port = serve(obs.registry, port, bind)
        log.info("serving run metrics on http://%s:%d/metrics", bind, obs.port)
    except Exception:  # noqa: BLE001 - metrics never stop a private run
        log.exception("could not start the metrics server; the run continues without it")
    return obs


# ======================================================================== the ledger exporter


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
