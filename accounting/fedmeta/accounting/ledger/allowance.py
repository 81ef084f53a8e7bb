"""A participant's allowance: how many of a run's rounds its data may take part in (issue 52).

The individual filter (docs/privacy.md, "Overlap and the individual filter") fixes, once, before a
run's first spend, each participant ``p``'s allowance ``k_p``: the largest ``k <= T`` (the run's
planned rounds) such that, for every data record ``p``'s items are charged to (ledger/overlap.py),
the PLD composition of the record's earlier rounds and ``k`` rounds of the run's event stays within
the budget. ``p`` takes part in the run's first ``k_p`` rounds; in later ones the server discards
its replies before the sum, and the round is charged to the participants still taking part.

**Why this is a valid guarantee, and which theorem.** Neighbouring datasets ``D``, ``D'`` differ by
one task ``x`` of ``p``. Every other participant's allowance is a function of its own items and the
ledger before the run, so it is the same under both; when ``k_p`` is too, each round's dominating
pair is fixed before round 1 (the event for rounds ``t <= k_p``, the identity after: nothing of
``p`` enters the sum). The composition theorem for dominating pairs of adaptively composed
mechanisms (Zhu, Dong and Wang 2022, "Optimal accounting of differential privacy via characteristic
function", Definition 7 and its composition theorem: the PLD composition accounting/composition.py
computes) then bounds ``x``'s loss in this run by ``k_p`` rounds of the event. It holds for each
fixed pair of datasets, so the number of rounds may depend on the data (individual privacy
accounting: Feldman and Zrnic 2021, "Individual privacy accounting via a Rényi filter", whose
individual loss is stated for a fixed pair of neighbouring datasets), but never on the outputs:
nothing here reads one, so no filter theorem is needed (Rogers, Roth, Ullman and Vadhan 2016,
"Privacy odometers and filters: pay-as-you-go composition", separate exactly this case, parameters
fixed up front, from filters). With the earlier runs, ``x``'s loss is the composition of its
record's earlier rounds and ``k_p`` rounds: within the budget by the choice of ``k_p``. It errs high
where the ledger does: the PLD is discretised pessimistically, and a record is charged for every
round ``p`` takes part in although a task uses only some of its items.

Pure: the answer depends only on the arguments (the search defaults to
``calibration.affordable_rounds``, what ``BudgetLedger.rounds_affordable`` runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fedmeta.accounting.calibration import affordable_rounds
from fedmeta.accounting.ledger.participants import Multiset
from fedmeta.accounting.levels import AnyRound
from fedmeta.accounting.schemes import Unit

#: ``search(base, event)``: the largest total count of ``event`` affordable beside ``base``.
Search = Callable[[tuple[Any, ...], AnyRound], int]


def without(rounds: Multiset, event: AnyRound) -> tuple[tuple[Any, ...], int]:
    """``rounds`` split into the rounds other than ``event`` and the count of ``event``."""
    base = tuple(sorted(((e, c) for e, c in rounds if e != event), key=repr))
    return base, sum(c for e, c in rounds if e == event)


def allowance(
    records: Sequence[Multiset],
    event: AnyRound,
    rounds: int,
    budget: tuple[float, float, Unit],
    search: Search | None = None,
) -> int:
    """``k_p``: how many rounds of ``event``, at most ``rounds``, every one of ``records`` affords.

    ``records``: the earlier rounds of each data record the participant is charged to (none: a
    participant with no earlier spend); ``budget``: (epsilon, delta, unit) of the federation.
    ``search`` replaces ``affordable_rounds`` (a ledger passes its cached one; same answers).
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0; got {rounds!r}")
    epsilon_budget, delta, unit = budget

    def fresh(base: tuple[Any, ...], ev: AnyRound) -> int:
        return affordable_rounds(base, ev, epsilon_budget, delta, unit)

    find = search or fresh
    left = rounds
    for rounds_of_record in records or [()]:
        base, count = without(rounds_of_record, event)
        left = min(left, find(base, event) - count)
    return max(0, left)
