"""``BudgetLedger``: the durable, append-only record of every privacy spend of a federation.

Design (privacy-accounting note, section 4; conventions, items 3-4):

* **Durable.** SQLite in WAL mode with ``synchronous=FULL``: a spend that ``spend`` returned is on
  disk before the noisy update is released; a writer killed mid-spend leaves either the whole record
  or none.
* **Append-only.** Triggers refuse UPDATE and DELETE on records. Each record carries a SHA-256 hash
  chained to the previous one (the first to the federation's own row) and a head row names the last
  record, so a hand-edited, reordered, deleted or truncated ledger is reported on open as
  ``LedgerCorrupted`` naming the first bad record, never silently reset. (The chain detects
  accidents and naive edits; someone with write access who recomputes every hash is outside its
  threat model.)
* **Recomputed, not trusted.** Epsilon is never stored: opening the ledger re-reads the rounds and
  recomposes them (PLD, by count).
* **Check, then commit.** ``would_exceed`` is a dry run; ``spend`` takes the write lock
  (``BEGIN IMMEDIATE``), catches up with records written by other processes, re-checks the budget
  inside the transaction and raises ``BudgetExhausted`` *before* writing anything.
* **Cheap per-round checks.** For the current history without the planned kind of round, the largest
  affordable count of that round is computed once (exact to the round under PLD, ``max_rounds``) and
  cached, so each further check of an unchanged setting is a dictionary lookup.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from accounting.composition import MAX_ROUNDS_LIMIT, _check_delta, _check_unit, epsilon, max_rounds
from accounting.schemes import GaussianRound

_SCHEMA = """
CREATE TABLE IF NOT EXISTS federations (
    federation_id  TEXT PRIMARY KEY,
    epsilon_budget REAL NOT NULL,
    delta          REAL NOT NULL,
    unit           TEXT NOT NULL,
    created_at     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS spends (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
    position       INTEGER NOT NULL,
    run_id         TEXT NOT NULL,
    round_index    INTEGER NOT NULL,
    event          TEXT NOT NULL,
    created_at     TEXT NOT NULL,
    prev_hash      TEXT NOT NULL,
    hash           TEXT NOT NULL,
    UNIQUE (federation_id, position)
);
CREATE TABLE IF NOT EXISTS heads (
    federation_id  TEXT PRIMARY KEY,
    position       INTEGER NOT NULL,
    hash           TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS spends_append_only_update BEFORE UPDATE ON spends
BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS spends_append_only_delete BEFORE DELETE ON spends
BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS federations_append_only_update BEFORE UPDATE ON federations
BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS federations_append_only_delete BEFORE DELETE ON federations
BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
"""


class LedgerError(Exception):
    """Base class of ledger errors."""


class BudgetExhausted(LedgerError):
    """The planned round would exceed the budget; nothing was recorded or released."""

    def __init__(self, message: str, *, epsilon_after: float, epsilon_budget: float) -> None:
        super().__init__(message)
        self.epsilon_after = epsilon_after
        self.epsilon_budget = epsilon_budget


class LedgerCorrupted(LedgerError):
    """The ledger file failed its integrity check; it is never silently reset."""


@dataclass(frozen=True)
class SpendRecord:
    """One recorded round: which run, which round index, which event, and its chain hash."""

    federation_id: str
    position: int
    run_id: str
    round_index: int
    event: GaussianRound
    created_at: str
    hash: str


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _genesis_hash(federation_id: str, budget: float, delta: float, unit: str, created: str) -> str:
    return _sha256(
        _canonical(
            {
                "federation_id": federation_id,
                "epsilon_budget": budget,
                "delta": delta,
                "unit": unit,
                "created_at": created,
            }
        )
    )


def _record_hash(
    federation_id: str,
    position: int,
    run_id: str,
    round_index: int,
    event_json: str,
    created_at: str,
    prev_hash: str,
) -> str:
    return _sha256(
        _canonical(
            {
                "federation_id": federation_id,
                "position": position,
                "run_id": run_id,
                "round_index": round_index,
                "event": event_json,
                "created_at": created_at,
                "prev_hash": prev_hash,
            }
        )
    )


def _connect(path: Path) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
    conn = sqlite3.connect(str(path), timeout=60.0, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 60000")
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        conn.close()
        raise LedgerError(f"could not put the ledger {path} in WAL mode (got {mode!r})")
    # FULL: the WAL is fsynced at every commit, so a returned spend survives power loss.
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


class BudgetLedger:
    """A federation's privacy budget, enforced against its durable record of spends.

    Open with ``BudgetLedger.open(path, federation_id, epsilon_budget, delta)``. Several runs over
    the same participants share one ``federation_id`` and so compose. The enforced guarantee is the
    PLD epsilon at ``delta`` for ``unit`` (task level by default).
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        federation_id: str,
        epsilon_budget: float,
        delta: float,
        unit: str,
        genesis: str,
    ) -> None:
        """Use ``BudgetLedger.open``."""
        self._conn = conn
        self.path = path
        self.federation_id = federation_id
        self.epsilon_budget = epsilon_budget
        self.delta = delta
        self.unit = unit
        self._genesis = genesis
        self._records: list[SpendRecord] = []
        self._counts: dict[GaussianRound, int] = {}
        self._affordable: dict[
            tuple[tuple[tuple[GaussianRound, int], ...], GaussianRound], int
        ] = {}

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
    ) -> BudgetLedger:
        """Open (creating if needed) the ledger at ``path`` for ``federation_id`` and verify it.

        An existing federation keeps the budget, delta and unit it was registered with; passing
        different ones is an error (a budget is never raised silently). ``epsilon_budget``/``delta``
        may be ``None`` to use the stored ones.
        """
        path = Path(path)
        if not isinstance(federation_id, str) or not federation_id:
            raise ValueError(f"federation_id must be a non-empty string; got {federation_id!r}")
        if epsilon_budget is not None and not (
            isinstance(epsilon_budget, int | float)
            and math.isfinite(epsilon_budget)
            and epsilon_budget > 0
        ):
            raise ValueError(f"epsilon_budget must be a finite number > 0; got {epsilon_budget!r}")
        if delta is not None:
            _check_delta(delta)
        _check_unit(unit)
        if not create and not path.is_file():
            raise FileNotFoundError(f"no ledger at {path}")
        try:
            conn = _connect(path)
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise LedgerCorrupted(f"ledger {path} failed SQLite's integrity check: {check}")
            conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as error:
            raise LedgerCorrupted(
                f"ledger {path} is not a readable SQLite database: {error}"
            ) from error
        try:
            with _immediate(conn):
                row = conn.execute(
                    "SELECT epsilon_budget, delta, unit, created_at FROM federations "
                    "WHERE federation_id = ?",
                    (federation_id,),
                ).fetchone()
                if row is None:
                    if not create or epsilon_budget is None or delta is None:
                        raise LedgerError(
                            f"federation {federation_id!r} is not in ledger {path}; opening a new "
                            "one needs epsilon_budget and delta"
                        )
                    created = datetime.now(UTC).isoformat()
                    conn.execute(
                        "INSERT INTO federations VALUES (?, ?, ?, ?, ?)",
                        (federation_id, float(epsilon_budget), float(delta), unit, created),
                    )
                    row = (float(epsilon_budget), float(delta), unit, created)
            stored_budget, stored_delta, stored_unit, created = row
            for name, given, stored in (
                ("epsilon_budget", epsilon_budget, stored_budget),
                ("delta", delta, stored_delta),
            ):
                if given is not None and float(given) != float(stored):
                    raise LedgerError(
                        f"{name} must match the value federation {federation_id!r} was registered "
                        f"with ({stored}); got {given}. A budget is fixed for a federation."
                    )
            if stored_unit != unit and not (epsilon_budget is None and delta is None):
                raise LedgerError(
                    f"unit must match the unit federation {federation_id!r} was registered with "
                    f"({stored_unit!r}); got {unit!r}"
                )
            ledger = cls(
                conn,
                path,
                federation_id,
                float(stored_budget),
                float(stored_delta),
                str(stored_unit),
                _genesis_hash(
                    federation_id,
                    float(stored_budget),
                    float(stored_delta),
                    str(stored_unit),
                    str(created),
                ),
            )
            ledger._catch_up(verify_head=True)
        except BaseException:
            conn.close()
            raise
        return ledger

    @staticmethod
    def federations(path: str | Path) -> list[str]:
        """Return the federation ids recorded in the ledger at ``path`` (read-only)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no ledger at {path}")
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60.0)
            try:
                rows = conn.execute("SELECT federation_id FROM federations ORDER BY created_at")
                return [str(r[0]) for r in rows]
            finally:
                conn.close()
        except sqlite3.DatabaseError as error:
            raise LedgerCorrupted(
                f"ledger {path} is not a readable fedmeta ledger: {error}"
            ) from error

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

    def _catch_up(self, *, verify_head: bool = False) -> None:
        """Read and verify records appended since we last looked (by us or another process)."""
        start = len(self._records)
        prev = self._records[-1].hash if self._records else self._genesis
        try:
            rows = self._conn.execute(
                "SELECT seq, position, run_id, round_index, event, created_at, prev_hash, hash "
                "FROM spends WHERE federation_id = ? AND position >= ? ORDER BY position",
                (self.federation_id, start),
            ).fetchall()
            head = (
                self._conn.execute(
                    "SELECT position, hash FROM heads WHERE federation_id = ?",
                    (self.federation_id,),
                ).fetchone()
                if verify_head
                else None
            )
        except sqlite3.DatabaseError as error:
            raise LedgerCorrupted(f"ledger {self.path} could not be read: {error}") from error
        for seq, position, run_id, round_index, event_json, created, prev_hash, digest in rows:
            where = (
                f"ledger {self.path}, federation {self.federation_id!r}, record #{position} "
                f"(row seq {seq}, run {run_id!r}, round {round_index})"
            )
            expected_position = len(self._records)
            if position != expected_position:
                raise LedgerCorrupted(
                    f"{where}: expected record #{expected_position} next; a record is missing"
                )
            if prev_hash != prev:
                raise LedgerCorrupted(f"{where}: its link to the previous record is broken")
            if (
                _record_hash(
                    self.federation_id,
                    position,
                    run_id,
                    round_index,
                    event_json,
                    created,
                    prev_hash,
                )
                != digest
            ):
                raise LedgerCorrupted(f"{where}: its contents do not match its hash (edited)")
            try:
                event = GaussianRound.from_dict(json.loads(event_json))
            except (ValueError, TypeError, KeyError) as error:
                raise LedgerCorrupted(f"{where}: unreadable event: {error}") from error
            record = SpendRecord(
                self.federation_id, position, run_id, round_index, event, created, digest
            )
            self._records.append(record)
            self._counts[event] = self._counts.get(event, 0) + 1
            prev = digest
        if verify_head:
            if head is None:
                if self._records:
                    raise LedgerCorrupted(
                        f"ledger {self.path}, federation {self.federation_id!r}: "
                        "the head row is missing"
                    )
            elif head[0] != len(self._records) - 1 or head[1] != prev:
                raise LedgerCorrupted(
                    f"ledger {self.path}, federation {self.federation_id!r}: the head names record "
                    f"#{head[0]} but the chain ends at record #{len(self._records) - 1}; records "
                    "were removed or the head was edited"
                )

    def records(self) -> list[SpendRecord]:
        """All verified records of this federation, oldest first."""
        self._catch_up()
        return list(self._records)

    def position(self) -> int:
        """Return the number of records (checkpoints store it; a resumed run checks it)."""
        self._catch_up()
        return len(self._records)

    def rounds(self) -> list[tuple[GaussianRound, int]]:
        """Return the spent rounds as ``[(GaussianRound, count)]`` groups."""
        self._catch_up()
        return list(self._counts.items())

    def epsilon(self, unit: str | None = None, method: str = "pld") -> float:
        """Epsilon spent so far at the ledger's delta, recomputed from the records."""
        self._catch_up()
        return epsilon(list(self._counts.items()), self.delta, unit or self.unit, method)

    # ---------------------------------------------------------------------------------- budget

    def _max_total(self, event: GaussianRound) -> int:
        """Largest total count of ``event`` affordable beside the other recorded rounds (cached)."""
        base = tuple(sorted(((e, c) for e, c in self._counts.items() if e != event), key=repr))
        key = (base, event)
        if key not in self._affordable:
            self._affordable[key] = max_rounds(
                event,
                self.epsilon_budget,
                self.delta,
                self.unit,
                prior=base,
                limit=MAX_ROUNDS_LIMIT,
            )
        return self._affordable[key]

    def rounds_affordable(self, event: GaussianRound) -> int:
        """How many more rounds like ``event`` the budget allows (exact under PLD)."""
        if not isinstance(event, GaussianRound):
            raise ValueError(f"round must be a GaussianRound; got {event!r}")
        self._catch_up()
        return max(0, self._max_total(event) - self._counts.get(event, 0))

    def would_exceed(self, event: GaussianRound) -> bool:
        """Dry run: return whether spending ``event`` now would take epsilon above the budget."""
        return self.rounds_affordable(event) < 1

    def spend(self, event: GaussianRound, run_id: str, round_index: int) -> SpendRecord:
        """Record one round, or raise ``BudgetExhausted`` having recorded nothing.

        Call before releasing the noisy update: when this returns, the record is durable.
        """
        if not isinstance(event, GaussianRound):
            raise ValueError(f"round must be a GaussianRound; got {event!r}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string; got {run_id!r}")
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise ValueError(f"round_index must be an integer >= 0; got {round_index!r}")
        event_json = _canonical(event.to_dict())
        with _immediate(self._conn):
            # Inside the write lock: include anything another process committed, then re-check.
            self._catch_up()
            if self._counts.get(event, 0) + 1 > self._max_total(event):
                after = epsilon([*self._counts.items(), (event, 1)], self.delta, self.unit)
                raise BudgetExhausted(
                    f"budget exhausted for federation {self.federation_id!r}: this round would "
                    f"take epsilon to {after:.4g} > budget {self.epsilon_budget:g} "
                    f"(delta {self.delta:g}, {self.unit} level); nothing was recorded",
                    epsilon_after=after,
                    epsilon_budget=self.epsilon_budget,
                )
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
        # Committed: only now does in-memory state move.
        record = SpendRecord(
            self.federation_id, position, run_id, round_index, event, created, digest
        )
        self._records.append(record)
        self._counts[event] = self._counts.get(event, 0) + 1
        return record


@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """Run a write transaction taken up front (BEGIN IMMEDIATE), rolled back on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
