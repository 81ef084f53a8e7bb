"""The ledger's exposures and projection (fedmeta.accounting.ledger.projection): epsilon after k.

Contract: ``projection.after(k).epsilon()`` is the very float ``ledger.epsilon()`` returns after
``k`` more spends of the projected event in the projected cohort, with one cohort and with
several (the maximum over participants); when something else happens (another cohort spends) the
projection no longer matches the ledger's exposures, and those exposures still give the ledger's
value. Oracle: ``composition.epsilon`` of each participant's own rounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmeta.accounting import (
    BudgetLedger,
    Exposures,
    FlatPoissonScheme,
    GaussianRound,
    Participant,
    SpendProjection,
    epsilon,
)

pytestmark = pytest.mark.unit

EVENT = GaussianRound(FlatPoissonScheme(0.05), 1.0)  # a cheap PLD (milliseconds)
DELTA = 1e-5
BUDGET = 2.5  # a few dozen rounds: the ledger's affordability search stays quick
PEOPLE = [Participant(f"data#participant={i}", str(i)) for i in range(4)]


def _eps(rounds: int) -> float:
    return epsilon([(EVENT, rounds)], DELTA, "task")


def test_the_curve_after_k_spends_is_the_ledgers_epsilon_and_grows(tmp_path: Path) -> None:
    with BudgetLedger.open(tmp_path / "l.sqlite", "fed", BUDGET, DELTA, participants=PEOPLE) as led:
        projection = led.projection(EVENT)
        assert projection.after(0) == led.exposures()
        assert projection.after(0).epsilon() == led.epsilon() == 0.0
        curve = []
        for k in range(1, 5):
            led.spend(EVENT, "run", k - 1)
            assert led.exposures() == projection.after(k)
            curve.append(projection.after(k).epsilon())
            assert curve[-1] == led.epsilon()  # the same float, not an approximation
            assert curve[-1] == _eps(k)
    assert all(a < b for a, b in zip(curve, curve[1:], strict=False)), curve


def test_with_several_cohorts_the_curve_is_the_maximum_over_participants(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with BudgetLedger.open(db, "fed", BUDGET, DELTA, participants=PEOPLE[:2]) as led:
        for i in range(3):
            led.spend(EVENT, "run-a", i)
    # Participants 2 and 3 only: participants 0 and 1 keep their 3 rounds and dominate until the
    # new cohort has spent more than 3.
    with BudgetLedger.open(db, "fed", participants=PEOPLE[2:]) as led:
        projection = led.projection(EVENT)
        assert sorted(projection.charged) == [False, True]
        for k in range(1, 5):
            led.spend(EVENT, "run-b", k - 1)
            assert led.exposures() == projection.after(k)
            assert projection.after(k).epsilon() == led.epsilon() == _eps(max(3, k))
    # Participants 1 and 2 (3 and 4 rounds so far): the next spends add to both, 2 dominates.
    with BudgetLedger.open(db, "fed", participants=PEOPLE[1:3]) as led:
        projection = led.projection(EVENT)
        for k in range(1, 3):
            led.spend(EVENT, "run-c", k - 1)
            assert projection.after(k).epsilon() == led.epsilon() == _eps(4 + k)


def test_a_projection_is_a_guess_the_ledgers_exposures_are_the_truth(tmp_path: Path) -> None:
    with BudgetLedger.open(tmp_path / "l.sqlite", "fed", BUDGET, DELTA, participants=PEOPLE) as led:
        led.spend(EVENT, "run", 0)
        projection = led.projection(EVENT)
        led.use_cohort(PEOPLE[:1])  # the next round may sample one participant only
        led.spend(EVENT, "run", 1)
        assert led.exposures() == projection.after(1)  # still every participant's maximum
        other = GaussianRound(FlatPoissonScheme(0.05), 2.0)
        led.spend(other, "run", 2)  # another kind of round: the guess no longer holds
        assert led.exposures() != projection.after(2)
        assert led.exposures().epsilon() == led.epsilon()


def test_a_projection_refuses_bad_arguments() -> None:
    now = Exposures(((),), DELTA, "task")
    with pytest.raises(ValueError, match="charged must have one flag per group"):
        SpendProjection(now, EVENT, ())
    with pytest.raises(ValueError, match="spends must be an integer >= 0"):
        SpendProjection(now, EVENT, (True,)).after(-1)
    assert SpendProjection(now, EVENT, (True,)).after(2).groups == (((EVENT, 2),),)
    assert SpendProjection(now, EVENT, (False,)).after(2).groups == ((),)
