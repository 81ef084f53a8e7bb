"""A participant's allowance: how many rounds of an event its data may still take part in.

The individual filter (docs/privacy.md, "Overlap and the individual filter") decides before each
of a run's spends who takes part: participant ``p`` does when, for every data record ``p``'s items
are charged to (ledger/overlap.py), the PLD composition of the record's rounds (those recorded
before the run started or resumed, and the run's own charged to it since) and one more round of
*this round's* event stays within the budget: ``allowance(records, event, 1, ...) == 1``. The
round's event is the one its eligible population gives (a smaller population, a costlier event),
so the decision never leaves a participant short of the round the ledger then checks. A
participant that does not take part is asked as before; the server discards its replies before
the sum, and the round is charged to the participants taking part.

**Why this is a valid guarantee, and which theorem.** Neighbouring datasets ``D``, ``D'`` differ by
one task ``x`` of ``p`` (its declared items unchanged: docs/privacy.md says what an item change
costs). Each decision reads a participant's own items, the ledger as the run found it, the
population of each round (availability) and the run's own earlier charges, which are the earlier
decisions: by induction every decision, ``p``'s included, is the same under both. So each round's
dominating pair is fixed before round 1 given the availability (the round's event where ``p``
takes part, the identity where it does not: nothing of ``p`` enters the sum). The composition
theorem for dominating pairs of adaptively composed mechanisms (Zhu, Dong and Wang 2022, "Optimal
accounting of differential privacy via characteristic function", Definition 7 and its composition
theorem: the PLD composition accounting/composition.py computes) then bounds ``x``'s loss by the
rounds ``p`` took part in. It holds for each fixed pair of datasets, so which rounds those are may
depend on the data (individual privacy accounting: Feldman and Zrnic 2021, "Individual privacy
accounting via a Rényi filter", whose individual loss is stated for a fixed pair of neighbouring
datasets), but never on the outputs: nothing here reads one, so no filter theorem is needed
(Rogers, Roth, Ullman and Vadhan 2016, "Privacy odometers and filters: pay-as-you-go
composition", separate exactly this case, parameters fixed up front, from filters). With the
earlier runs, ``x``'s loss is the composition of its records' earlier rounds and the rounds ``p``
took part in: within the budget by each decision. It errs high where the ledger does: the PLD is
discretised pessimistically, and a record is charged for every round ``p`` takes part in although
a task uses only some of its items.

Pure: the answer depends only on the arguments (the search defaults to
``calibration.affordable_rounds``, what ``BudgetLedger.rounds_affordable`` runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fedmeta.accounting.calibration import affordable_rounds
from fedmeta.accounting.checks import check_int
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
    """How many rounds of ``event``, at most ``rounds``, every one of ``records`` affords.

    ``records``: the earlier rounds of each data record the participant is charged to (none: a
    participant with no earlier spend); ``budget``: (epsilon, delta, unit) of the federation.
    ``search`` replaces ``affordable_rounds`` (a ledger passes its cached one; same answers).
    """
    check_int("rounds", rounds, minimum=0)
    epsilon_budget, delta, unit = budget

    def fresh(base: tuple[Any, ...], ev: AnyRound) -> int:
        return affordable_rounds(base, ev, epsilon_budget, delta, unit)

    find = search or fresh
    left = rounds
    for rounds_of_record in records or [()]:
        base, count = without(rounds_of_record, event)
        left = min(left, find(base, event) - count)
    return max(0, left)
