"""The ledger's side of the individual filter: a run's own rounds, and each participant's allowance.

Nothing a private run releases may depend on which of its participants' items were recorded before
(issue 52, item 6; docs/privacy.md, "Overlap and the individual filter"). So what a run publishes is
read from *its own* spends alone (``run_rounds``, ``run_epsilon``, ``run_rounds_affordable``: what a
participant with no earlier spend has, a function of the configuration and the population of each
round), and who takes part in which round follows each participant's allowance (``allowances``,
allowance.py, where the theorem is cited), computed once from the ledger without the run's own
spends. Both are operator-side: the allowances themselves are never released.
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

    # ---------------------------------------------------------------------------- allowances

    def allowances(
        self, participants: Sequence[Participant], event: AnyRound, rounds: int, *, run_id: str
    ) -> dict[str, int]:
        """Each participant's allowance ``k_p`` (by name): rounds of ``event`` it may take part in.

        From the ledger without ``run_id``'s own spends, i.e. as it stood before the run's first
        spend as far as this run is concerned (a resumed run gets its start's answer, so long as
        no other run spent on the same data meanwhile). Operator-only, like the ledger itself.
        """
        check_round(event)
        self._catch_up()
        self._check_level(event)  # LevelMismatch: a round of another level than the data's
        own = [r for r in self._records if r.run_id == run_id]
        keys: dict[str, set[str]] = {}
        for p in self._charged(participants, write=False):
            keys.setdefault(p.name, set()).add(participant_key(self._salt, p.identity))
        budget = (self.epsilon_budget, self.delta, self.unit)
        return {
            name: allowance([self._earlier(s, own) for s in self._exposure.signatures(among)],
                            event, rounds, budget, self._max_total)  # fmt: skip
            for name, among in sorted(keys.items())
        }

    def _runs_charged(self, signature: Signature) -> tuple[tuple[str, int, int], ...]:
        """Per run that charged a participant of ``signature``: (run, charged, the run's spends)."""
        spends = Counter(r.run_id for r in self._records)
        charged = Counter(r.run_id for r in self._records
                          if r.cohort is None or r.cohort in signature)  # fmt: skip
        return tuple((run, n, spends[run]) for run, n in charged.items())

    def _earlier(self, signature: Signature, own: Collection[Any]) -> Multiset:
        """The rounds charged to a participant of ``signature``, less ``own`` records of them."""
        counts = self._exposure.counts(signature)
        counts.subtract(r.event for r in own if r.cohort is None or r.cohort in signature)
        return multiset(counts)

