"""A tuning release in the ledger (ledger/appending.py, tuning_release.py): one record, composed.

A private tuning run (Papernot and Steinke 2022) is recorded as one spend holding its RDP curve;
every epsilon the ledger computes afterwards composes the rounds before it, the release and the
rounds after it (by RDP where a group holds a release), and its refusals follow. A ledger written
before releases existed opens unchanged and takes one.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    Participant,
    epsilon,
)
from fedmeta.accounting.tuning import (
    Candidate,
    NegativeBinomialTrials,
    PoissonTrials,
    TuningRun,
    describe,
    release_of,
    tuning_epsilon,
)
from fedmeta.accounting.tuning_release import TuningRelease, release_affordable, release_epsilon

pytestmark = pytest.mark.unit
ROUND = GaussianRound(FlatPoissonScheme(0.01), 1.1)
RUN = TuningRun((Candidate("a", ROUND, 40), Candidate("b", ROUND, 20)), PoissonTrials(4.0))
RELEASE = release_of(RUN, describe(RUN))
BEFORE = Path(__file__).with_name("ledger_before_tuning.sql")


def _open(path: Path, budget: float = 4.0) -> BudgetLedger:
    return BudgetLedger.open(path, "fed", budget, 1e-5)


def test_a_release_round_trips_and_rejects_bad_curves() -> None:
    assert TuningRelease.from_dict(json.loads(json.dumps(RELEASE.to_dict()))) == RELEASE
    with pytest.raises(ValueError, match="strictly increasing"):
        TuningRelease((2.0, 2.0), (0.1, 0.2), None, None, "add_remove", "x")
    with pytest.raises(ValueError, match="RDP values >= 0"):
        TuningRelease((2.0, 3.0), (0.1, float("nan")), None, None, "add_remove", "x")
    # A curve recorded on another grid is read at the next order up (errs high), inf above it.
    coarse = TuningRelease((2.0, 64.0), (0.5, 9.0), None, None, "add_remove", "x")
    curve = coarse.curve("task")
    assert curve[0] == 0.5 and curve[-1] == float("inf") and coarse.curve("participant")[0] > 1e300


def test_rounds_then_a_tuning_release_then_rounds_compose(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with _open(db) as ledger:
        for i in range(30):
            ledger.spend(ROUND, "earlier", i)
        before = ledger.epsilon()
        assert ledger.epsilon_after_release(RELEASE) == pytest.approx(
            tuning_epsilon(RUN, 1e-5, [[(ROUND, 30)]]), rel=1e-9
        )
        ledger.spend_release(RELEASE, "tune-1")
        for i in range(10):
            ledger.spend(ROUND, "later", i)
    with BudgetLedger.open_readonly(db, "fed") as ledger:
        assert ledger.position() == 41 and ledger.records()[30].event == RELEASE
        expected = release_epsilon([(ROUND, 40), (RELEASE, 1)], 1e-5, "task")
        assert ledger.epsilon() == pytest.approx(expected, rel=1e-12)
        assert ledger.exposures().epsilon() == pytest.approx(expected, rel=1e-12)
        # The later run's epsilon includes the tuning: above the rounds alone, and above before.
        assert expected > epsilon([(ROUND, 40)], 1e-5) > before
        assert dict(ledger.rounds()) == {ROUND: 40, RELEASE: 1}


def test_the_rounds_left_after_a_release_are_the_rdp_composition(tmp_path: Path) -> None:
    with _open(tmp_path / "ledger.sqlite", budget=1.6) as ledger:
        ledger.spend_release(RELEASE, "tune-1")
        left = ledger.rounds_affordable(ROUND)
        assert left == release_affordable([(RELEASE, 1)], ROUND, 1.6, 1e-5, "task") > 0
        for i in range(left):
            ledger.spend(ROUND, "later", i)
        assert ledger.would_exceed(ROUND) and ledger.epsilon() <= 1.6
        with pytest.raises(BudgetExhausted, match="this round would take"):
            ledger.spend(ROUND, "later", left)
        assert ledger.position() == 1 + left


def test_a_release_over_the_budget_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with _open(db, budget=0.5) as ledger:
        ledger.spend(ROUND, "earlier", 0)
        assert ledger.epsilon_after_release(RELEASE) > 0.5
        with pytest.raises(BudgetExhausted, match="this tuning release would take .* nothing was"):
            ledger.spend_release(RELEASE, "tune-1")
        assert ledger.position() == 1
    with BudgetLedger.open_readonly(db, "fed") as ledger:
        assert [r.run_id for r in ledger.records()] == ["earlier"]


def test_a_release_is_charged_to_its_cohort_only(tmp_path: Path) -> None:
    alice, bob = Participant("p0", "alice"), Participant("p1", "bob")
    with _open(tmp_path / "ledger.sqlite") as ledger:
        ledger.use_cohort([alice, bob])
        ledger.spend(ROUND, "both", 0)
        ledger.use_cohort([bob])
        ledger.spend_release(RELEASE, "tune-bob")
        alone, tuned = sorted(p.epsilon for p in ledger.participants())
    assert alone == pytest.approx(epsilon([(ROUND, 1)], 1e-5))
    assert tuned == pytest.approx(release_epsilon([(ROUND, 1), (RELEASE, 1)], 1e-5, "task"))


def test_a_negative_binomial_release_at_participant_level_without_a_cap_has_no_bound() -> None:
    run = TuningRun((Candidate("a", ROUND, 10),), NegativeBinomialTrials.from_mean(1.0, 3.0))
    release = release_of(run, describe(run))
    assert release.participant is None and release.participant_cap is None
    assert "truncated negative binomial(eta 1" in release.description
    assert epsilon([(release, 1)], 1e-5, "participant") == float("inf")


def test_a_ledger_written_before_releases_opens_keeps_its_records_and_takes_one(
    tmp_path: Path,
) -> None:
    """``ledger_before_tuning.sql``: a ledger written by the code before this change, dumped."""
    lines = BEFORE.read_text().splitlines()
    anchor = json.loads(lines[1].removeprefix("-- anchor: "))
    db = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript("\n".join(lines))
    conn.execute("PRAGMA journal_mode = WAL")
    conn.close()
    db.with_name(db.name + ".anchor").write_text(json.dumps(anchor))
    with BudgetLedger.open(db, "fed-before-tuning") as ledger:
        old = ledger.records()
        assert len(old) == 5 and ledger.epsilon() == pytest.approx(0.22516460790331472, rel=1e-6)
        ledger.spend_release(RELEASE, "tune-1")
        ledger.spend(ROUND, "later", 0)
    with BudgetLedger.open_readonly(db, "fed-before-tuning") as ledger:
        assert ledger.records()[:5] == old and len(ledger.records()) == 7
        # bob was in both cohorts (5 rounds), and is charged the release and the last round.
        assert ledger.epsilon() == pytest.approx(
            release_epsilon([(ROUND, 6), (RELEASE, 1)], 1e-5, "task"), rel=1e-12
        )


def test_ledger_show_names_a_release_by_its_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedmeta.cli import main

    db = tmp_path / "ledger.sqlite"
    with _open(db) as ledger:
        ledger.spend(ROUND, "earlier", 0)
        ledger.spend_release(RELEASE, "tune-1")
        spent = ledger.epsilon()
    assert main(["ledger", "show", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "1 x tuning: K ~ Poisson(mean 4) trials over 2 candidates (a: 40 rounds" in out
    assert f"epsilon {spent:.4g}" in out and "run tune-1: 1 spends" in out
    assert main(["ledger", "show", "--db", str(db), "--json"]) == 0
    assert '"kind": "tuning_release"' in capsys.readouterr().out
