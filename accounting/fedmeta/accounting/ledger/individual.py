"""The ledger's side of the individual filter: a run's own rounds, and each participant's allowance.

Nothing a private run releases may depend on which of its participants' items were recorded before
(issue 52, item 6; docs/privacy.md, "Overlap and the individual filter"). So what a run publishes is
read from *its own* spends alone (``run_rounds``, ``run_epsilon``, ``run_rounds_affordable``: what a
participant with no earlier spend has, a function of the configuration and the population of each
round), and who takes part in each round is decided from the ledger as the run found it and the
run's own spends (``affording``; allowance.py, where the theorem is cited). Who takes part is
operator-side: never released.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache
from typing import Any

from fedmeta.accounting.calibration import affordable_rounds
from fedmeta.accounting.composition import MAX_ROUNDS_LIMIT, Method, epsilon
from fedmeta.accounting.ledger.allowance import allowance
from fedmeta.accounting.ledger.appending import LedgerAppend
from fedmeta.accounting.ledger.cohorts import coarse_day, participant_key
from fedmeta.accounting.ledger.overlap import resolve_records
from fedmeta.accounting.ledger.participants import Multiset, Signature, multiset
from fedmeta.accounting.ledger.records import Participant
from fedmeta.accounting.levels import AnyRound, check_round
from fedmeta.accounting.schemes import Unit
from fedmeta.accounting.tuning_release import Recorded


def _expanded(
    participants: Sequence[Participant], resolved: Mapping[str, Sequence[str]]
) -> list[Participant]:
    """Plain participants: one with items becomes one per data record it is charged to."""
    out = []
    for p in participants:
        if p.items is None:
            out.append(p)
        else:
            out += [Participant(r, p.name, p.digest) for r in resolved[p.items.set_digest]]
    return out


@lru_cache(maxsize=256)
def _composed(rounds: Multiset, delta: float, unit: Unit, method: Method) -> float:
    """Epsilon of one multiset of rounds (pure; kept, since every report asks the run's again)."""
    return epsilon(list(rounds), delta, unit, method) if rounds else 0.0


class LedgerIndividual(LedgerAppend):
    """A ledger that answers for one run alone, and for each participant's allowance."""

    def _charged(self, participants: Sequence[Participant], *, write: bool) -> list[Participant]:
        """Who the spends are charged to: a participant with items, once per record it touches.

        Resolved once per item set and then remembered: every item of it is recorded by then,
        and later records only ever hold items no record held, so never one of these.
        """
        declared = {p.items.set_digest: p.items for p in participants if p.items is not None}
        todo = {name: items for name, items in declared.items() if name not in self._resolved}
        if todo:
            found = resolve_records(self._conn, self._salt, self.federation_id, todo,
                                    write=write, day=coarse_day())  # fmt: skip
            if not write:
                return _expanded(participants, {**self._resolved, **found})
            self._resolved.update(found)
        return _expanded(participants, self._resolved)

    def _max_total(self, base: tuple[Any, ...], event: AnyRound) -> int:
        """Largest total count of ``event`` affordable beside ``base`` (cached; a PLD search)."""
        key = (base, event)
        if key not in self._totals:
            self._totals[key] = affordable_rounds(
                base, event, self.epsilon_budget, self.delta, self.unit
            )
        return self._totals[key]

    # ---------------------------------------------------------------------------- one run

    def run_rounds(self, run_id: str) -> list[tuple[Recorded, int]]:
        """The rounds ``run_id`` recorded, ``[(event, count)]``, whoever they were charged to."""
        self._catch_up()
        return list(multiset(Counter(r.event for r in self._records if r.run_id == run_id)))

    def run_epsilon(self, run_id: str, unit: Unit | None = None, method: Method = "pld") -> float:
        """Epsilon of ``run_id``'s own rounds: what a participant with no earlier spend has."""
        return _composed(tuple(self.run_rounds(run_id)), self.delta, unit or self.unit, method)

    def run_rounds_affordable(self, run_id: str, event: AnyRound) -> int:
        """How many more rounds like ``event`` the budget allows ``run_id``'s own rounds.

        The run's public stop: a function of its events alone, never of its participants' data.
        """
        check_round(event)
        budget = (self.epsilon_budget, self.delta, self.unit)
        own = tuple(self.run_rounds(run_id))
        return allowance([own], event, MAX_ROUNDS_LIMIT, budget, self._max_total)

    # ---------------------------------------------------------------------------- who takes part

    def affording(
        self, participants: Sequence[Participant], event: AnyRound, *, run_id: str, since: int
    ) -> frozenset[str]:
        """Who of ``participants`` (by name) takes part in ``run_id``'s next spend of ``event``.

        Those whose every data record affords one more round of *this* ``event`` (the round's
        own: its eligible population may be smaller than the plan's, a costlier event) beside
        the rounds charged to the record by the ledger's first ``since`` records (the ledger as
        the run found it at its start or resume) and by ``run_id``'s own records since. Another
        run's later spends are not read: what decides who takes part is fixed by the data and
        the population of each round, never by what arrives during the run (allowance.py's
        theorem; docs/privacy.md, "Overlap and the individual filter"). Operator-only.
        """
        check_round(event)
        self._catch_up()
        self._check_level(event)
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise ValueError(f"since must be an integer >= 0; got {since!r}")
        later = [r for r in self._records[since:] if r.run_id != run_id]
        keys: dict[str, set[str]] = {}
        for p in self._charged(participants, write=False):
            keys.setdefault(p.name, set()).add(participant_key(self._salt, p.identity))
        budget = (self.epsilon_budget, self.delta, self.unit)
        return frozenset(
            name for name, among in keys.items()
            if allowance([self._less(s, later) for s in self._exposure.signatures(among)],
                         event, 1, budget, self._max_total) == 1  # fmt: skip
        )

    def _runs_charged(self, signature: Signature) -> tuple[tuple[str, int, int], ...]:
        """Per run that charged a participant of ``signature``: (run, charged, the run's spends)."""
        spends = Counter(r.run_id for r in self._records)
        charged = Counter(r.run_id for r in self._records
                          if r.cohort is None or r.cohort in signature)  # fmt: skip
        return tuple((run, n, spends[run]) for run, n in charged.items())

    def _less(self, signature: Signature, records: Collection[Any]) -> Multiset:
        """The rounds charged to a participant of ``signature``, less those of ``records``."""
        counts = self._exposure.counts(signature)
        counts.subtract(r.event for r in records if r.cohort is None or r.cohort in signature)
        return multiset(counts)

