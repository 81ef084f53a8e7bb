"""The records a run produces, and the only things observers, ``rounds.csv`` and the summary read.

A round produces one :class:`RoundOutcome`. ``rounds.csv`` rows, what observers (progress bar,
Prometheus) receive, and the run summary are all derived from these records, never assembled
separately, so every output of a run says the same thing.

**Everything here is a release.** In a private run a record holds only what the accountant covers
or what is public: stage-1 facts (how many participants were sampled, which is fixed, and how many
were available or not: in a private run ``participants_replied``/``participants_failed`` and
``failures`` count only Flower's ``node_unavailable``, server/fedmeta/server/releases.py), the
ledger's epsilon,
the noise scale, and metrics computed from the noisy model on public held-out tasks. Anything that
depends on stage-2 outcomes or on private values (realised task counts, clipping statistics, norm
violations, timeouts and rejected replies, per-round and per-participant timings) sits in
:class:`RoundDiagnostics`, which a private run fills only when ``metrics.private_diagnostics`` is
on. Never a participant or task id.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

log = logging.getLogger("fedmeta.server")

STATUS_COMPLETED = "completed"
STATUS_LOST_ON_RESUME = "lost_on_resume"


@dataclass(frozen=True)
class RoundDiagnostics:
    """Facts of a round that depend on stage 2 or on private values: NOT covered by the guarantee.

    Present in non-private runs, and in private runs only with ``metrics.private_diagnostics``.
    """

    tasks_requested: int
    tasks_received: int
    norm_violations: int
    nonfinite: int
    clipped_fraction: float | None
    norm_quantiles: Mapping[float, float] | None
    round_seconds: float
    aggregation_seconds: float
    compute_seconds_per_task: tuple[float, ...] = ()
    # Every failure by reason, replies accepted, stray replies: in a private run the record itself
    # holds only availability failures (server/fedmeta/server/releases.py); the rest is here.
    replies_accepted: int = 0
    failures: Mapping[str, int] = field(default_factory=dict)
    stray_replies: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundOutcome:
    """One round of a run, as everything downstream sees it (``round`` is 1-based)."""

    run_id: str
    federation_id: str
    round: int
    status: str = STATUS_COMPLETED
    participants_registered: int = 0
    participants_sampled: int = 0
    participants_replied: int = 0
    participants_failed: int = 0
    failures: Mapping[str, int] = field(default_factory=dict)  # one reason per failed participant
    stray_replies: Mapping[str, int] = field(default_factory=dict)  # replies matching no request
    participants_suspended: int = 0  # not sampled after repeated timeouts or unavailability
    nodes_refused: Mapping[str, int] = field(default_factory=dict)  # new registrations refused
    ledger_position: int | None = None
    noise_std: float | None = None
    clip: float | None = None
    # Added by the run after the round: evaluation on public held-out tasks and the accounting.
    train_loss: float | None = None
    validation_metric: float | None = None
    epsilon_task: float | None = None
    epsilon_participant: float | None = None
    rounds_affordable: int | None = None
    diagnostics: RoundDiagnostics | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (checkpoints keep the rounds so far in this form)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundOutcome:
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        diag = values.pop("diagnostics", None)
        return cls(**values, diagnostics=None if diag is None else RoundDiagnostics(**diag))


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
    epsilon_spent_participant: float | None
    participants_registered: int
    metric_name: str
    diagnostics: bool  # whether rounds carry RoundDiagnostics
    round_min_seconds: float = 0.0  # rounds padded to this long (0: no padding)
    target_epsilon: float | None = None  # the run's own epsilon (privacy.target_epsilon)


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
    """Receives a run's records in order: ``run_started``, ``round_finished`` per round, the end.

    Observers must not raise: a failing sink never stops a private run halfway through its
    bookkeeping (the run logs and ignores any exception).
    """

    def run_started(self, event: RunStarted) -> None:
        """Receive the run's start."""

    def round_finished(self, outcome: RoundOutcome) -> None:
        """Receive one finished round."""

    def run_finished(self, event: RunFinished) -> None:
        """Receive the run's end."""


class Observers:
    """A run's observers as one :class:`RunObserver`.

    Each hears every record, in order; one that raises is logged and skipped (a failing sink must
    never stop a private run).
    """

    def __init__(self, observers: Iterable[RunObserver] = ()) -> None:
        self.members = tuple(observers)

    def run_started(self, event: RunStarted) -> None:
        """Tell every observer the run started."""
        for observer in self.members:
            with _isolated(observer):
                observer.run_started(event)

    def round_finished(self, outcome: RoundOutcome) -> None:
        """Tell every observer a round finished."""
        for observer in self.members:
            with _isolated(observer):
                observer.round_finished(outcome)

    def run_finished(self, event: RunFinished) -> None:
        """Tell every observer the run ended."""
        for observer in self.members:
            with _isolated(observer):
                observer.run_finished(event)


@contextlib.contextmanager
def _isolated(observer: RunObserver) -> Iterator[None]:
    try:
        yield
    except Exception:  # noqa: BLE001 - a failing sink must never stop a private run
        log.exception("observer %r failed", observer)
