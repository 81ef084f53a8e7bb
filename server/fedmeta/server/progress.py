"""A dependency-free progress bar, a ``RunObserver``: round, eps spent/budget, loss, validation.

On a terminal it redraws one line; otherwise (logs, CI) it prints a line every ``every`` rounds.
Each line is a release: it shows only what a round's record shows (server/fedmeta/server/report.py).
Epsilon is
the task-level value after the round (server/fedmeta/server/epsilon_curve.py); with
``privacy.report_every > 1``
a round whose record carries none shows the latest one and the round it belongs to, e.g.
``eps 2.978/8 (after round 10)``; a run with ``privacy.target_epsilon`` on data nothing was spent
from before shows its target instead of the budget (``eps 2.978/4 (target)``). Elapsed time, rate
and time left only where they are not a release: in a
non-private run, or a private one whose rounds are padded (``federation.round_min_seconds > 0``:
a round's end then follows the public minimum, docs/privacy.md "Timing") or that records private
diagnostics (``metrics.private_diagnostics``, announced in the plan); otherwise a round's duration
would tell how many tasks it sampled.

:class:`TensorBoardLog` writes the same public values as TensorBoard scalars (``simulate
--tensorboard DIR``), with the run's start as every event's time in a private run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from fedmeta.server.report import RoundOutcome, RunFinished, RunStarted


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


class ProgressBar:
    """Prints progress of a run; never raises."""

    def __init__(
        self, stream: TextIO | None = None, width: int = 24, every: int | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self.planned = 1
        self.budget: float | None = None
        self.target: float | None = None  # the run's own epsilon, where it set one
        self.spent_before = 0.0
        self.private = True
        self.metric = ""
        self.t0 = time.monotonic()
        self.last_eps: float | None = None
        self.last_eps_round = 0
        self.last_val: float | None = None
        self.show_time = False

    def run_started(self, event: RunStarted) -> None:  # noqa: D102
        self.planned = max(event.planned_rounds, 1)
        self.budget = event.epsilon_budget
        self.target = event.target_epsilon
        self.spent_before = event.epsilon_spent_task
        self.private = event.private
        self.show_time = not event.private or event.round_min_seconds > 0 or event.diagnostics
        self.metric = event.metric_name
        self.t0 = time.monotonic()
        if self.every is None:
            self.every = max(1, self.planned // 20)

    def round_finished(self, report: RoundOutcome) -> None:  # noqa: D102
        try:
            r = report.round
            if report.epsilon_task is not None:
                self.last_eps, self.last_eps_round = report.epsilon_task, r
            if report.validation_metric is not None:
                self.last_val = report.validation_metric
            frac = min(r / self.planned, 1.0)
            filled = int(round(frac * self.width))
            bar = "#" * filled + "." * (self.width - filled)
            line = (
                f"[{bar}] round {r}/{self.planned} | {self._eps(r)} | "
                f"loss {_f(report.train_loss)} | val {self.metric} {_f(self.last_val)} | "
                f"{report.participants_replied}/{report.participants_sampled} replied"
            )
            if self.show_time:  # see the module docstring: never a release
                elapsed = max(time.monotonic() - self.t0, 1e-9)
                left = (self.planned - r) * elapsed / max(r, 1)
                line += f" | {elapsed:.0f}s, {r / elapsed:.2f} r/s, ~{left:.0f}s left"
            if self.tty:
                self.stream.write("\r" + line)
                self.stream.flush()
            elif self.every and (r % self.every == 0 or r == self.planned):
                self.stream.write(line + "\n")
                self.stream.flush()
        except Exception:  # noqa: BLE001 - observers never raise
            pass

    def _eps(self, r: int) -> str:
        """Epsilon spent / budget; the round it is for when that is not ``r`` (``report_every``)."""
        if not self.private:
            return "NON-PRIVATE"
        text = f"eps {_f(self.last_eps, '.3f')}/{self._limit()}"
        if self.last_eps is not None and self.last_eps_round != r:
            text += f" (after round {self.last_eps_round})"
        return text

    def _limit(self) -> str:
        """What epsilon runs up to: the run's target, or the data's budget.

        The epsilon shown is the data's (every spend on it); it ends at the target when nothing
        was spent before this run, and above it otherwise, so the budget is shown there.
        """
        if self.target is None:
            return _f(self.budget, ".3g")
        if not self.spent_before:
            return f"{self.target:.3g} (target)"
        return f"{_f(self.budget, '.3g')} (budget; this run's target {self.target:.3g})"

    def run_finished(self, event: RunFinished) -> None:  # noqa: D102
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class TensorBoardError(RuntimeError):
    """``--tensorboard`` without the ``tensorboard`` package; one line with the fix."""


class TensorBoardLog:
    """A ``RunObserver`` writing a run's public values as TensorBoard scalars; never raises.

    Only what a round's record holds (server/fedmeta/server/report.py), never its diagnostics.
    TensorBoard stamps
    every event with the wall time, which in a private run would publish each round's duration (a
    function of how many tasks it sampled): there every event carries the run's start time.
    """

    def __init__(self, logdir: Path) -> None:
        """Open a writer on ``logdir``; :class:`TensorBoardError` without the package."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TensorBoardError(
                "--tensorboard needs the tensorboard package (torch's writer uses it): "
                "pip install tensorboard, or leave --tensorboard out"
            ) from None
        self.writer: Any = SummaryWriter(log_dir=str(logdir))
        self.private = True
        self.t0 = time.time()

    def run_started(self, event: RunStarted) -> None:  # noqa: D102
        self.private = event.private
        self.t0 = time.time()

    def round_finished(self, report: RoundOutcome) -> None:  # noqa: D102
        walltime = self.t0 if self.private else time.time()
        values = {
            "privacy/epsilon_task": report.epsilon_task,
            "privacy/epsilon_participant": report.epsilon_participant,
            "train/loss": report.train_loss,
            "validation/metric": report.validation_metric,
            "train/noise_std": report.noise_std,
            "train/clip": report.clip,
        }
        try:
            for tag, value in values.items():
                if value is not None:
                    self.writer.add_scalar(tag, value, report.round, walltime=walltime)
        except Exception:  # noqa: BLE001 - observers never raise
            pass

    def run_finished(self, event: RunFinished) -> None:  # noqa: D102
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - observers never raise
            pass
