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
        assert ledger.allowances([A, B], RUN, rounds, run_id="run") == {
            "a": min(rounds, affordable),
            "b": min(rounds, ledger.run_rounds_affordable("run", RUN)),  # no earlier spend
        }


@pytest.mark.integration
def test_allowances_ignore_the_asking_runs_own_spends(tmp_path: Path) -> None:
    with _ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.use_cohort([A])
        for i in range(4):
            ledger.spend(EARLIER, "earlier", i)
        before = ledger.allowances([A, B], RUN, 50, run_id="run")
        assert 0 < before["a"] < before["b"] <= 50
        ledger.use_cohort([A, B])
        for i in range(before["a"]):
            ledger.spend(RUN, "run", i)
        assert ledger.allowances([A, B], RUN, 50, run_id="run") == before  # a resume's answer
        assert ledger.allowances([A, B], RUN, 50, run_id="next")["a"] == 0  # a later run's
        assert ledger.run_rounds("run") == [(RUN, before["a"])]
        assert ledger.run_epsilon("run") == pytest.approx(epsilon([(RUN, before["a"])], DELTA))


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
