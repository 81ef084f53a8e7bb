"""A participant's allowance (ledger/allowance.py, ledger/individual.py): the filter's k_p.

For one participant it is exactly what ``BudgetLedger.rounds_affordable`` says of that participant
alone, capped at the run's rounds; it ignores the asking run's own spends (a resumed run gets its
start's answer); and a round charged to nobody is recorded without changing any participant's
composition, even when every participant's budget is spent.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    Hold,
    Participant,
    epsilon,
)
from fedmeta.accounting.ledger import allowance, multiset
from fedmeta.accounting.schemes import Unit

DELTA = 1e-5
EARLIER = GaussianRound(FlatPoissonScheme(0.2), 1.0)
RUN = GaussianRound(FlatPoissonScheme(0.1), 1.2)
COSTLIER = GaussianRound(FlatPoissonScheme(0.3), 1.2)  # the same run, a smaller population
BUDGET = epsilon([(EARLIER, 6)], DELTA, "task")
TERMS: tuple[float, float, Unit] = (BUDGET, DELTA, "task")
A, B = Participant("data-a", "a"), Participant("data-b", "b")
C = Participant("data-c", "c")


def _ledger(path: Path) -> BudgetLedger:
    return BudgetLedger.open(path, "fed", BUDGET, DELTA)


@pytest.mark.unit
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(earlier=st.integers(0, 6), rounds=st.integers(0, 40))
def test_allowance_of_one_participant_is_its_rounds_affordable(
    tmp_path_factory: pytest.TempPathFactory, earlier: int, rounds: int
) -> None:
    with _ledger(tmp_path_factory.mktemp("a") / "ledger.sqlite") as ledger:
        ledger.use_cohort([A])
        for i in range(earlier):
            ledger.spend(EARLIER, "earlier", i)
        affordable = ledger.rounds_affordable(RUN)
        pure = allowance([multiset(Counter(dict(ledger.rounds())))], RUN, rounds, TERMS)
        assert pure == min(rounds, affordable)
        taking = ledger.affording([A, B], RUN, run_id="run", hold=Hold(ledger.position()))
        fresh = ledger.run_rounds_affordable("run", RUN)  # b: no earlier spend
        assert taking == {name for name, left in (("a", affordable), ("b", fresh)) if left >= 1}


@pytest.mark.integration
def test_affording_reads_the_ledger_as_found_and_the_runs_own_spends(tmp_path: Path) -> None:
    with _ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.use_cohort([A])
        for i in range(4):
            ledger.spend(EARLIER, "earlier", i)
        since = ledger.position()
        k = allowance([multiset(Counter(dict(ledger.rounds())))], RUN, 50, TERMS)
        assert 0 < k < 50
        ledger.use_cohort([A, B])
        for i in range(k):
            assert ledger.affording([A, B], RUN, run_id="run", hold=Hold(since)) == {"a", "b"}
            ledger.spend(RUN, "run", i)
        assert ledger.affording([A, B], RUN, run_id="run", hold=Hold(since)) == {"b"}  # a: spent
        resumed = ledger.position()  # a resume: the ledger as it finds it, its own spends in it
        assert ledger.affording([A, B], RUN, run_id="run", hold=Hold(resumed)) == {"b"}
        # Another run's spends after the start are not read (the ledger's check still is).
        ledger.use_cohort([B])
        for i in range(3):
            ledger.spend(RUN, "other", i)
        assert ledger.affording([B], RUN, run_id="run", hold=Hold(since)) == {"b"}
        assert ledger.affording([B], RUN, run_id="next", hold=Hold(ledger.position())) == {"b"}
        assert ledger.run_rounds("run") == [(RUN, k)]
        assert ledger.run_epsilon("run") == pytest.approx(epsilon([(RUN, k)], DELTA))


@pytest.mark.integration
def test_a_costlier_round_excludes_whom_it_would_take_over_the_budget(tmp_path: Path) -> None:
    """The round's own event decides: with the plan's, participant a takes one more round; with
    the costlier event of a smaller population it is excluded, and the spend charged to b alone
    is accepted, where charging a would have been refused (issue 52: a stop that followed a's
    earlier spends)."""
    with _ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.use_cohort([A])
        for i in range(4):
            ledger.spend(EARLIER, "earlier", i)
        since = ledger.position()
        ledger.use_cohort([A, B])
        k = allowance([multiset(Counter(dict(ledger.rounds())))], RUN, 50, TERMS)
        for i in range(k - 1):
            ledger.spend(RUN, "run", i)
        assert ledger.affording([A, B], RUN, run_id="run", hold=Hold(since)) == {"a", "b"}
        assert ledger.would_exceed(COSTLIER)  # charged to a as the plan's cohort: refused
        assert ledger.affording([A, B], COSTLIER, run_id="run", hold=Hold(since)) == {"b"}
        ledger.use_cohort([B])
        ledger.spend(COSTLIER, "run", k - 1)  # the filter's cohort: accepted
        assert all(p.epsilon <= BUDGET * (1 + 1e-9) for p in ledger.participants())


@pytest.mark.integration
def test_a_round_charged_to_nobody_is_recorded_and_charges_nobody(tmp_path: Path) -> None:
    with _ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.use_cohort([A, B])
        for i in range(6):
            ledger.spend(EARLIER, "earlier", i)
        spent = ledger.epsilon()
        assert ledger.would_exceed(EARLIER)  # every participant's budget is spent
        ledger.use_cohort([])
        assert not ledger.would_exceed(EARLIER)
        ledger.spend(EARLIER, "run", 0)  # the number of spends stays public
        assert ledger.position() == 7 and ledger.epsilon() == spent
        assert [p.rounds for p in ledger.participants()] == [6, 6]
        ledger.use_cohort([A])
        assert ledger.would_exceed(EARLIER)  # the ledger still never records a charge over budget


def _interleaved(ledger: BudgetLedger, reserved: bool) -> dict[str, int]:
    """Run "r" and, started after r's first spend, run "b", over the same participant a's data
    (b also has c), alternating spends: each round charged to whom its run's decision admits.

    ``reserved=False`` is the negative control: b's decisions ignore r's reservation, as they
    did before reservations existed. Returns each run's spends a took part in.
    """
    fresh = ledger.run_rounds_affordable("nobody", RUN)
    plans = {"r": fresh // 2 + 1, "b": fresh}
    holds = {"r": ledger.reserve([A], RUN, plans["r"], run_id="r")}
    took = {"r": 0, "b": 0}

    def one(run: str, who: list[Participant], index: int) -> None:
        taking = ledger.affording(who, RUN, run_id=run, hold=holds[run])
        ledger.use_cohort([p for p in who if p.name in taking])
        ledger.spend(RUN, run, index)  # BudgetExhausted: the stop that would follow overlap
        took[run] += "a" in taking

    one("r", [A], 0)
    b = ledger.reserve([A, C], RUN, plans["b"], run_id="b")
    holds["b"] = b if reserved else Hold(b.since)
    for i in range(1, max(plans.values())):
        if i < plans["r"]:
            one("r", [A], i)
        one("b", [A, C], i - 1)
    return took


@pytest.mark.integration
def test_concurrent_runs_over_the_same_data_never_meet_the_ledgers_refusal(tmp_path: Path) -> None:
    """Reservations (ledger/reservations.py): the later run leaves room for the earlier one's
    reserved rounds, so neither is ever refused for the overlap; without them (the control) the
    ledger refuses one of them, a stop that would tell which data overlaps."""
    with _ledger(tmp_path / "ledger.sqlite") as ledger:
        took = _interleaved(ledger, reserved=True)
        fresh = ledger.run_rounds_affordable("nobody", RUN)
        assert took == {"r": fresh // 2 + 1, "b": fresh - (fresh // 2 + 1)}  # a: the budget, once
        assert all(p.epsilon <= BUDGET * (1 + 1e-9) for p in ledger.participants())
    with _ledger(tmp_path / "control.sqlite") as ledger, pytest.raises(BudgetExhausted):
        _interleaved(ledger, reserved=False)
