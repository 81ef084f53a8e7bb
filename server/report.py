"""What the round loop tells observers (metrics, progress bar, CSV): plain frozen records, no I/O.

The round loop builds these records and hands them to every ``RunObserver``; observers never reach
into the loop's state. Keeping the records plain lets the Prometheus exporter, the progress bar and
``rounds.csv`` all read the same facts, and lets tests assert on them without any of those sinks.

Privacy note: ``RoundReport`` carries only aggregates over a round, never a participant or task id,
and never a per-task gradient norm. ``clipped_fraction`` and ``pre_clip_norm_quantiles`` are
computed from private data and are *not* covered by the (epsilon, delta) guarantee; they are
``None`` unless the configuration opts in to private diagnostics (always available in non-private
runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RunStarted:
    """The plan of a run, known before its first round."""

    run_id: str
    federation_id: str
    private: bool
    epsilon_budget: float | None
    delta: float | None
    noise_multiplier: float | None
    clip: float | None
    planned_rounds: int
    rounds_affordable: int | None
    epsilon_spent_task: float
    epsilon_spent_participant: float
    participants_registered: int
    metric_name: str


@dataclass(frozen=True)
class RoundReport:
    """The public and aggregate facts of one completed round."""

    run_id: str
    federation_id: str
    round_index: int
    participants_registered: int
    participants_sampled: int
    participants_replied: int
    participants_failed: int
    tasks_requested: int | None
    tasks_received: int | None
    rejected_by_reason: Mapping[str, int] = field(default_factory=dict)
    train_loss: float | None = None
    validation_metric: float | None = None
    epsilon_spent_task: float | None = None
    epsilon_spent_participant: float | None = None
    rounds_affordable: int | None = None
    spends_recorded: int | None = None
    noise_std: float | None = None
    clip: float | None = None
    clipped_fraction: float | None = None
    pre_clip_norm_quantiles: Mapping[float, float] | None = None
    round_seconds: float = 0.0
    aggregation_seconds: float = 0.0
    client_compute_seconds_per_task: tuple[float, ...] = ()


@dataclass(frozen=True)
class RunFinished:
    """How a run ended."""

    run_id: str
    federation_id: str
    rounds_completed: int
    stopped_reason: str
    epsilon_spent_task: float | None
    epsilon_spent_participant: float | None
    final_metric: float | None
    final_metric_ci95: tuple[float, float] | None


class RunObserver(Protocol):
    """Receives a run's records in order.

    ``run_started``, then ``round_finished`` per round, then ``run_finished``. Observers must not
    raise; a failing sink must never stop a private run halfway through its bookkeeping.
    """

    def run_started(self, event: RunStarted) -> None:
        """Receive the run's start."""

    def round_finished(self, report: RoundReport) -> None:
        """Receive one finished round."""

    def run_finished(self, event: RunFinished) -> None:
        """Receive the run's end."""
