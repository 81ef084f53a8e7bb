"""One contract, every ledger: ``BudgetLedger`` and the fake ``LinearLedger`` pass one suite.

In the manner of dp-accounting's accountant tests: no records gives epsilon 0; a failed spend leaves
state unchanged; ``would_exceed`` agrees with ``spend``; ``position`` counts records; records keep
their order and run ids; ``rounds()`` groups identical events.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.accounting.fakes import LinearLedger

from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    Hold,
    Ledger,
    LedgerError,
    Participant,
)

pytestmark = pytest.mark.unit

BUDGET, DELTA = 0.8, 1e-5
# Under PLD at this budget: 4 rounds of A, 6 of B (seconds of search, not minutes).
A = GaussianRound(FlatPoissonScheme(0.5), 5.0)
B = GaussianRound(FlatPoissonScheme(0.4), 5.0)
A_REPLACE = GaussianRound(FlatPoissonScheme(0.5), 5.0, neighbouring="replace_one")


@pytest.fixture(params=["BudgetLedger", "LinearLedger"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "BudgetLedger":
        real = BudgetLedger.open(tmp_path / "ledger.sqlite", "fed", BUDGET, DELTA)
        yield real
        real.close()
    else:
        yield LinearLedger(epsilon_budget=BUDGET, delta=DELTA, eps_per_round=0.2)


def _state(ledger: Ledger) -> tuple[object, ...]:
    return (
        ledger.position(),
        [(r.position, r.run_id, r.round_index, r.event, r.hash) for r in ledger.records()],
        ledger.rounds(),
        ledger.epsilon(),
        ledger.rounds_affordable(A),
    )


def test_members_describe_the_ledger(ledger: Ledger) -> None:
    assert isinstance(ledger, Ledger)
    assert isinstance(ledger.federation_id, str) and ledger.federation_id
    assert isinstance(ledger.ledger_id, str) and len(ledger.ledger_id) == 32
    assert ledger.path.is_absolute()
    assert ledger.epsilon_budget == BUDGET and ledger.delta == DELTA
    assert ledger.unit == "task" and ledger.neighbouring == "add_remove"


def test_no_records_gives_epsilon_zero(ledger: Ledger) -> None:
    assert ledger.position() == 0 and ledger.records() == [] and ledger.rounds() == []
    assert ledger.epsilon() == 0.0
    assert ledger.epsilon(method="rdp") == 0.0
    assert ledger.epsilon(unit="participant") == 0.0


def test_would_exceed_agrees_with_spend(ledger: Ledger) -> None:
    affordable = ledger.rounds_affordable(A)
    assert affordable >= 2
    spent = 0
    while not ledger.would_exceed(A):
        before = ledger.rounds_affordable(A)
        ledger.spend(A, "run", spent)
        spent += 1
        assert ledger.rounds_affordable(A) == before - 1
        assert ledger.epsilon() <= BUDGET
    assert spent == affordable
    with pytest.raises(BudgetExhausted) as refused:
        ledger.spend(A, "run", spent)
    assert refused.value.epsilon_after > refused.value.epsilon_budget == BUDGET


def test_a_failed_spend_leaves_state_unchanged(ledger: Ledger) -> None:
    ledger.spend(A, "run", 0)
    before = _state(ledger)
    with pytest.raises(ValueError, match="round_index must be"):
        ledger.spend(A, "run", -1)
    with pytest.raises(ValueError, match="run_id must be"):
        ledger.spend(A, "", 1)
    with pytest.raises(LedgerError, match="neighbouring must match"):
        ledger.spend(A_REPLACE, "run", 1)
    assert _state(ledger) == before
    while not ledger.would_exceed(A):
        ledger.spend(A, "run", ledger.position())
    exhausted = _state(ledger)
    with pytest.raises(BudgetExhausted):
        ledger.spend(A, "run", 99)
    assert _state(ledger) == exhausted


def test_position_counts_records_which_keep_order_and_run_ids(ledger: Ledger) -> None:
    plan = [("run-a", 0), ("run-b", 0), ("run-a", 1), ("run-b", 1)]
    for run_id, index in plan:
        record = ledger.spend(A, run_id, index)
        assert record.position == ledger.position() - 1
        assert record.federation_id == ledger.federation_id
    records = ledger.records()
    assert ledger.position() == len(records) == len(plan)
    assert [(r.run_id, r.round_index) for r in records] == plan
    assert [r.position for r in records] == list(range(len(plan)))


def test_rounds_groups_identical_events(ledger: Ledger) -> None:
    for event in (A, B, A):
        ledger.spend(event, "run", ledger.position())
    assert dict(ledger.rounds()) == {A: 2, B: 1}
    assert sum(c for _, c in ledger.rounds()) == ledger.position()


def test_epsilon_grows_with_every_spend(ledger: Ledger) -> None:
    previous = ledger.epsilon()
    for i in range(2):
        ledger.spend(B, "run", i)
        now = ledger.epsilon()
        assert now > previous
        previous = now


def test_exposures_and_projection_are_what_epsilon_composes(ledger: Ledger) -> None:
    """Where a ledger gives its exposures, their epsilon is its own (the server's epsilon curve
    relies on it); where it gives none (a linear fake), it gives no projection either."""
    for i in range(2):
        ledger.spend(A, "run", i)
    exposures = ledger.exposures(unit="task")
    projection = ledger.projection(A)
    if exposures is None:
        assert projection is None
        return
    assert exposures.epsilon() == pytest.approx(ledger.epsilon(unit="task"), rel=1e-9)
    assert projection is not None and projection.now == exposures


def test_checkpoint_binds_a_resume_to_this_ledger(ledger: Ledger) -> None:
    ledger.spend(A, "run", 0)
    saved = ledger.checkpoint()
    assert saved.position == 1 and saved.ledger_id == ledger.ledger_id
    ledger.check_resume(saved)  # the same ledger, not behind: accepted
    ledger.spend(A, "run", 1)
    ledger.check_resume(saved)  # ahead of the checkpoint: accepted
    assert ledger.anchor() is None or isinstance(ledger.anchor(), dict)


def test_a_reservation_counts_for_later_starts_until_it_ends(ledger: Ledger) -> None:
    """Runs at once over the same data (ledger/reservations.py): a later start counts an earlier
    run's reserved rounds not yet spent; the earlier run never reads the later one; an ended
    reservation counts no more."""
    who = [Participant("data-a", "a")]
    ledger.use_cohort(who)
    fresh = ledger.rounds_affordable(A)
    assert fresh >= 3
    first = ledger.reserve(who, A, fresh - 1, run_id="first")
    assert first.others == () and first.since == 0
    second = ledger.reserve(who, A, 3, run_id="second")
    assert [r.run_id for r in second.others] == ["first"]
    assert ledger.affording(who, A, run_id="second", hold=second) == {"a"}  # fresh - 1 + 1
    ledger.spend(A, "second", 0)
    assert ledger.affording(who, A, run_id="second", hold=second) == frozenset()  # + 1 more
    assert ledger.affording(who, A, run_id="first", hold=first) == {"a"}  # never reads "second"
    ledger.spend(A, "first", 0)
    again = ledger.reserve(who, A, 2, run_id="second")  # a resume: reserves anew
    assert [(r.run_id, r.rounds) for r in again.others] == [("first", fresh - 1)]
    ledger.end_reservation("first")
    third = ledger.reserve(who, A, 1, run_id="third")
    assert [r.run_id for r in third.others] == ["second"]
    assert [r.run_id for r in ledger.reserve(who, A, 1, run_id="third").others] == ["second"]


def test_a_runs_own_figures_and_who_takes_part(ledger: Ledger) -> None:
    """The individual filter's figures (ledger/individual.py): the run's own, whatever came before.

    A run's epsilon and rounds affordable count its own spends alone; who takes part is decided
    from the ledger as the run found it (``since``) and the run's own spends.
    """
    who = [Participant("data-a", "a")]
    ledger.use_cohort(who)
    fresh = ledger.rounds_affordable(A)
    assert ledger.affording(who, A, run_id="second", hold=Hold(0)) == {"a"}
    ledger.spend(A, "first", 0)
    assert ledger.run_rounds("second") == [] and ledger.run_epsilon("second") == 0.0
    assert ledger.run_rounds_affordable("second", A) == fresh
    ledger.spend(A, "second", 0)
    assert ledger.run_rounds("second") == [(A, 1)]
    assert ledger.run_epsilon("second") == pytest.approx(ledger.run_epsilon("first"))
    assert ledger.run_rounds_affordable("second", A) == fresh - 1
    assert fresh >= 3  # the constants: what follows tells the cases apart
    assert ledger.affording(who, A, run_id="second", hold=Hold(1)) == {"a"}  # 1 + 1 + 1
    assert ledger.affording(who, A, run_id="second", hold=Hold(2)) == {"a"}  # 1 + 1, counted once
    ledger.use_cohort([])  # charged to nobody: recorded, every participant's epsilon unchanged
    spent = ledger.epsilon()
    ledger.spend(A, "second", 1)
    assert ledger.position() == 3 and ledger.epsilon() == spent
    assert ledger.run_rounds("second") == [(A, 2)]
