"""Live per-run Prometheus metrics: ``PrometheusRunObserver`` and its HTTP server.

The observer is fed the round loop's records (server/fedmeta/server/report.py) and served by
``make_observer(config)`` on ``(metrics.bind, metrics.port)`` while a run is alive. Labels:
``federation``, ``run`` (plus bounded enums: ``reason`` on rejected replies and stop reasons,
``quantile``). The ledger's cumulative state, which outlives runs, is served by the separate
exporter (``server/fedmeta/server/monitoring/ledger.py``). One naming scheme for both: ``fedmeta_``
prefix, base
units, ``_total`` on counters.

Never a participant or task id as a label: unbounded cardinality, and it would publish who took
part. ``clipped_fraction`` and ``pre_clip_norm_quantiles`` are computed from private data and are
NOT covered by the DP guarantee; they are exported only when the round loop provides them
(non-private runs, or ``metrics.private_diagnostics = true``).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from fedmeta.server.report import RoundDiagnostics, RoundOutcome, RunFinished, RunStarted

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
    "fedmeta_participants_suspended",
    "fedmeta_nodes_refused_total",
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


def finite(x: float | None) -> bool:
    """True for a float that is neither None, infinite nor NaN."""
    return x is not None and isinstance(x, int | float) and math.isfinite(float(x))


def remaining_budget(spent: float | None, budget: float | None) -> float | None:
    """The fraction of ``budget`` not yet spent (0 to 1); None when either is unknown or 0."""
    if not finite(spent) or not finite(budget) or not budget:
        return None
    return max(0.0, 1.0 - float(spent) / float(budget))  # type: ignore[arg-type]


class PrometheusRunObserver:
    """A ``RunObserver`` that keeps live per-run metrics in its own registry. Never raises."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._budget: dict[tuple[str, str], float] = {}
        self._diagnostics: dict[tuple[str, str], bool] = {}
        self._declare_progress()
        self._declare_privacy()
        self._declare_participation()
        self._declare_learning()
        self._declare_timing()

    def _g(self, name: str, doc: str, labels: tuple[str, ...] = RUN_LABELS) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _c(self, name: str, doc: str, labels: tuple[str, ...] = RUN_LABELS) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _declare_progress(self) -> None:
        g, c = self._g, self._c
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

    def _declare_privacy(self) -> None:
        g = self._g
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

    def _declare_participation(self) -> None:
        g, c = self._g, self._c
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
        self.suspended = g(
            "fedmeta_participants_suspended",
            "Participants not sampled after repeated timeouts or unavailability.",
        )
        self.refused = c(
            "fedmeta_nodes_refused",
            "Node registrations refused (unbound or wrong key, duplicate id, too few tasks).",
            (*RUN_LABELS, "reason"),
        )

    def _declare_learning(self) -> None:
        g = self._g
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

    def _declare_timing(self) -> None:
        """Private diagnostics in a private run: observed only when the run provides them."""
        r = self.registry
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

    def round_finished(self, report: RoundOutcome) -> None:
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
        self._diagnostics[lab] = e.diagnostics
        self.runs_started.labels(e.federation_id).inc()
        self.run_active.labels(*lab).set(1)
        self.run_private.labels(*lab).set(1 if e.private else 0)
        now = time.time()
        self.run_start_ts.labels(*lab).set(now)
        self.last_round_ts.labels(*lab).set(now)  # "no progress" counts from the start
        self.rounds_planned.labels(*lab).set(e.planned_rounds)
        self.rounds_completed.labels(*lab).set(0)
        self.registered.labels(*lab).set(e.participants_registered)
        counters = [self.sampled, self.replied, self.failed]
        if e.diagnostics:
            counters += [self.tasks_requested, self.tasks_received]
        for counter in counters:
            counter.labels(*lab)  # initialise at 0 so rate() has a start point
        if finite(e.epsilon_budget):
            self._budget[lab] = float(e.epsilon_budget)  # type: ignore[arg-type]
            self.eps_budget.labels(*lab).set(float(e.epsilon_budget))  # type: ignore[arg-type]
        if finite(e.delta):
            self.delta.labels(*lab).set(float(e.delta))  # type: ignore[arg-type]
        if finite(e.noise_multiplier):
            self.z.labels(*lab).set(float(e.noise_multiplier))  # type: ignore[arg-type]
        if finite(e.clip):
            self.clip.labels(*lab).set(float(e.clip))  # type: ignore[arg-type]
        if e.rounds_affordable is not None:
            self.affordable.labels(*lab).set(e.rounds_affordable)
        if e.private:
            self._set_eps(lab, e.epsilon_spent_task, e.epsilon_spent_participant)

    def _set_eps(self, lab: tuple[str, str], task: float | None, part: float | None) -> None:
        if finite(task):
            self.eps_task.labels(*lab).set(float(task))  # type: ignore[arg-type]
            rem = remaining_budget(task, self._budget.get(lab))
            if rem is not None:
                self.remaining.labels(*lab).set(rem)
        if finite(part):
            self.eps_part.labels(*lab).set(float(part))  # type: ignore[arg-type]

    def _round_finished(self, r: RoundOutcome) -> None:
        lab = (r.federation_id, r.run_id)
        self.rounds_completed.labels(*lab).set(r.round)
        self.round_current.labels(*lab).set(r.round)
        # When a round ended depends on its work (how many tasks it sampled): a private run without
        # diagnostics publishes it to the minute only, enough for the no-progress alert.
        now = time.time()
        diagnostics = self._diagnostics.get(lab, False)
        self.last_round_ts.labels(*lab).set(now if diagnostics else now - now % 60)
        self.registered.labels(*lab).set(r.participants_registered)
        self.sampled.labels(*lab).inc(max(0, r.participants_sampled))
        self.replied.labels(*lab).inc(max(0, r.participants_replied))
        self.failed.labels(*lab).inc(max(0, r.participants_failed))
        for reason, n in {**r.failures, **r.stray_replies}.items():
            if n > 0:
                self.rejected.labels(*lab, str(reason)).inc(n)
        for reason, n in r.nodes_refused.items():
            if n > 0:
                self.refused.labels(*lab, str(reason)).inc(n)
        self.suspended.labels(*lab).set(r.participants_suspended)
        self._set_eps(lab, r.epsilon_task, r.epsilon_participant)
        if r.rounds_affordable is not None:
            self.affordable.labels(*lab).set(r.rounds_affordable)
        if r.ledger_position is not None:
            self.spends.labels(*lab).set(r.ledger_position)
        for gauge, value in (
            (self.loss, r.train_loss),
            (self.validation, r.validation_metric),
            (self.noise_std, r.noise_std),
            (self.clip, r.clip),
        ):
            if finite(value):
                gauge.labels(*lab).set(float(value))  # type: ignore[arg-type]
        if r.diagnostics is not None:
            self._diagnostics_of(lab, r.diagnostics)
            self._withheld_failures(lab, r)

    def _diagnostics_of(self, lab: tuple[str, str], d: RoundDiagnostics) -> None:
        """Private diagnostics: present only in non-private runs or on the explicit opt-in."""
        self.tasks_requested.labels(*lab).inc(max(0, d.tasks_requested))
        self.tasks_received.labels(*lab).inc(max(0, d.tasks_received))
        if finite(d.clipped_fraction):
            self.clipped.labels(*lab).set(float(d.clipped_fraction))  # type: ignore[arg-type]
        for q, v in (d.norm_quantiles or {}).items():
            if finite(v):
                self.norms.labels(*lab, f"{float(q):g}").set(float(v))
        self.round_seconds.labels(*lab).observe(max(0.0, d.round_seconds))
        self.agg_seconds.labels(*lab).observe(max(0.0, d.aggregation_seconds))
        for s in d.compute_seconds_per_task:
            if finite(s):
                self.compute_seconds.labels(*lab).observe(max(0.0, float(s)))

    def _withheld_failures(self, lab: tuple[str, str], r: RoundOutcome) -> None:
        """Failures a private run's record leaves out (fedmeta.server.releases): a diagnostic."""
        d = r.diagnostics
        assert d is not None
        for table, released in ((d.failures, r.failures), (d.stray_replies, r.stray_replies)):
            for reason, n in table.items():
                extra = n - released.get(reason, 0)
                if extra > 0:
                    self.rejected.labels(*lab, str(reason)).inc(extra)

    def _run_finished(self, e: RunFinished) -> None:
        lab = (e.federation_id, e.run_id)
        self.runs_finished.labels(e.federation_id).inc()
        self.run_active.labels(*lab).set(0)
        self.rounds_completed.labels(*lab).set(e.rounds_completed)
        self.run_stopped.labels(*lab, str(e.stopped_reason)).set(1)
        self._set_eps(lab, e.epsilon_spent_task, e.epsilon_spent_participant)
        if finite(e.final_metric):
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
    port = int(config.metrics.port)
    bind = str(getattr(config.metrics, "bind", "127.0.0.1") or "127.0.0.1")
    try:
        obs.server, obs.port = serve(obs.registry, port, bind)
        # Printed, not logged: with metrics.port = 0 this line is the only way to find the port.
        print(f"live metrics: http://{bind}:{obs.port}/metrics", file=sys.stderr, flush=True)
    except Exception as error:  # noqa: BLE001 - metrics never stop a private run
        reason = getattr(error, "strerror", None) or error
        print(
            f"metrics not served: cannot bind {bind}:{port} ({reason}); the run continues "
            "without them (metrics.port = 0 picks a free port)", file=sys.stderr, flush=True,
        )  # fmt: skip
    return obs
