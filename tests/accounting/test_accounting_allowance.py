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

from fedmeta.accounting import BudgetLedger, FlatPoissonScheme, GaussianRound, Participant, epsilon
from fedmeta.accounting.ledger import allowance, multiset
from fedmeta.accounting.schemes import Unit

DELTA = 1e-5
EARLIER = GaussianRound(FlatPoissonScheme(0.2), 1.0)
RUN = GaussianRound(FlatPoissonScheme(0.1), 1.2)
COSTLIER = GaussianRound(FlatPoissonScheme(0.3), 1.2)  # the same run, a smaller population
BUDGET = epsilon([(EARLIER, 6)], DELTA, "task")
TERMS: tuple[float, float, Unit] = (BUDGET, DELTA, "task")
A, B = Participant("data-a", "a"), Participant("data-b", "b")


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
        taking = ledger.affording([A, B], RUN, run_id="run", since=ledger.position())
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
            assert ledger.affording([A, B], RUN, run_id="run", since=since) == {"a", "b"}
            ledger.spend(RUN, "run", i)
        assert ledger.affording([A, B], RUN, run_id="run", since=since) == {"b"}  # a: spent
        resumed = ledger.position()  # a resume: the ledger as it finds it, its own spends in it
        assert ledger.affording([A, B], RUN, run_id="run", since=resumed) == {"b"}
        # Another run's spends after the start are not read (the ledger's check still is).
        ledger.use_cohort([B])
        for i in range(3):
            ledger.spend(RUN, "other", i)
        assert ledger.affording([B], RUN, run_id="run", since=since) == {"b"}
        assert ledger.affording([B], RUN, run_id="next", since=ledger.position()) == {"b"}
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
        assert ledger.affording([A, B], RUN, run_id="run", since=since) == {"a", "b"}
        assert ledger.would_exceed(COSTLIER)  # charged to a as the plan's cohort: refused
        assert ledger.affording([A, B], COSTLIER, run_id="run", since=since) == {"b"}
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
