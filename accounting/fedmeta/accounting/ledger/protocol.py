"""The ``Ledger`` protocol: what the server needs from a budget ledger."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fedmeta.accounting.composition import Method
from fedmeta.accounting.ledger.projection import Exposures, SpendProjection
from fedmeta.accounting.ledger.public import PublicDataUse
from fedmeta.accounting.ledger.records import (
    LedgerCheckpoint,
    Participant,
    SpendRecord,
)
from fedmeta.accounting.ledger.reservations import Hold
from fedmeta.accounting.levels import AnyRound
from fedmeta.accounting.schemes import (
    GaussianRound,
    Neighbouring,
    Unit,
)
from fedmeta.accounting.tuning_release import Recorded

# ----------------------------------------------------------------------------- the protocol


@runtime_checkable
class Ledger(Protocol):
    """What the server needs from a budget ledger; ``BudgetLedger`` and test fakes implement it.

    One contract suite (tests/accounting/test_accounting_ledger_contract.py) runs against every
    implementation: no records gives epsilon 0; a failed spend leaves state unchanged;
    ``would_exceed`` agrees with ``spend``; ``position`` counts records; records keep their order
    and run ids; ``rounds`` groups identical events.
    """

    @property
    def federation_id(self) -> str:
        """The federation (budget) this object spends from."""
        ...

    @property
    def ledger_id(self) -> str | None:
        """The ledger file's random id (``None``: a legacy ledger opened read-only)."""
        ...

    @property
    def path(self) -> Path:
        """The ledger file's absolute, resolved path."""
        ...

    @property
    def epsilon_budget(self) -> float:
        """The enforced budget (epsilon at ``delta``, at ``unit`` level)."""
        ...

    @property
    def delta(self) -> float:
        """Delta of the guarantee."""
        ...

    @property
    def unit(self) -> Unit:
        """The enforced privacy unit, ``task`` or ``participant``."""
        ...

    @property
    def neighbouring(self) -> Neighbouring:
        """The neighbouring relation every recorded round is stated for."""
        ...

    def position(self) -> int:
        """Number of records."""
        ...

    def records(self) -> list[SpendRecord]:
        """All records, oldest first."""
        ...

    def rounds(self) -> list[tuple[Recorded, int]]:
        """Records grouped by identical event, ``[(event, count)]``."""
        ...

    def epsilon(self, unit: Unit | None = None, method: Method = "pld") -> float:
        """Epsilon spent so far at ``delta``."""
        ...

    def rounds_affordable(self, event: AnyRound) -> int:
        """How many more rounds like ``event`` the budget allows."""
        ...

    def would_exceed(self, event: AnyRound) -> bool:
        """Dry run: whether spending ``event`` now would exceed the budget."""
        ...

    def spend(self, event: AnyRound, run_id: str, round_index: int) -> SpendRecord:
        """Record one round durably, or raise having recorded nothing."""
        ...

    def run_rounds(self, run_id: str) -> list[tuple[Recorded, int]]:
        """The rounds ``run_id`` recorded, ``[(event, count)]``, whoever they were charged to."""
        ...

    def run_epsilon(self, run_id: str, unit: Unit | None = None, method: Method = "pld") -> float:
        """Epsilon of ``run_id``'s own rounds: what a participant with no earlier spend has."""
        ...

    def run_rounds_affordable(self, run_id: str, event: AnyRound) -> int:
        """How many more rounds like ``event`` the budget allows ``run_id``'s own rounds."""
        ...

    def reserve(
        self, participants: Sequence[Participant], event: AnyRound, rounds: int, *, run_id: str
    ) -> Hold:
        """Reserve the rounds a starting run may still charge, ``event`` at most each.

        Before its first spend, on its participants' data (ledger/reservations.py); returns what
        its decisions read.
        """
        ...

    def end_reservation(self, run_id: str) -> None:
        """End ``run_id``'s reservation: the run will not spend again."""
        ...

    def affording(
        self, participants: Sequence[Participant], event: AnyRound, *, run_id: str, hold: Hold
    ) -> frozenset[str]:
        """Who of ``participants`` (by name) takes part in ``run_id``'s next spend of ``event``.

        From what ``hold`` fixed and ``run_id``'s own spends (ledger/individual.py).
        Operator-only, never released.
        """
        ...

    def exposures(self, unit: Unit | None = None) -> Exposures | None:
        """What ``epsilon(unit)`` maximises over now, as data, or None (a fake's linear epsilon).

        ``exposures().epsilon()`` equals ``epsilon(unit)``; where epsilon is not a composition of
        exposures the server asks ``epsilon`` itself instead of computing it ahead.
        """
        ...

    def projection(self, event: GaussianRound) -> SpendProjection | None:
        """The exposures now and the groups the next spends of ``event`` reach, or None.

        A guess of the exposures to come, to compute their epsilon ahead; None where ``exposures``
        is None.
        """
        ...

    def checkpoint(self) -> LedgerCheckpoint:
        """Where this budget stands: what a run records to refuse a wrong ledger on resume."""
        ...

    def check_resume(self, saved: LedgerCheckpoint) -> None:
        """Refuse (``LedgerError``) another ledger, one behind ``saved``, or a diverged history."""
        ...

    def anchor(self) -> dict[str, Any] | None:
        """Where the whole ledger stands (its witness in every output), or None without one."""
        ...

    def use_cohort(self, participants: Sequence[Participant]) -> None:
        """Charge the following spends to ``participants`` (those taking part); empty: nobody."""
        ...

    def record_public_use(self, use: PublicDataUse, run_id: str) -> None:
        """Declare, before the run's first spend, the public data it used (spends nothing)."""
        ...

    def keep_figures(self) -> None:
        """Compose, at a run's end, what ``fedmeta ledger show`` prints, to keep it (or nothing)."""
        ...

    def close(self) -> None:
        """Release the ledger."""
        ...
