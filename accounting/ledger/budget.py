"""Budget rules: ``BudgetLedger`` (check, then commit) and the affordable-rounds search."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from fedmeta.accounting.composition import (
    MAX_ROUNDS_LIMIT,
    _check_delta,
    _check_unit,
    epsilon,
    max_rounds,
)
from fedmeta.accounting.ledger.chain import (
    _canonical,
    _genesis_hash,
    _record_hash,
    _verify_chain,
    _verify_head,
)
from fedmeta.accounting.ledger.records import (
    SPEND_ATTEMPTS,
    BudgetExhausted,
    LedgerCheckpoint,
    LedgerCorrupted,
    LedgerError,
    LedgerInfo,
    LedgerMode,
    LedgerReadOnly,
    LedgerReplaced,
    SpendRecord,
)
from fedmeta.accounting.ledger.storage import (
    _abs,
    _check_federation_id,
    _check_mode,
    _check_neighbouring,
    _check_registration,
    _classify,
    _connect_readonly,
    _connect_writable,
    _ensure_schema,
    _file_identity,
    _immediate,
    _read_meta,
    _reading,
    _register,
    _Registration,
    _registration,
)
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    GaussianRound,
)

# --------------------------------------------------------------------------------- affordable


def affordable_rounds(
    groups: Sequence[tuple[GaussianRound, int]],
    event: GaussianRound,
    epsilon_budget: float,
    delta: float,
    unit: str = "task",
) -> int:
    """How many more rounds like ``event`` fit in the budget after ``groups`` (exact under PLD).

    Pure: the answer depends only on the arguments, so a value computed for one ledger position
    can never be reported for another. A PLD search: seconds, up to minutes for two-stage mixtures.
    """
    return max_rounds(
        event, epsilon_budget, delta, unit, prior=tuple(groups), limit=MAX_ROUNDS_LIMIT
    )


def _base(counts: Mapping[GaussianRound, int], event: GaussianRound) -> tuple[Any, ...]:
    """The recorded rounds other than ``event``: what its affordable total depends on."""
    return tuple(sorted(((e, c) for e, c in counts.items() if e != event), key=repr))


class BudgetLedger:
    """A federation's privacy budget, enforced against its durable record of spends.

    Open with ``BudgetLedger.open(path, federation_id, epsilon_budget, delta)`` to spend, or
    ``BudgetLedger.open_readonly(path, federation_id)`` to read. Several runs over the same data
    share one ``federation_id`` (``resolve_federation``) and so compose. The enforced guarantee is
    the PLD epsilon at ``delta`` for ``unit`` (task level by default).
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        meta: Mapping[str, str],
        federation_id: str,
        registration: _Registration,
        *,
        readonly: bool,
        identity: tuple[int, int] | None,
    ) -> None:
        """Use ``BudgetLedger.open`` or ``BudgetLedger.open_readonly``."""
        self._conn = conn
        self.path = path
        self.ledger_id: str | None = meta.get("ledger_id")
        self.mode: str | None = meta.get("mode")
        self.federation_id = federation_id
        self.epsilon_budget = registration.epsilon_budget
        self.delta = registration.delta
        self.unit = registration.unit
        self.neighbouring: str = registration.neighbouring or ADD_REMOVE
        self.readonly = readonly
        self._identity = identity
        self._genesis = _genesis_hash(
            federation_id,
            registration.epsilon_budget,
            registration.delta,
            registration.unit,
            registration.created_at,
            registration.neighbouring,
        )
        self._records: list[SpendRecord] = []
        self._counts: dict[GaussianRound, int] = {}
        self._totals: dict[tuple[tuple[Any, ...], GaussianRound], int] = {}

    # ---------------------------------------------------------------------------------- opening

    @classmethod
    def open(
        cls,
        path: str | Path,
        federation_id: str,
        epsilon_budget: float | None = None,
        delta: float | None = None,
        *,
        unit: str = "task",
        create: bool = True,
        neighbouring: str | None = None,
        mode: LedgerMode = "secure",
    ) -> BudgetLedger:
        """Open (creating if needed) the ledger at ``path`` for ``federation_id`` and verify it.

        An existing federation keeps the budget, delta, unit and neighbouring relation it was
        registered with; passing different ones is an error (a budget is never raised silently).
        ``epsilon_budget``/``delta`` may be ``None`` to use the stored ones; ``neighbouring=None``
        uses the stored relation (``add_remove`` for a new federation). ``mode`` is ``"insecure"``
        for runs with reproducible test noise: such runs never share a ledger with secure ones.
        """
        path = _abs(path)
        _check_federation_id(federation_id)
        if epsilon_budget is not None and not (
            isinstance(epsilon_budget, int | float)
            and not isinstance(epsilon_budget, bool)
            and math.isfinite(epsilon_budget)
            and epsilon_budget > 0
        ):
            raise ValueError(f"epsilon_budget must be a finite number > 0; got {epsilon_budget!r}")
        if delta is not None:
            _check_delta(delta)
        _check_unit(unit)
        _check_neighbouring(neighbouring)
        _check_mode(mode)
        conn = _connect_writable(path, create=create)
        try:
            identity = _file_identity(path)
            meta = _ensure_schema(conn, path, mode)
            row = _register(
                conn, path, federation_id, epsilon_budget, delta, unit, neighbouring, create
            )
            _check_registration(federation_id, row, epsilon_budget, delta, unit, neighbouring)
            ledger = cls(conn, path, meta, federation_id, row, readonly=False, identity=identity)
            ledger._catch_up()
        except sqlite3.Error as error:
            conn.close()
            raise _classify(path, error) from error
        except BaseException:
            conn.close()
            raise
        return ledger

    @classmethod
    def open_readonly(cls, path: str | Path, federation_id: str) -> BudgetLedger:
        """Open a federation for reading only, verifying the whole chain; writes nothing.

        Works on a read-only file or mount. Errors, one line each: ``LedgerMissing`` (no file),
        ``NotALedger`` (not SQLite, or SQLite but not a ledger), ``LedgerCorrupted`` (integrity or
        chain, naming the first bad record), ``LedgerUnreadable`` (anything else, with a reason).
        ``spend`` on the result raises ``LedgerReadOnly``.
        """
        path = _abs(path)
        _check_federation_id(federation_id)
        conn = _connect_readonly(path)
        try:
            identity = _file_identity(path)
            with _reading(conn):
                check = conn.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise LedgerCorrupted(f"ledger {path} failed SQLite's integrity check: {check}")
                meta = _read_meta(conn)
                row = _registration(conn, federation_id)
                if row is None:
                    known = [
                        str(r[0]) for r in conn.execute("SELECT federation_id FROM federations")
                    ]
                    raise LedgerError(
                        f"federation {federation_id!r} is not in ledger {path} (it holds "
                        f"{', '.join(known) or 'none'})"
                    )
            ledger = cls(conn, path, meta, federation_id, row, readonly=True, identity=identity)
            ledger._catch_up()
        except sqlite3.Error as error:
            conn.close()
            raise _classify(path, error) from error
        except BaseException:
            conn.close()
            raise
        return ledger

    @staticmethod
    def describe(path: str | Path) -> LedgerInfo:
        """What the ledger file at ``path`` says about itself (read-only; no chain verified)."""
        path = _abs(path)
        conn = _connect_readonly(path)
        try:
            with _reading(conn):
                meta = _read_meta(conn)
                feds = tuple(
                    str(r[0])
                    for r in conn.execute(
                        "SELECT federation_id FROM federations ORDER BY created_at, federation_id"
                    )
                )
        except sqlite3.Error as error:
            raise _classify(path, error) from error
        finally:
            conn.close()
        return LedgerInfo(
            path=path,
            ledger_id=meta.get("ledger_id"),
            schema_version=int(meta.get("schema_version", "1")),
            mode=meta.get("mode"),
            created_at=meta.get("created_at"),
            federations=feds,
        )

    @staticmethod
    def federations(path: str | Path) -> list[str]:
        """Return the federation ids recorded in the ledger at ``path`` (read-only)."""
        return list(BudgetLedger.describe(path).federations)

    def close(self) -> None:
        """Close the database connection."""
        self._conn.close()

    def __enter__(self) -> BudgetLedger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- reading

    def file_replaced(self) -> bool:
        """Whether the path now names another file than the one opened (a restore, a move)."""
        return _file_identity(self.path) != self._identity

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
            with _reading(self._conn):
                rows = self._conn.execute(
                    "SELECT seq, position, run_id, round_index, event, created_at, prev_hash, "
                    "hash FROM spends WHERE federation_id = ? AND position >= ? ORDER BY position",
                    (self.federation_id, known),
                ).fetchall()
                head = self._conn.execute(
                    "SELECT position, hash FROM heads WHERE federation_id = ?",
                    (self.federation_id,),
                ).fetchone()
                ours = self._conn.execute(
                    "SELECT hash FROM spends WHERE federation_id = ? AND position = ?",
                    (self.federation_id, known - 1),
                ).fetchone()
        except sqlite3.Error as error:
            raise _classify(self.path, error) from error
        if known and (ours is None or ours[0] != self._records[-1].hash):
            raise LedgerReplaced(
                f"ledger {self.path}, federation {self.federation_id!r}: record #{known - 1} is no "
                "longer the one this process read (the file was overwritten by another copy); "
                "reopen it"
            )
        prev = self._records[-1].hash if self._records else self._genesis
        new = _verify_chain(self.path, self.federation_id, known, prev, rows)
        end = new[-1].hash if new else prev
        _verify_head(self.path, self.federation_id, head, known + len(new), end)
        for record in new:
            self._records.append(record)
            self._counts[record.event] = self._counts.get(record.event, 0) + 1

    def records(self) -> list[SpendRecord]:
        """All verified records of this federation, oldest first."""
        self._catch_up()
        return list(self._records)

    def position(self) -> int:
        """Return the number of records (checkpoints store it; a resumed run checks it)."""
        self._catch_up()
        return len(self._records)

    def rounds(self) -> list[tuple[GaussianRound, int]]:
        """Return the spent rounds as ``[(GaussianRound, count)]`` groups, first seen first."""
        self._catch_up()
        return list(self._counts.items())

    def epsilon(self, unit: str | None = None, method: str = "pld") -> float:
        """Epsilon spent so far at the ledger's delta, recomputed from the records."""
        self._catch_up()
        return epsilon(list(self._counts.items()), self.delta, unit or self.unit, method)

    # ---------------------------------------------------------------------------------- identity

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
        where = f"the checkpoint was written against ledger {saved.ledger_id} at {saved.path}"
        if saved.ledger_id is not None and saved.ledger_id != self.ledger_id:
            raise LedgerError(
                f"{where}; {self.path} is ledger {self.ledger_id}: a different ledger, refusing "
                "to resume (its spends would not compose with the run's)"
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
            )
        if saved.head is not None and self._records[saved.position - 1].hash != saved.head:
            raise LedgerError(
                f"{where}: record #{saved.position - 1} differs from the one the checkpoint saw; "
                "the ledger's history diverged, refusing to resume"
            )

    # ---------------------------------------------------------------------------------- budget

    def _max_total(self, base: tuple[Any, ...], event: GaussianRound) -> int:
        """Largest total count of ``event`` affordable beside ``base`` (cached; a PLD search)."""
        key = (base, event)
        if key not in self._totals:
            self._totals[key] = affordable_rounds(
                base, event, self.epsilon_budget, self.delta, self.unit
            )
        return self._totals[key]

    def rounds_affordable(self, event: GaussianRound) -> int:
        """How many more rounds like ``event`` the budget allows (exact under PLD)."""
        if not isinstance(event, GaussianRound):
            raise ValueError(f"round must be a GaussianRound; got {event!r}")
        self._catch_up()
        total = self._max_total(_base(self._counts, event), event)
        return max(0, total - self._counts.get(event, 0))

    def would_exceed(self, event: GaussianRound) -> bool:
        """Dry run: return whether spending ``event`` now would take epsilon above the budget."""
        return self.rounds_affordable(event) < 1

    def _check_spend(self, event: GaussianRound, run_id: str, round_index: int) -> None:
        if self.readonly:
            raise LedgerReadOnly(
                f"ledger {self.path} was opened read-only (open_readonly); spending needs "
                "BudgetLedger.open"
            )
        if not isinstance(event, GaussianRound):
            raise ValueError(f"round must be a GaussianRound; got {event!r}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string; got {run_id!r}")
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise ValueError(f"round_index must be an integer >= 0; got {round_index!r}")
        if event.neighbouring != self.neighbouring:
            raise LedgerError(
                f"neighbouring must match the federation's: {self.federation_id!r} composes "
                f"{self.neighbouring!r} rounds, this round is {event.neighbouring!r}; a "
                "composition never mixes relations"
            )

    def spend(self, event: GaussianRound, run_id: str, round_index: int) -> SpendRecord:
        """Record one round, or raise ``BudgetExhausted`` having recorded nothing.

        Call before releasing the noisy update: when this returns, the record is durable and the
        main ledger file holds it. The affordability search runs before the write lock is taken;
        the lock is held for the catch-up, the re-check and the append (milliseconds).
        """
        self._check_spend(event, run_id, round_index)
        event_json = _canonical(event.to_dict())
        for _ in range(SPEND_ATTEMPTS):
            self._catch_up()
            base = _base(self._counts, event)
            total = self._max_total(base, event)  # the search, outside the lock
            outcome = self._append_or_explain(event, event_json, run_id, round_index, base, total)
            if isinstance(outcome, SpendRecord):
                return outcome
            if outcome == "exhausted":
                after = epsilon([*self._counts.items(), (event, 1)], self.delta, self.unit)
                raise BudgetExhausted(
                    f"budget exhausted for federation {self.federation_id!r}: this round would "
                    f"take epsilon to {after:.4g} > budget {self.epsilon_budget:g} "
                    f"(delta {self.delta:g}, {self.unit} level); nothing was recorded",
                    epsilon_after=after,
                    epsilon_budget=self.epsilon_budget,
                )
        raise LedgerError(
            f"spend on federation {self.federation_id!r} gave up after {SPEND_ATTEMPTS} attempts: "
            "other processes kept recording other kinds of round meanwhile; nothing was recorded"
        )

    def _append_or_explain(
        self,
        event: GaussianRound,
        event_json: str,
        run_id: str,
        round_index: int,
        base: tuple[Any, ...],
        total: int,
    ) -> SpendRecord | Literal["exhausted", "changed"]:
        """``_append``, with a file-system fault (full disk, read-only) turned into one line.

        The transaction was rolled back, so nothing was recorded, and the caller releases nothing.
        Should the commit have landed despite the error (SQLite reported it after its commit
        point), the record is read back and returned, so the round is released exactly when its
        spend is in the ledger.
        """
        known = len(self._records)
        try:
            return self._append(event, event_json, run_id, round_index, base, total)
        except sqlite3.Error as error:
            fault = _classify(self.path, error)
            try:
                self._catch_up()
            except LedgerError:
                raise fault from error
            landed = self._records[known:]
            if landed and (landed[-1].run_id, landed[-1].round_index) == (run_id, round_index):
                return landed[-1]
            raise fault from error

    def _append(
        self,
        event: GaussianRound,
        event_json: str,
        run_id: str,
        round_index: int,
        base: tuple[Any, ...],
        total: int,
    ) -> SpendRecord | Literal["exhausted", "changed"]:
        """Under the write lock: catch up, re-check against ``total`` and append.

        Returns ``"changed"`` (nothing written) when records of other kinds arrived since
        ``total`` was computed for ``base``: the caller searches again outside the lock.
        """
        with _immediate(self._conn):
            self._catch_up()
            if _base(self._counts, event) != base:
                return "changed"
            if self._counts.get(event, 0) + 1 > total:
                return "exhausted"
            position = len(self._records)
            prev = self._records[-1].hash if self._records else self._genesis
            created = datetime.now(UTC).isoformat()
            digest = _record_hash(
                self.federation_id, position, run_id, round_index, event_json, created, prev
            )
            self._conn.execute(
                "INSERT INTO spends (federation_id, position, run_id, round_index, event, "
                "created_at, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    self.federation_id,
                    position,
                    run_id,
                    round_index,
                    event_json,
                    created,
                    prev,
                    digest,
                ),
            )
            self._conn.execute(
                "INSERT INTO heads (federation_id, position, hash) VALUES (?, ?, ?) "
                "ON CONFLICT(federation_id) DO UPDATE SET position = excluded.position, "
                "hash = excluded.hash",
                (self.federation_id, position, digest),
            )
        # Committed (and fsynced): only now does in-memory state move.
        record = SpendRecord(
            self.federation_id, position, run_id, round_index, event, created, digest
        )
        self._records.append(record)
        self._counts[event] = self._counts.get(event, 0) + 1
        return record
