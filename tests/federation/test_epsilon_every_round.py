"""Task-level epsilon in every round's record (fedmeta.server.epsilon_curve, issue 22 "Visibility").

The background curve computes guesses without being asked, survives a failed composition and
stops; a real private run's every record, rounds.csv row and progress line carry the epsilon the
ledger reports after that round (the same float), from round 1 on.
"""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Any

import pytest

from fedmeta.accounting import BudgetLedger, Exposures, FlatPoissonScheme, GaussianRound, epsilon
from fedmeta.config_io import load_config
from fedmeta.server.app import execute
from fedmeta.server.epsilon_curve import EpsilonCurve, RoundEpsilons
from fedmeta.server.progress import ProgressBar
from fedmeta.server.report import RoundOutcome, RunStarted
from fedmeta.server.startup import open_budget
from fedmeta.simulation.local_grid import InProcessGrid

from .test_round import SMALL

EVENT = GaussianRound(FlatPoissonScheme(0.05), 1.0)
#: Far above the milliseconds one of these compositions takes, on any machine under any load.
PATIENCE_S = 120.0


def _exposures(rounds: int) -> Exposures:
    return Exposures((((EVENT, rounds),),), 1e-5, "task")


@pytest.mark.unit
def test_the_curve_computes_its_guesses_without_being_asked() -> None:
    curve = EpsilonCurve()
    try:
        curve.guess([_exposures(1), _exposures(2)])
        deadline = time.monotonic() + PATIENCE_S
        while curve.get(_exposures(2)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert curve.get(_exposures(1)) == epsilon([(EVENT, 1)], 1e-5, "task")
        assert curve.get(_exposures(2)) == epsilon([(EVENT, 2)], 1e-5, "task")
        assert curve.get(_exposures(3)) is None  # nothing is made up
        assert curve.wait(_exposures(3)) == epsilon([(EVENT, 3)], 1e-5, "task")
    finally:
        curve.close()
    curve._thread.join(PATIENCE_S)
    assert not curve._thread.is_alive()


@pytest.mark.unit
def test_a_failed_composition_leaves_no_value_and_the_curve_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rounds = RoundEpsilons(lambda r: True)
    try:
        bad = Exposures((((EVENT, 1),),), 2.0, "task")  # delta outside (0, 1): epsilon raises
        assert rounds.after_spend(bad) is None
        assert "could not be computed" in caplog.text
        assert rounds.after_spend(_exposures(1)) == epsilon([(EVENT, 1)], 1e-5, "task")
    finally:
        rounds.close()


def _outcome(r: int, eps: float | None) -> RoundOutcome:
    return RoundOutcome("run", "fed", r, participants_sampled=3, participants_replied=3,
                        train_loss=0.5, epsilon_task=eps)  # fmt: skip


@pytest.mark.unit
def test_the_progress_line_shows_epsilon_from_round_one_and_says_which_round_it_is_for() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream=stream, every=1)
    bar.run_started(RunStarted("run", "fed", True, 8.0, 1e-5, 1.0, 1.0, 4, 4, 0.0, None, 6, "mse",
                               False))  # fmt: skip
    for r, eps in [(1, 0.5), (2, 0.625), (3, 0.75), (4, None)]:
        bar.round_finished(_outcome(r, eps))
    lines = stream.getvalue().splitlines()
    assert "round 1/4 | eps 0.500/8 |" in lines[0]
    assert "round 2/4 | eps 0.625/8 |" in lines[1]
    assert "round 3/4 | eps 0.750/8 |" in lines[2]
    # A record without epsilon (privacy.report_every > 1): the latest, and whose it is.
    assert "round 4/4 | eps 0.750/8 (after round 3) |" in lines[3]


@pytest.mark.integration
def test_every_record_row_and_progress_line_carry_the_ledgers_epsilon_after_its_round(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, [*SMALL, f"privacy.ledger_path={tmp_path / 'ledger.sqlite'}",
                             "rounds=3", "training.eval_every=10"])  # fmt: skip
    assert cfg.privacy.report_every == 1  # the default: every round
    opened: list[BudgetLedger] = []

    def open_ledger(c: Any, registered: Any) -> BudgetLedger:
        opened.append(open_budget(c, registered))
        return opened[-1]

    class LedgerSays:  # what the ledger itself reports after each round (its own PLD)
        def __init__(self) -> None:
            self.values: list[float] = []

        def run_started(self, event: Any) -> None:
            pass

        def round_finished(self, outcome: RoundOutcome) -> None:
            self.values.append(opened[0].epsilon())

        def run_finished(self, event: Any) -> None:
            pass

    said, stream = LedgerSays(), io.StringIO()
    result = execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=tmp_path / "run",
                     observers=[said, ProgressBar(stream=stream, every=1)], echo=False,
                     open_ledger=open_ledger)  # fmt: skip
    records = [o.epsilon_task for o in result.outcomes]
    assert len(records) == 3 and records == said.values  # exact: the same floats
    assert records == sorted(records) and records[0] < records[-1]
    with (tmp_path / "run" / "rounds.csv").open() as f:
        assert [float(row["epsilon"]) for row in csv.DictReader(f)] == records
    lines = stream.getvalue().splitlines()
    for r, eps in enumerate(records, start=1):
        assert f"round {r}/3 | eps {eps:.3f}/" in lines[r - 1]
    assert "after round" not in stream.getvalue()
    assert result.summary["epsilon_spent"] == records[-1]
