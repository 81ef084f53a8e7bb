"""What the ledger will say after the next spends: its exposures now, and where spends land.

``BudgetLedger.epsilon`` is the maximum, over the maximal participant groups (participants.py),
of the composition of each group's recorded rounds. That is a function of the groups' multisets
of rounds alone: :class:`Exposures` holds them, and :meth:`Exposures.epsilon` is that function,
computed with the same call the ledger makes (``composition.epsilon`` of each group's rounds at the
ledger's delta and unit, PLD), so for the same multisets it returns the same float, not an
approximation of it. The value is the ledger's pessimistic PLD bound: it errs high, never low
(composition.py).

A run charges its spends to one cohort, so the groups a spend reaches are known before it:
:class:`SpendProjection` is the exposures now plus which groups the next spends of one event
reach, and :meth:`SpendProjection.after` gives the exposures after ``k`` more such spends, if
nothing else is recorded meanwhile (another run on the same data, a new cohort). Whether that
held is never assumed: a caller reads the ledger's exposures after each spend and looks up
*their* epsilon; a projection is only a guess of which values to compute ahead.

Pure data: no connection, safe to hand to another thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import MutableMapping
from dataclasses import dataclass

from fedmeta.accounting.composition import epsilon
from fedmeta.accounting.ledger.participants import Multiset, multiset
from fedmeta.accounting.schemes import GaussianRound, Unit


def group_epsilon(rounds: Multiset, delta: float, unit: Unit) -> float:
    """Epsilon of one participant group's rounds: the call ``BudgetLedger`` makes (PLD)."""
    return epsilon(list(rounds), delta, unit, "pld")


#: One group's epsilon by (rounds, delta, unit).
GroupCache = MutableMapping[tuple[Multiset, float, Unit], float]


@dataclass(frozen=True)
class Exposures:
    """Each maximal participant group's rounds: what ``BudgetLedger.epsilon`` maximises over."""

    groups: tuple[Multiset, ...]
    delta: float
    unit: Unit

    def epsilon(self, cache: GroupCache | None = None) -> float:
        """Epsilon at ``delta`` for ``unit``: the maximum over the groups (0 for no rounds).

        ``cache`` keeps each group's value across calls (a group no spend reaches is computed once).
        """
        cache = {} if cache is None else cache
        keys = [(group, self.delta, self.unit) for group in self.groups]
        for key in keys:
            if key not in cache:
                cache[key] = group_epsilon(*key)
        return max((cache[key] for key in keys), default=0.0)


@dataclass(frozen=True)
class SpendProjection:
    """The exposures now, the event of the next spends, and which groups those spends reach."""

    now: Exposures
    event: GaussianRound
    charged: tuple[bool, ...]  # per group of ``now``: whether the next spends are charged to it

    def __post_init__(self) -> None:
        """Validate: one flag per group."""
        if len(self.charged) != len(self.now.groups):
            raise ValueError(
                f"charged must have one flag per group ({len(self.now.groups)}); "
                f"got {len(self.charged)}"
            )

    def after(self, spends: int) -> Exposures:
        """The exposures after ``spends`` more spends of ``event`` with nothing else recorded."""
        if isinstance(spends, bool) or not isinstance(spends, int) or spends < 0:
            raise ValueError(f"spends must be an integer >= 0; got {spends!r}")
        groups = tuple(
            multiset(Counter(dict(g)) + Counter({self.event: spends})) if charged else g
            for g, charged in zip(self.now.groups, self.charged, strict=True)
        )
        return Exposures(groups, self.now.delta, self.now.unit)
