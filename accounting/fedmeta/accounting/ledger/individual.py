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

import sqlite3
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache
from typing import Any

from fedmeta.accounting.calibration import affordable_rounds
from fedmeta.accounting.composition import MAX_ROUNDS_LIMIT, Method, epsilon
from fedmeta.accounting.ledger.allowance import allowance
from fedmeta.accounting.ledger.appending import LedgerAppend
from fedmeta.accounting.ledger.cohorts import coarse_day, participant_key, record_cohort
from fedmeta.accounting.ledger.overlap import resolve_records
from fedmeta.accounting.ledger.participants import Multiset, Signature, multiset
from fedmeta.accounting.ledger.records import Participant
from fedmeta.accounting.ledger.reservations import (
    Hold,
    Reservation,
    active_reservations,
    end_if_held,
    recorded_count,
    write_reservation,
)
from fedmeta.accounting.ledger.storage import (
    classify_error,
    immediate_transaction,
    read_transaction,
)
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

    def reserve(
        self, participants: Sequence[Participant], event: AnyRound, rounds: int, *, run_id: str
    ) -> Hold:
        """Reserve ``rounds`` of ``event`` for ``run_id`` on its participants' data (reservations).

        ``event``: the costliest a round of the run can have. Returns what the run's decisions
        read (``affording``): where the ledger stands and the other runs' reservations, both read
        in the transaction that writes this one. A read-only ledger (a dry run) reserves nothing.
        """
        check_round(event)
        self._catch_up()
        if self.readonly:
            position, others = len(self._records), self.reservations()
        else:
            try:
                with immediate_transaction(self._conn):
                    charged = self._charged(participants, write=True)
                    cid, _ = record_cohort(self._conn, self.federation_id, self._salt, charged)
                    others = active_reservations(self._conn, self.path, self.federation_id)
                    position = recorded_count(self._conn, self.federation_id)
                    made = Reservation(run_id, cid, event, rounds, position)
                    write_reservation(self._conn, self.federation_id, made)
            except sqlite3.Error as error:
                raise classify_error(self.path, error) from error
            self._catch_up()  # the cohort, and any spend recorded before the transaction
        return Hold(position, tuple(r for r in others if r.run_id != run_id))

    def end_reservation(self, run_id: str) -> None:
        """End ``run_id``'s reservation: the run will not spend again (a no-op if it made none)."""
        if self.readonly:
            return
        try:
            with immediate_transaction(self._conn):
                end_if_held(self._conn, self.path, self.federation_id, run_id)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error

    def reservations(self) -> list[Reservation]:
        """The runs in progress and their reserved rounds (the operator's: ``ledger show``)."""
        try:
            with read_transaction(self._conn):
                return active_reservations(self._conn, self.path, self.federation_id)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error

    def affording(
        self, participants: Sequence[Participant], event: AnyRound, *, run_id: str, hold: Hold
    ) -> frozenset[str]:
        """Who of ``participants`` (by name) takes part in ``run_id``'s next spend of ``event``.

        Those whose every data record affords one more round of *this* ``event`` (the round's
        own: its eligible population may be smaller than the plan's, a costlier event) beside
        the rounds charged to the record by the ledger's first ``hold.since`` records (the ledger
        as the run found it at its start or resume), by ``run_id``'s own records since, and the
        rounds the runs in progress then reserved and had not yet spent (reservations.py).
        Another run's later spends are not read: what decides who takes part is fixed by the data
        and the population of each round, never by what arrives during the run (allowance.py's
        theorem; docs/privacy.md, "Overlap and the individual filter"). Operator-only.
        """
        check_round(event)
        self._catch_up()
        self._check_level(event)
        later = [r for r in self._records[hold.since:] if r.run_id != run_id]
        reserved = self._reserved(hold)
        keys: dict[str, set[str]] = {}
        for p in self._charged(participants, write=False):
            keys.setdefault(p.name, set()).add(participant_key(self._salt, p.identity))
        budget = (self.epsilon_budget, self.delta, self.unit)
        return frozenset(
            name for name, among in keys.items()
            if allowance([self._history(s, later, reserved)
                          for s in self._exposure.signatures(among)],
                         event, 1, budget, self._max_total) == 1  # fmt: skip
        )

    def _reserved(self, hold: Hold) -> list[tuple[str, Recorded, int]]:
        """(cohort, event, rounds reserved and not spent by ``hold.since``) per run in progress."""
        out = []
        for r in hold.others:
            spent = sum(1 for rec in self._records[r.position:hold.since] if rec.run_id == r.run_id)
            if r.rounds > spent:
                out.append((r.cohort_id, r.event, r.rounds - spent))
        return out

    def _history(
        self, signature: Signature, later: Collection[Any],
        reserved: Sequence[tuple[str, Recorded, int]],
    ) -> Multiset:  # fmt: skip
        """A record's rounds as a run's decision reads them: less ``later``, plus ``reserved``."""
        counts = self._exposure.counts(signature)
        counts.subtract(r.event for r in later if r.cohort is None or r.cohort in signature)
        for cohort, event, rounds in reserved:
            if cohort in signature:
                counts[event] += rounds
        return multiset(counts)

    def _runs_charged(self, signature: Signature) -> tuple[tuple[str, int, int], ...]:
        """Per run that charged a participant of ``signature``: (run, charged, the run's spends)."""
        spends = Counter(r.run_id for r in self._records)
        charged = Counter(r.run_id for r in self._records
                          if r.cohort is None or r.cohort in signature)  # fmt: skip
        return tuple((run, n, spends[run]) for run, n in charged.items())

