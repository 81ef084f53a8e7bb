"""Appending to a federation's chain, and the tuning release: a spend of its own kind.

``LedgerAppend`` writes one record at the end of the hash chain (the spends table, the head, the
anchors) for every kind of spend: a Gaussian round (``BudgetLedger.spend``, budget.py) and a tuning
release (``spend_release`` here; accounting/tuning_release.py). A tuning release is one record in
the same table and chain as the rounds, charged to the same cohort, so every epsilon the ledger
computes afterwards (``epsilon``, ``exposures``, ``rounds_affordable``, ``would_exceed``, the
refusals) composes it with the rounds before and after it: by RDP wherever a group's records hold
a release (composition.py dispatches), by PLD elsewhere, as before. A ledger written before
releases existed needs no migration (no table or column is added); code that predates releases
refuses a ledger holding one (``unreadable event``) rather than composing without it.

A sample-level round (accounting/sample_level.py) is recorded by ``BudgetLedger.spend`` like a
task-level round, with its own ``kind``. ``_check_level`` keeps one privacy level per budget
(accounting/levels.py says why levels never compose; docs/ledger.md, "Sample-level rounds").
"""

from __future__ import annotations

import sqlite3
from collections import Counter

from fedmeta.accounting.composition import epsilon
from fedmeta.accounting.ledger.anchor import Anchor, write_anchor, write_anchor_at
from fedmeta.accounting.ledger.chain import canonical_json, record_hash
from fedmeta.accounting.ledger.cohorts import coarse_day
from fedmeta.accounting.ledger.history import LedgerHistory
from fedmeta.accounting.ledger.participants import multiset
from fedmeta.accounting.ledger.records import (
    BudgetExhausted,
    LedgerError,
    LedgerReadOnly,
    LevelMismatch,
    SpendRecord,
)
from fedmeta.accounting.ledger.storage import classify_error, immediate_transaction
from fedmeta.accounting.levels import Level, level_of
from fedmeta.accounting.schemes import Unit
from fedmeta.accounting.tuning_release import Recorded, TuningRelease

#: The round index a tuning release is recorded under (one record per tuning run).
RELEASE_INDEX = 0


