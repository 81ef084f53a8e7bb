"""``LinearLedger``: an in-memory ``accounting.Ledger`` with a linear epsilon, for tests.

epsilon = ``eps_per_round`` x spends at task level, twice that at participant level: no PLD, so
tests of code that *uses* a ledger (the server's round loop) run in milliseconds. It passes the
same contract suite as ``BudgetLedger`` (tests/accounting/test_accounting_ledger_contract.py), so
what a test learns from it holds for the real ledger. Import it as
``from tests.accounting.fakes import LinearLedger``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedmeta.accounting import (
    BudgetExhausted,
    GaussianRound,
    Hold,
    LedgerCheckpoint,
    LedgerError,
    Participant,
    PublicDataUse,
    Reservation,
    SpendRecord,
)
from fedmeta.accounting.levels import AnyRound, check_round
from fedmeta.accounting.tuning_release import Recorded


@dataclass
class LinearLedger:
    """A federation's budget where every round costs ``eps_per_round`` (participant level: 2x)."""

    epsilon_budget: float = 1.0
    delta: float = 1e-6
    eps_per_round: float = 0.25
    federation_id: str = "fake-federation"
    unit: str = "task"
    neighbouring: str = "add_remove"
    path: Path = Path("/nonexistent/fake-ledger.sqlite")
    ledger_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    spend_calls: int = 0
    _records: list[SpendRecord] = field(default_factory=list)
    _closed: bool = False
    _uncharged: set[int] = field(default_factory=set)  # positions charged to nobody
    _nobody: bool = False  # the last ``use_cohort`` named nobody
    _reservations: dict[str, Reservation] = field(default_factory=dict)  # runs in progress

    def __post_init__(self) -> None:
        if not (math.isfinite(self.eps_per_round) and self.eps_per_round > 0):
            raise ValueError(f"eps_per_round must be a finite number > 0; got {self.eps_per_round}")

    def _rounds_in_budget(self) -> int:
        # A tolerance, so 4 x 0.25 fits a budget of 1.0 despite rounding.
        return int(math.floor(self.epsilon_budget / self.eps_per_round + 1e-9))

    def position(self) -> int:
        """Number of records."""
        return len(self._records)

    def records(self) -> list[SpendRecord]:
        """All records, oldest first."""
        return list(self._records)

    def rounds(self) -> list[tuple[Recorded, int]]:
        """Records grouped by identical event, first seen first."""
        groups: dict[Recorded, int] = {}
        for record in self._records:
            groups[record.event] = groups.get(record.event, 0) + 1
        return list(groups.items())

    def epsilon(self, unit: str | None = None, method: str = "pld") -> float:
        """``eps_per_round`` x spends; twice that at participant level. ``method`` is ignored."""
        factor = 2.0 if (unit or self.unit) == "participant" else 1.0
        return factor * self.eps_per_round * self._charged()

    def _charged(self, run_id: str | None = None) -> int:
        """Records charged to the participants (every one here), less ``run_id``'s."""
        return sum(1 for r in self._records
                   if r.position not in self._uncharged and r.run_id != run_id)  # fmt: skip

    def rounds_affordable(self, event: AnyRound) -> int:
        """Rounds left in the budget (every kind of round costs the same)."""
        check_round(event)  # either level, as the real ledger (no level check: one run a fake)
        if self._nobody:
            return 10**9  # charged to nobody: the real ledger's MAX_ROUNDS_LIMIT
        return max(0, self._rounds_in_budget() - self._charged())

    def would_exceed(self, event: AnyRound) -> bool:
        """Dry run of ``spend``."""
        return self.rounds_affordable(event) < 1

    def spend(self, event: AnyRound, run_id: str, round_index: int) -> SpendRecord:
        """Record one round, or raise having recorded nothing (the real ledger's checks)."""
        self.spend_calls += 1
        check_round(event)  # either level, as the real ledger (no level check: one run a fake)
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string; got {run_id!r}")
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise ValueError(f"round_index must be an integer >= 0; got {round_index!r}")
        if event.neighbouring != self.neighbouring:
            raise LedgerError(
                f"neighbouring must match the federation's: {self.neighbouring!r}, this round is "
                f"{event.neighbouring!r}"
            )
        if self.would_exceed(event):
            after = self.eps_per_round * (len(self._records) + 1)
            raise BudgetExhausted(
                f"budget exhausted: epsilon would be {after:g} > {self.epsilon_budget:g}",
                epsilon_after=after,
                epsilon_budget=self.epsilon_budget,
            )
        position = len(self._records)
        record = SpendRecord(
            self.federation_id,
            position,
            run_id,
            round_index,
            event,
            datetime.now(UTC).isoformat(),
            f"fake-hash-{position}",
        )
        if self._nobody:
            self._uncharged.add(position)
        self._records.append(record)
        return record

    def run_rounds(self, run_id: str) -> list[tuple[Recorded, int]]:
        """``run_id``'s records grouped by identical event."""
        groups: dict[Recorded, int] = {}
        for record in self._records:
            if record.run_id == run_id:
                groups[record.event] = groups.get(record.event, 0) + 1
        return list(groups.items())

    def run_epsilon(self, run_id: str, unit: str | None = None, method: str = "pld") -> float:
        """``eps_per_round`` x the run's own spends (participant level: 2x)."""
        factor = 2.0 if (unit or self.unit) == "participant" else 1.0
        return factor * self.eps_per_round * sum(c for _, c in self.run_rounds(run_id))

    def run_rounds_affordable(self, run_id: str, event: AnyRound) -> int:
        """Rounds left in the budget for the run's own spends alone."""
        return max(0, self._rounds_in_budget() - sum(c for _, c in self.run_rounds(run_id)))

    def reserve(
        self, participants: Sequence[Participant], event: AnyRound, rounds: int, *, run_id: str
    ) -> Hold:
        """Reserve ``rounds`` (every round costs the same here); the others' as they stand."""
        others = tuple(r for r in self._reservations.values() if r.run_id != run_id)
        made = Reservation(run_id, "everyone", event, rounds, len(self._records))
        self._reservations[run_id] = made
        return Hold(len(self._records), others)

    def end_reservation(self, run_id: str) -> None:
        """The run will not spend again."""
        self._reservations.pop(run_id, None)

    def affording(
        self, participants: Sequence[Participant], event: AnyRound, *, run_id: str, hold: Hold
    ) -> frozenset[str]:
        """Every participant is charged every charged round here: all afford it, or none.

        The rounds counted: the first ``hold.since`` records, ``run_id``'s own, and the other
        runs' reserved rounds not spent by then, as the real ledger.
        """
        counted = sum(1 for r in self._records
                      if r.position not in self._uncharged
                      and (r.position < hold.since or r.run_id == run_id))  # fmt: skip
        for held in hold.others:
            spent = sum(1 for r in self._records[held.position:hold.since]
                        if r.run_id == held.run_id)  # fmt: skip
            counted += max(0, held.rounds - spent)
        if counted + 1 > self._rounds_in_budget():
            return frozenset()
        return frozenset(p.name for p in participants)

    def checkpoint(self) -> LedgerCheckpoint:
        """Where the fake stands (same fields as the real ledger's)."""
        head = self._records[-1].hash if self._records else None
        return LedgerCheckpoint(self.ledger_id, str(self.path), self.federation_id,
                                len(self._records), head)  # fmt: skip

    def check_resume(self, saved: LedgerCheckpoint) -> None:
        """The real ledger's refusals: another ledger, a ledger behind, a diverged history."""
        if saved.ledger_id is not None and saved.ledger_id != self.ledger_id:
            raise LedgerError(f"a different ledger ({saved.ledger_id}, this is {self.ledger_id})")
        if len(self._records) < saved.position:
            raise LedgerError(f"the ledger is behind: {len(self._records)} < {saved.position}")
        if saved.head is not None and self._records[saved.position - 1].hash != saved.head:
            raise LedgerError("the ledger's history diverged")

    def exposures(self, unit: str | None = None) -> None:
        """None: a linear epsilon is no composition of exposures (asked of ``epsilon`` instead)."""
        return None

    def projection(self, event: GaussianRound) -> None:
        """None, as ``exposures``: nothing to compute ahead."""
        return None

    def anchor(self) -> dict[str, Any] | None:
        """None: the fake keeps no witness of a whole ledger."""
        return None

    def use_cohort(self, participants: Sequence[Participant]) -> None:
        """Every spend is charged to the whole federation here, or to nobody (none named)."""
        self._nobody = not participants

    def record_public_use(self, use: PublicDataUse, run_id: str) -> None:
        """Public data spends nothing, and this fake keeps no declarations."""

    def keep_figures(self) -> None:
        """A linear epsilon is not composed: nothing to keep."""

    def close(self) -> None:
        """Nothing to release."""
        self._closed = True
