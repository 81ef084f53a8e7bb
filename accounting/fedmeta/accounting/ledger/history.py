"""The verified history of one federation: opening read-only, the chain catch-up, positions.

``LedgerHistory`` reads and verifies; ``BudgetLedger`` (budget.py) adds the budget rules and
spending. Split so that each file stays one subject (issue 20).
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from fedmeta.accounting.composition import Method
from fedmeta.accounting.ledger.anchor import LedgerRolledBack, accept_command, accepted
from fedmeta.accounting.ledger.chain import (
    genesis_hash,
    verify_chain,
    verify_head,
)
from fedmeta.accounting.ledger.cohorts import (
    carried_federations,
    check_carried_relation,
    load_cohorts,
)
from fedmeta.accounting.ledger.inherit import inherited_sources
from fedmeta.accounting.ledger.participants import Exposure, Multiset
from fedmeta.accounting.ledger.public import PublicDataRecord, public_uses
from fedmeta.accounting.ledger.records import (
    LedgerCheckpoint,
    LedgerCorrupted,
    LedgerError,
    LedgerInfo,
    LedgerMode,
    LedgerReplaced,
    Participant,
    SpendRecord,
)
from fedmeta.accounting.ledger.registration import Registration, find_registration
from fedmeta.accounting.ledger.storage import (
    PER_PARTICIPANT,
    absolute_path,
    check_federation_id,
    classify_error,
    closed_on_error,
    column_or_null,
    connect_readonly,
    file_identity,
    read_meta,
    read_transaction,
    stored_mode,
)
from fedmeta.accounting.levels import AnyRound
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    Neighbouring,
    Unit,
)
from fedmeta.accounting.tuning_release import Recorded


class LedgerHistory:
    """One federation's records, verified as they arrive, and where a run stands in them."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        meta: Mapping[str, str],
        federation_id: str,
        registration: Registration,
        *,
        readonly: bool,
        identity: tuple[int, int] | None,
    ) -> None:
        """Use ``BudgetLedger.open`` or ``BudgetLedger.open_readonly``."""
        self._conn = conn
        self.path = path
        self.ledger_id: str | None = meta.get("ledger_id")
        self.mode: LedgerMode | None = stored_mode(path, meta)
        self.federation_id = federation_id
        self.epsilon_budget = registration.epsilon_budget
        self.delta = registration.delta
        self.unit = registration.unit
        self.neighbouring: Neighbouring = registration.neighbouring or ADD_REMOVE
        self.readonly = readonly
        self._identity = identity
        self._genesis = genesis_hash(
            federation_id,
            registration.epsilon_budget,
            registration.delta,
            registration.unit,
            registration.created_at,
            registration.neighbouring,
        )
        self._records: list[SpendRecord] = []
        self._salt = meta.get("salt", "")
        self._meta = dict(meta)
        # Per-participant composition (participants.py): rounds by cohort, and the cohort the
        # next spend is charged to (None: every participant, as before per-participant budgets).
        self._exposure = Exposure()
        self._cohort: tuple[str, frozenset[str]] | None = None
        self._pending: Sequence[Participant] | None = None
        self._resolved: dict[str, list[str]] = {}  # item set -> its data records (overlap.py)
        self._carried: Counter[Recorded] = Counter()  # rounds charged to every participant
        self._witness: Path | None = None  # an anchor outside the state directory (watch)
        self._totals: dict[tuple[tuple[Any, ...], AnyRound], int] = {}
        self._epsilons: dict[tuple[Multiset, Unit, Method], float] = {}

    @classmethod
    def open_readonly(cls, path: str | Path, federation_id: str) -> Self:
        """Open a federation for reading only, verifying the whole chain; writes nothing.

        Works on a read-only file or mount. Errors, one line each: ``LedgerMissing`` (no file),
        ``NotALedger`` (not SQLite, or SQLite but not a ledger), ``LedgerCorrupted`` (integrity or
        chain, naming the first bad record), ``LedgerUnreadable`` (anything else, with a reason).
        ``spend`` on the result raises ``LedgerReadOnly``.
        """
        path = absolute_path(path)
        check_federation_id(federation_id)
        conn = connect_readonly(path)
        with closed_on_error(conn, path):
            identity = file_identity(path)
            with read_transaction(conn):
                check = conn.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise LedgerCorrupted(f"ledger {path} failed SQLite's integrity check: {check}")
                meta = read_meta(conn)
                row = find_registration(conn, path, federation_id)
                if row is None:
                    known = [
                        str(r[0]) for r in conn.execute("SELECT federation_id FROM federations")
                    ]
                    raise LedgerError(
                        f"federation {federation_id!r} is not in ledger {path} (it holds "
                        f"{', '.join(known) or 'none'})"
                    )
            ledger = cls(conn, path, meta, federation_id, row, readonly=True, identity=identity)
            ledger._inherit()
            ledger._catch_up()
        return ledger

    @staticmethod
    def describe(path: str | Path) -> LedgerInfo:
        """What the ledger file at ``path`` says about itself (read-only; no chain verified)."""
        path = absolute_path(path)
        conn = connect_readonly(path)
        try:
            with read_transaction(conn):
                meta = read_meta(conn)
                feds = tuple(
                    str(r[0])
                    for r in conn.execute(
                        "SELECT federation_id FROM federations ORDER BY created_at, federation_id"
                    )
                )
        except sqlite3.Error as error:
            raise classify_error(path, error) from error
        finally:
            conn.close()
        return LedgerInfo(
            path=path,
            ledger_id=meta.get("ledger_id"),
            # meta is append-only: a migrated ledger says so by the per-participant marker
            schema_version=3 if PER_PARTICIPANT in meta else int(meta.get("schema_version", "1")),
            mode=stored_mode(path, meta),
            created_at=meta.get("created_at"),
            federations=feds,
        )

    @staticmethod
    def federations(path: str | Path) -> list[str]:
        """Return the federation ids recorded in the ledger at ``path`` (read-only)."""
        return list(LedgerHistory.describe(path).federations)

    def close(self) -> None:
        """Close the database connection."""
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def file_replaced(self) -> bool:
        """Whether the path now names another file than the one opened (a restore, a move)."""
        return file_identity(self.path) != self._identity

    def _catch_up(self) -> None:
        """Read and verify records appended since we last looked (by us or another process).

        In-memory state moves only when everything read verified. Refuses (``LedgerReplaced``) a
        path that now names another file, or a file whose history no longer contains ours.
        """
        if self.file_replaced():
            raise LedgerReplaced(
                f"ledger {self.path} was replaced or removed since this process opened it "
                f"(a restore?); reopen it"
            )
        known = len(self._records)
        try:
            with read_transaction(self._conn):
                cohort = column_or_null(self._conn, "spends", "cohort")
                rows = self._conn.execute(
                    "SELECT seq, position, run_id, round_index, event, created_at, prev_hash, "
                    f"hash, {cohort} FROM spends WHERE federation_id = ? AND position >= ? "
                    "ORDER BY position",
                    (self.federation_id, known),
                ).fetchall()
                cohorts = load_cohorts(
                    self._conn, self.path, self.federation_id, self._exposure.members
                )
                head = self._conn.execute(
                    "SELECT position, hash FROM heads WHERE federation_id = ?",
                    (self.federation_id,),
                ).fetchone()
                ours = self._conn.execute(
                    "SELECT hash FROM spends WHERE federation_id = ? AND position = ?",
                    (self.federation_id, known - 1),
                ).fetchone()
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error
        if known and (ours is None or ours[0] != self._records[-1].hash):
            raise LedgerReplaced(
                f"ledger {self.path}, federation {self.federation_id!r}: record #{known - 1} is no "
                "longer the one this process read (the file was overwritten by another copy); "
                "reopen it"
            )
        prev = self._records[-1].hash if self._records else self._genesis
        new = verify_chain(self.path, self.federation_id, known, prev, rows)
        end = new[-1].hash if new else prev
        verify_head(self.path, self.federation_id, head, known + len(new), end)
        for cid, members in cohorts.items():
            self._exposure.add_cohort(cid, members)
        for record in new:
            if record.cohort is not None and record.cohort not in self._exposure.members:
                raise LedgerCorrupted(
                    f"ledger {self.path}, federation {self.federation_id!r}, record "
                    f"#{record.position}: its cohort is missing (edited)"
                )
            self._records.append(record)
            self._exposure.add(record.event, record.cohort)

    def records(self) -> list[SpendRecord]:
        """All verified records of this federation, oldest first."""
        self._catch_up()
        return list(self._records)

    def public_uses(self) -> list[PublicDataRecord]:
        """The public data runs on this budget declared (``BudgetLedger.record_public_use``)."""
        try:
            with read_transaction(self._conn):
                return public_uses(self._conn, self.path, self.federation_id)
        except sqlite3.Error as error:
            raise classify_error(self.path, error) from error

    def position(self) -> int:
        """Return the number of records (checkpoints store it; a resumed run checks it)."""
        self._catch_up()
        return len(self._records)

    def _inherit(self) -> None:
        """Count carried and inherited spends against every participant (cohorts.py, inherit.py).

        An inherited budget brings all its rounds, its own carried ones included: more than any
        one of its participants had (conservative; its records name no items).
        """
        carried: Counter[Recorded] = Counter()
        for fid in carried_federations(self._conn, self._meta, self.federation_id):
            with type(self).open_readonly(self.path, fid) as old:
                carried.update(r.event for r in old.records())
        for fid in inherited_sources(self._conn, self.federation_id):
            with type(self).open_readonly(self.path, fid) as old:
                carried.update(r.event for r in old.records())
                carried.update(old._carried)
        check_carried_relation(self.path, self.federation_id, self.neighbouring, carried)
        self._carried = carried
        self._exposure.everyone.update(carried)

    def checkpoint(self) -> LedgerCheckpoint:
        """Where the ledger stands now: record it before the first spend and in every checkpoint."""
        self._catch_up()
        return LedgerCheckpoint(
            ledger_id=self.ledger_id,
            path=str(self.path),
            federation_id=self.federation_id,
            position=len(self._records),
            head=self._records[-1].hash if self._records else None,
        )

    def check_resume(self, saved: LedgerCheckpoint) -> None:
        """Refuse (``LedgerError``) to resume a run checkpointed against another or a later ledger.

        A moved ledger (same id, other path) is accepted: the id, not the path, is the identity.
        """
        self._catch_up()
        if saved.ledger_id and saved.head and accepted(self._conn, saved.ledger_id, saved.head):
            return  # the operator accepted this rollback deliberately (recorded in the ledger)
        where = f"the checkpoint was written against ledger {saved.ledger_id} at {saved.path}"
        accept = (
            f"; to go on without those spends, accept it with "
            f"`{accept_command(self.path, saved.ledger_id, saved.head)}` (recorded)"
            if saved.ledger_id and saved.head
            else ""
        )
        if saved.ledger_id is not None and saved.ledger_id != self.ledger_id:
            raise LedgerRolledBack(
                f"{where}; {self.path} is ledger {self.ledger_id}: a different ledger, refusing "
                f"to resume (its spends would not compose with the run's; the checkpoint shows "
                f"{saved.position} spend(s) this ledger lacks: was the state directory deleted?)"
                f"{accept}"
            )
        if saved.federation_id != self.federation_id:
            raise LedgerError(
                f"{where} for federation {saved.federation_id!r}; this is federation "
                f"{self.federation_id!r}: refusing to resume"
            )
        if len(self._records) < saved.position:
            raise LedgerError(
                f"{where} at record {saved.position}; {self.path} holds only "
                f"{len(self._records)}: the ledger is behind (an older backup?), refusing to resume"
                f"{accept}"
            )
        if saved.head is not None and self._records[saved.position - 1].hash != saved.head:
            raise LedgerError(
                f"{where}: record #{saved.position - 1} differs from the one the checkpoint saw; "
                "the ledger's history diverged, refusing to resume"
            )