class LedgerAppend(LedgerHistory):
    """A verified history that records spends at the end of its chain."""

    def _refuse_readonly(self, doing: str) -> None:
        if self.readonly:
            raise LedgerReadOnly(
                f"ledger {self.path} was opened read-only (open_readonly); {doing} needs "
                "BudgetLedger.open"
            )

    def _insert(self, event: Recorded, event_json: str, run_id: str, round_index: int
                ) -> tuple[SpendRecord, int | None, int]:  # fmt: skip
        """Inside the caller's write transaction: append one record and move the head."""
        cohort = None if self._cohort is None else self._cohort[0]
        position = len(self._records)
        prev = self._records[-1].hash if self._records else self._genesis
        # The day only: a finer time would let the gap between spends follow a round's realised
        # work (issue 18, item 2); the hash chain, not the time, orders records.
        created = coarse_day()
        digest = record_hash(
            self.federation_id, position, run_id, round_index, event_json, created, prev, cohort
        )
        seq = self._conn.execute(
            "INSERT INTO spends (federation_id, position, run_id, round_index, event, "
            "created_at, prev_hash, hash, cohort) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (self.federation_id, position, run_id, round_index, event_json, created, prev,
             digest, cohort),
        ).lastrowid  # fmt: skip
        count = int(self._conn.execute("SELECT COUNT(*) FROM spends").fetchone()[0])
        self._conn.execute(
            "INSERT INTO heads (federation_id, position, hash) VALUES (?, ?, ?) "
            "ON CONFLICT(federation_id) DO UPDATE SET position = excluded.position, "
            "hash = excluded.hash",
            (self.federation_id, position, digest),
        )
        record = SpendRecord(
            self.federation_id, position, run_id, round_index, event, created, digest, cohort
        )
        return record, seq, count

    def _committed(self, record: SpendRecord, seq: int | None, count: int) -> SpendRecord:
        """After the commit (fsynced): the anchors follow, then the in-memory state moves."""
        if self.ledger_id is not None and seq is not None:
            write_anchor(self.path, Anchor(self.ledger_id, count, seq, record.hash))
            if self._witness is not None:
                write_anchor_at(self._witness, Anchor(self.ledger_id, count, seq, record.hash))
        self._records.append(record)
        self._exposure.add(record.event, record.cohort)
        return record

    # ---------------------------------------------------------------------------------- levels

    def recorded_level(self) -> Level | None:
        """The privacy level of the data's spends (this budget's and carried), None before any.

        Each record's event says its level (a sample-level round carries its ``kind``) and the
        hash chain covers it, so the level is recorded with the budget and read back, never
        stored apart from the records it describes. ``_check_level`` keeps it to one.
        """
        events = [r.event for r in self._records] + list(self._carried)
        levels = sorted({level_of(e) for e in events})
        if len(levels) > 1:  # only a ledger written by hand; composition would refuse it too
            raise LedgerError(f"federation {self.federation_id!r} records spends of both levels")
        return levels[0] if levels else None

    def _check_level(self, event: Recorded) -> None:
        """Refuse ``event`` if its level differs from the data's (levels.py says why).

        Called before the write lock and again under it after the catch-up (another process may
        have recorded the first spend of the other level meanwhile): nothing is written.
        """
        recorded, requested = self.recorded_level(), level_of(event)
        if requested == "sample" and self.unit != "task":
            raise LedgerError(
                f"unit must be 'task' for sample-level rounds (their bound is per example, read at "
                f"the accountant's per-record unit); federation {self.federation_id!r} is "
                f"{self.unit!r}; nothing was recorded"
            )
        if recorded is None or recorded == requested:
            return
        raise LevelMismatch(
            f"ledger {self.path}: federation {self.federation_id!r} records {recorded}-level "
            f"spends and this is a {requested}-level spend; the two guarantees protect different "
            "neighbours (one task, one example) and never compose, so spend at "
            f"{recorded} level or start a separate budget with `fedmeta ledger new-budget --db "
            f"{self.path} --federation {self.federation_id} --reason TEXT`; nothing was recorded",
            recorded=recorded,
            requested=requested,
        )

    # ------------------------------------------------------------------------- tuning releases

    def epsilon_after_release(self, release: TuningRelease, unit: Unit | None = None) -> float:
        """Epsilon the data would reach with ``release`` recorded now.

        The maximum over the groups the current cohort reaches (every group without one), each
        composed by RDP with its rounds and releases (tuning_release.py).
        """
        self._catch_up()
        among = None if self._cohort is None else self._cohort[1]
        worst = 0.0
        for sig in self._exposure.signatures(among):
            counts: Counter[Recorded] = self._exposure.counts(sig)
            counts[release] += 1
            worst = max(worst, epsilon(list(multiset(counts)), self.delta, unit or self.unit))
        return worst

    def spend_release(self, release: TuningRelease, run_id: str) -> SpendRecord:
        """Record a tuning release, or raise ``BudgetExhausted`` having recorded nothing.

        Call before the tuning's first trial, so that nothing of it (its best model above all)
        is released unpaid; when this returns the record is durable. Checked under the write
        lock against the current cohort's groups (``epsilon_after_release``).
        """
        self._refuse_readonly("spending")
        if not isinstance(release, TuningRelease):
            raise ValueError(f"release must be a TuningRelease; got {release!r}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string; got {run_id!r}")
        if release.neighbouring != self.neighbouring:
            raise LedgerError(
                f"neighbouring must match the federation's: {self.federation_id!r} composes "
                f"{self.neighbouring!r} spends, this release is {release.neighbouring!r}"
            )
        self._check_level(release)
        event_json = canonical_json(release.to_dict())
        try:
            with immediate_transaction(self._conn):
                self._catch_up()
                self._check_level(release)  # rolled back: nothing written
                after = self.epsilon_after_release(release)
                if after > self.epsilon_budget:
                    raise self._release_exhausted(after)  # rolled back: nothing written
                done = self._insert(release, event_json, run_id, RELEASE_INDEX)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error
        return self._committed(*done)

    def _release_exhausted(self, after: float) -> BudgetExhausted:
        return BudgetExhausted(
            f"budget exhausted for federation {self.federation_id!r}: this tuning release would "
            f"take the epsilon of a participant it may sample to {after:.4g} > budget "
            f"{self.epsilon_budget:g} (delta {self.delta:g}, {self.unit} level, RDP); nothing "
            "was recorded",
            epsilon_after=after,
            epsilon_budget=self.epsilon_budget,
        )
