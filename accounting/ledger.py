"""``BudgetLedger``: the durable, append-only record of every privacy spend of a federation.

Design (privacy-accounting note, section 4; conventions, items 3-4; users' guide: docs/ledger.md):

* **Durable, and the main file is the whole ledger.** SQLite with a rollback journal
  (``journal_mode=DELETE``) and ``synchronous=EXTRA``: a commit saves the old pages in
  ``PATH-journal``, writes the new pages into the main file, fsyncs it, deletes the journal and
  fsyncs the directory. When ``spend`` returns, the main file alone holds every record, so copying
  ``PATH`` alone after a ``kill -9`` loses nothing that was acknowledged. Why not WAL (used up to
  schema 1): committed records live in ``PATH-wal`` until a checkpoint (after a ``kill -9`` the main
  file was an empty 4 KB page, and a copy of it alone lost every spend), and a WAL database cannot
  be opened on a read-only mount (SQLite must create ``PATH-shm``). A rollback journal needs no side
  file to read; readers on a read-only mount take ordinary POSIX read locks. The price: a reader
  waits (busy timeout) during the milliseconds of a commit instead of reading beside it. A process
  killed *inside* a commit leaves ``PATH-journal`` ("hot"); the next writable open rolls the
  unfinished transaction back. A copy of the main file alone taken then may hold half of that last
  transaction; it is refused as corrupted (hash chain, head row), never read short.
* **An identity of its own.** A ``meta`` table, written once when the file is created, holds a
  random ``ledger_id``, the schema version, the mode (``secure`` or ``insecure``: reproducible test
  noise is not private, so test runs never spend from a ledger secure runs use) and a random salt
  for data-keyed federation ids. Checkpoints record ``ledger_id`` and position
  (``BudgetLedger.checkpoint``); resume refuses another ledger or one that is behind
  (``BudgetLedger.check_resume``).
* **Append-only.** Triggers refuse UPDATE and DELETE on records, federations, budgets and meta.
  Each record carries a SHA-256 hash chained to the previous one (the first to the federation's own
  row) and a head row names the last record, so a hand-edited, reordered, deleted or truncated
  ledger is reported as ``LedgerCorrupted`` naming the first bad record, never silently reset. (The
  chain detects accidents and naive edits; someone with write access who recomputes every hash is
  outside its threat model.)
* **Recomputed, not trusted.** Epsilon is never stored: it is recomposed from the records (PLD, by
  count) on open and as records arrive.
* **Check, then commit, and never search under the lock.** ``would_exceed`` is a dry run. ``spend``
  computes the affordable count (a PLD search, up to minutes) *outside* the write lock, then takes
  it (``BEGIN IMMEDIATE``), catches up with records written by other processes and, if nothing
  changed what the search depended on, re-checks and appends within milliseconds; otherwise it rolls
  back and searches again (bounded). ``BudgetExhausted`` is raised before anything is written.
* **Read-only access writes nothing.** ``open_readonly``, ``describe`` and ``federations`` open the
  file with ``mode=ro``: no journal-mode switch, no schema, no write lock, so they work on a
  read-only mount and leave the file's bytes and mtime alone. They still verify the chain.
* **The budget follows the data, not the run.** ``resolve_federation`` names the current budget of
  a data set by ``label-HMAC(salt, data identity)``; ``start_new_budget`` is the one, recorded, way
  to start afresh on the same data.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
import math
import os
import re
import socket
import sqlite3
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

from fedmeta.accounting.composition import (
    MAX_ROUNDS_LIMIT,
    _check_delta,
    _check_unit,
    epsilon,
    max_rounds,
)
from fedmeta.accounting.randomness import SystemRandomSource
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    NEIGHBOURING_RELATIONS,
    GaussianRound,
)

#: Schema 1: no meta table, WAL journal (fedmeta before the ledger had an identity). Schema 2: this.
SCHEMA_VERSION = 2
LedgerMode: TypeAlias = Literal["secure", "insecure"]
LEDGER_MODES: tuple[str, ...] = ("secure", "insecure")
#: Why a ledger could not be read: a bounded set, used as a metric label by the exporter.
UNREADABLE_REASONS: tuple[str, ...] = (
    "missing",
    "cannot_open",
    "not_sqlite",
    "not_ledger",
    "corrupted",
    "hot_journal",
    "legacy_wal",
    "busy",
)
#: How often ``spend`` re-runs its search when other processes keep recording *other* kinds of
#: round meanwhile (records of the same kind never force a retry).
SPEND_ATTEMPTS = 8
#: How long SQLite waits for another connection's lock (a commit takes milliseconds).
BUSY_TIMEOUT_S = 60.0
#: How long a writable open waits for an older fedmeta to let go of a WAL ledger it converts.
_SWITCH_TIMEOUT_S = 5.0
#: The reason recorded for the first budget of a data set.
FIRST_BUDGET_REASON = "first budget for this data"


_SQLITE_MAGIC = b"SQLite format 3\x00"
_LEDGER_TABLES = frozenset({"federations", "spends", "heads"})
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

_CREATE: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS federations (
        federation_id  TEXT PRIMARY KEY,
        epsilon_budget REAL NOT NULL,
        delta          REAL NOT NULL,
        unit           TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        neighbouring   TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS spends (
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
    )""",
    """CREATE TABLE IF NOT EXISTS heads (
        federation_id  TEXT PRIMARY KEY,
        position       INTEGER NOT NULL,
        hash           TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS budgets (
        seq            INTEGER PRIMARY KEY AUTOINCREMENT,
        data_key       TEXT NOT NULL,
        number         INTEGER NOT NULL,
        federation_id  TEXT NOT NULL UNIQUE,
        reason         TEXT NOT NULL,
        actor          TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        prev_hash      TEXT NOT NULL,
        hash           TEXT NOT NULL,
        UNIQUE (data_key, number)
    )""",
    *(
        f"CREATE TRIGGER IF NOT EXISTS {table}_append_only_{op.lower()} BEFORE {op} ON {table} "
        "BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END"
        for table in ("spends", "federations", "budgets", "meta")
        for op in ("UPDATE", "DELETE")
    ),
)


# ------------------------------------------------------------------------------------- errors


class LedgerError(Exception):
    """Base class of ledger errors."""


class BudgetExhausted(LedgerError):
    """The planned round would exceed the budget; nothing was recorded or released."""

    def __init__(self, message: str, *, epsilon_after: float, epsilon_budget: float) -> None:
        super().__init__(message)
        self.epsilon_after = epsilon_after
        self.epsilon_budget = epsilon_budget


class LedgerUnreadable(LedgerError):
    """The ledger file cannot be read; ``reason`` is one of ``UNREADABLE_REASONS``."""

    reason = "cannot_open"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class LedgerMissing(LedgerUnreadable, FileNotFoundError):
    """There is no file at the ledger's path."""

    reason = "missing"


class NotALedger(LedgerUnreadable):
    """Not a SQLite file (reason ``not_sqlite``), or SQLite but not a fedmeta ledger."""

    reason = "not_ledger"


class LedgerCorrupted(LedgerUnreadable):
    """The ledger file failed its integrity check; it is never silently reset."""

    reason = "corrupted"


class LedgerReplaced(LedgerError):
    """The file at the ledger's path is no longer the one this object opened (restored, moved)."""


class LedgerReadOnly(LedgerError):
    """A write was attempted through a ledger opened with ``open_readonly``."""


# ----------------------------------------------------------------------------------- records


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


@dataclass(frozen=True)
class BudgetRecord:
    """One budget of a data set: number ``n`` (1 = the first), who started it, when and why."""

    data_key: str
    number: int
    federation_id: str
    reason: str
    actor: str
    created_at: str
    hash: str


@dataclass(frozen=True)
class LedgerInfo:
    """What a ledger file says about itself (read-only). ``ledger_id is None``: legacy, no id."""

    path: Path
    ledger_id: str | None
    schema_version: int
    mode: str | None
    created_at: str | None
    federations: tuple[str, ...]

    @property
    def legacy(self) -> bool:
        """Written before ledgers had an identity (schema 1); a writable open adds one."""
        return self.ledger_id is None


@dataclass(frozen=True)
class LedgerCheckpoint:
    """Where a run stood in the ledger: store it in every checkpoint, check it on resume.

    ``head`` is the hash of record ``position - 1`` (``None`` at position 0): with it a resumed run
    also refuses a ledger with the same id whose history diverged.
    """

    ledger_id: str | None
    path: str
    federation_id: str
    position: int
    head: str | None

    def __post_init__(self) -> None:
        if isinstance(self.position, bool) or not isinstance(self.position, int):
            raise ValueError(f"position must be an integer >= 0; got {self.position!r}")
        if self.position < 0:
            raise ValueError(f"position must be an integer >= 0; got {self.position!r}")
        if not isinstance(self.federation_id, str) or not self.federation_id:
            raise ValueError(
                f"federation_id must be a non-empty string; got {self.federation_id!r}"
            )
        if (self.head is None) != (self.position == 0):
            raise ValueError(
                f"head must be None exactly at position 0; got head {self.head!r} at position "
                f"{self.position}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict; ``LedgerCheckpoint.from_dict`` inverts it."""
        return {
            "ledger_id": self.ledger_id,
            "path": self.path,
            "federation_id": self.federation_id,
            "position": self.position,
            "head": self.head,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LedgerCheckpoint:
        """Rebuild (and validate) a checkpoint entry written by ``to_dict``."""
        return cls(
            ledger_id=data.get("ledger_id"),
            path=str(data.get("path", "")),
            federation_id=data["federation_id"],
            position=data["position"],
            head=data.get("head"),
        )


@dataclass(frozen=True)
class BackupResult:
    """A verified backup: where it is and how many records each federation holds there."""

    path: Path
    ledger_id: str | None
    positions: dict[str, int] = field(default_factory=dict)


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


# ------------------------------------------------------------------------------------ hashing


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _genesis_hash(
    federation_id: str,
    budget: float,
    delta: float,
    unit: str,
    created: str,
    neighbouring: str | None,
) -> str:
    data: dict[str, Any] = {
        "federation_id": federation_id,
        "epsilon_budget": budget,
        "delta": delta,
        "unit": unit,
        "created_at": created,
    }
    if neighbouring is not None:  # schema-1 federations recorded no relation (all add/remove)
        data["neighbouring"] = neighbouring
    return _sha256(_canonical(data))


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


def _budget_hash(ledger_id: str, record: BudgetRecord, prev_hash: str) -> str:
    return _sha256(
        _canonical(
            {
                "ledger_id": ledger_id,
                "data_key": record.data_key,
                "number": record.number,
                "federation_id": record.federation_id,
                "reason": record.reason,
                "actor": record.actor,
                "created_at": record.created_at,
                "prev_hash": prev_hash,
            }
        )
    )


def _budget_genesis(ledger_id: str, data_key: str) -> str:
    return _sha256(_canonical({"ledger_id": ledger_id, "data_key": data_key}))


# -------------------------------------------------------------------------------- connections


def _abs(path: str | Path) -> Path:
    """The absolute, symlink-resolved path (what a run records and a resume compares)."""
    return Path(path).expanduser().resolve()


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _read_header(path: Path) -> bytes:
    """The first 100 bytes, or a one-line error saying why the file cannot be a ledger."""
    try:
        with open(path, "rb") as handle:
            return handle.read(100)
    except FileNotFoundError as error:
        raise LedgerMissing(f"no ledger at {path} (file missing)") from error
    except IsADirectoryError as error:
        raise NotALedger(
            f"{path} is a directory, not a ledger file", reason="not_sqlite"
        ) from error
    except OSError as error:
        raise LedgerUnreadable(f"cannot read the ledger {path}: {error.strerror}") from error


def _check_sqlite_header(path: Path, header: bytes) -> None:
    if not header.startswith(_SQLITE_MAGIC):
        raise NotALedger(
            f"{path} is not a SQLite file (no 'SQLite format 3' header): not a fedmeta ledger",
            reason="not_sqlite",
        )


def _classify(path: Path, error: sqlite3.Error) -> LedgerUnreadable:
    """Turn a SQLite error met while opening or reading into a one-line, reasoned ledger error."""
    code = getattr(error, "sqlite_errorcode", 0) & 0xFF
    if code == 26:  # SQLITE_NOTADB
        return NotALedger(f"{path} is not a SQLite database ({error})", reason="not_sqlite")
    if code in (5, 6):  # SQLITE_BUSY, SQLITE_LOCKED
        return LedgerUnreadable(f"ledger {path} stayed locked: {error}", reason="busy")
    if code == 8 and _sidecar(path, "-journal").exists():  # SQLITE_READONLY (hot journal)
        return LedgerUnreadable(
            f"ledger {path}: a writer died in the middle of a commit ({path.name}-journal "
            "exists); the next writable open rolls it back, a read-only one cannot",
            reason="hot_journal",
        )
    if code == 8:  # SQLITE_READONLY without a hot journal: a writer on a read-only file or mount
        return LedgerUnreadable(
            f"ledger {path} is read-only here ({error}); writing needs write access, reading "
            "works with BudgetLedger.open_readonly"
        )
    if code == 11:  # SQLITE_CORRUPT
        return LedgerCorrupted(f"ledger {path} is corrupted: {error}")
    return LedgerUnreadable(f"cannot open the ledger {path}: {error}")


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _not_a_ledger(path: Path, header: bytes) -> NotALedger:
    hint = ""
    if header[18:20] == b"\x02\x02":
        hint = (
            " (in WAL mode: if it is a copy of a ledger written by an older fedmeta, its records "
            f"were in {path.name}-wal, which was not copied with it)"
        )
    return NotALedger(f"{path} is a SQLite database but not a fedmeta ledger{hint}")


def _connect_readonly(path: Path) -> sqlite3.Connection:
    """A connection that writes nothing: ``mode=ro``, no pragma that changes the file."""
    header = _read_header(path)
    if not header:
        raise NotALedger(f"{path} is an empty file, not a fedmeta ledger")
    _check_sqlite_header(path, header)
    params = {"mode": "ro"}
    if header[18:20] == b"\x02\x02":  # a schema-1 ledger still in WAL mode
        wal = _sidecar(path, "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise LedgerUnreadable(
                f"ledger {path} was written by an older fedmeta in WAL mode and {wal.name} holds "
                "records: open it writable once (the next run does) to fold them into the file",
                reason="legacy_wal",
            )
        # No WAL content: the main file is complete. immutable=1 stops SQLite creating -shm.
        params["immutable"] = "1"
    uri = f"file:{urllib.parse.quote(str(path))}?{urllib.parse.urlencode(params)}"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as error:
        raise _classify(path, error) from error
    try:
        if not _LEDGER_TABLES <= _tables(conn):
            raise _not_a_ledger(path, header)
    except sqlite3.Error as error:
        conn.close()
        raise _classify(path, error) from error
    except BaseException:
        conn.close()
        raise
    return conn


def _check_writable_location(path: Path, *, create: bool) -> None:
    """Refuse, with the reason, a path a writer cannot use: not SQLite, missing, read-only."""
    if path.exists():
        header = _read_header(path)
        if header:  # an empty file is an empty SQLite database
            _check_sqlite_header(path, header)
    elif not create:
        raise LedgerMissing(f"no ledger at {path} (file missing)")
    elif not path.parent.is_dir():
        raise LedgerUnreadable(
            f"cannot create the ledger {path}: the directory {path.parent} does not exist"
        )
    # SQLite would open a read-only file read-only without a word and fail at the first spend.
    # access() sees a read-only mount even for root (for whom chmod does not stop writes).
    for needed in (path, path.parent) if path.exists() else (path.parent,):
        if not os.access(needed, os.W_OK):
            raise LedgerReadOnly(
                f"ledger {path} is read-only here ({needed} is not writable: file, directory or "
                "mount); spending needs write access, reading works with open_readonly"
            )


def _connect_writable(path: Path, *, create: bool) -> sqlite3.Connection:
    """A writer's connection: rollback journal, ``synchronous=EXTRA``, integrity checked."""
    _check_writable_location(path, create=create)
    try:
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as error:
        raise _classify(path, error) from error
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        _use_rollback_journal(conn, path)
        # EXTRA: also fsync the directory after deleting the journal (the commit point), so a
        # returned spend survives power loss, not only a killed process.
        conn.execute("PRAGMA synchronous = EXTRA")
        conn.execute("PRAGMA foreign_keys = ON")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise LedgerCorrupted(f"ledger {path} failed SQLite's integrity check: {check}")
    except sqlite3.Error as error:
        conn.close()
        raise _classify(path, error) from error
    except BaseException:
        conn.close()
        raise
    return conn


def _use_rollback_journal(conn: sqlite3.Connection, path: Path) -> None:
    """Switch a schema-1 (WAL) ledger to the rollback journal; a no-op for schema 2."""
    mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    if mode == "delete":
        return
    # The switch needs every other connection closed; do not wait the spend's full minute for it.
    conn.execute(f"PRAGMA busy_timeout = {int(_SWITCH_TIMEOUT_S * 1000)}")
    try:
        mode = str(conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0]).lower()
    except sqlite3.OperationalError as error:
        if getattr(error, "sqlite_errorcode", 0) & 0xFF not in (5, 6):  # BUSY, LOCKED
            raise
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    if mode != "delete":
        raise LedgerError(
            f"could not switch the ledger {path} from {mode!r} to a rollback journal: another "
            "process has it open (an older fedmeta?); stop it and retry"
        )


def _read_meta(conn: sqlite3.Connection) -> dict[str, str]:
    if "meta" not in _tables(conn):
        return {}
    return {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}


def _ensure_schema(conn: sqlite3.Connection, path: Path, mode: LedgerMode | None) -> dict[str, str]:
    """Create or migrate the schema and the identity; check the mode. Returns the meta table.

    A schema-1 ledger (no meta table) gets its identity here, in the mode of the first writable
    open that meets it: schema 1 recorded no mode. ``mode=None`` checks nothing and refuses to
    create an identity (the caller is not a run).
    """
    with _immediate(conn):
        tables = _tables(conn)
        if tables - {"sqlite_sequence"} and not _LEDGER_TABLES <= tables:
            raise NotALedger(
                f"{path} is a SQLite database but not a fedmeta ledger; refusing to add ledger "
                "tables to it"
            )
        for statement in _CREATE:
            conn.execute(statement)
        columns = {str(r[1]) for r in conn.execute("PRAGMA table_info(federations)")}
        if "neighbouring" not in columns:
            conn.execute("ALTER TABLE federations ADD COLUMN neighbouring TEXT")
        meta = _read_meta(conn)
        if not meta:
            if mode is None:
                raise LedgerError(
                    f"ledger {path} has no identity yet (written by an older fedmeta); open it "
                    "once with BudgetLedger.open (any run does) to add one"
                )
            meta = _new_meta(mode, migrated="spends" in tables)
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", sorted(meta.items()))
    if mode is not None and meta["mode"] != mode:
        raise LedgerError(
            f"mode must match the ledger's: {path} is a {meta['mode']!r} ledger, opened with mode "
            f"{mode!r}; reproducible test noise (insecure) is not private, so test runs and "
            "secure runs never share a ledger: use another ledger file"
        )
    return meta


def _new_meta(mode: LedgerMode, *, migrated: bool) -> dict[str, str]:
    meta = {
        "ledger_id": uuid.uuid4().hex,
        "schema_version": str(SCHEMA_VERSION),
        "mode": mode,
        # Drawn from the OS CSPRNG: with it, a federation id reveals nothing about the data.
        "salt": SystemRandomSource().random_bytes(32).hex(),
        "created_at": datetime.now(UTC).isoformat(),
    }
    if migrated:
        meta["migrated_from_schema"] = "1"
    return meta


def _check_mode(mode: object) -> None:
    if mode not in LEDGER_MODES:
        raise ValueError(f"mode must be one of {LEDGER_MODES}; got {mode!r}")


def _check_neighbouring(neighbouring: object) -> None:
    if neighbouring is not None and neighbouring not in NEIGHBOURING_RELATIONS:
        raise ValueError(
            f"neighbouring must be one of {NEIGHBOURING_RELATIONS}; got {neighbouring!r}"
        )


def _check_federation_id(federation_id: object) -> None:
    if not isinstance(federation_id, str) or not federation_id:
        raise ValueError(f"federation_id must be a non-empty string; got {federation_id!r}")


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
    def unit(self) -> str:
        """The enforced privacy unit, ``task`` or ``participant``."""
        ...

    @property
    def neighbouring(self) -> str:
        """The neighbouring relation every recorded round is stated for."""
        ...

    def position(self) -> int:
        """Number of records."""
        ...

    def records(self) -> list[SpendRecord]:
        """All records, oldest first."""
        ...

    def rounds(self) -> list[tuple[GaussianRound, int]]:
        """Records grouped by identical event, ``[(event, count)]``."""
        ...

    def epsilon(self, unit: str | None = None, method: str = "pld") -> float:
        """Epsilon spent so far at ``delta``."""
        ...

    def rounds_affordable(self, event: GaussianRound) -> int:
        """How many more rounds like ``event`` the budget allows."""
        ...

    def would_exceed(self, event: GaussianRound) -> bool:
        """Dry run: whether spending ``event`` now would exceed the budget."""
        ...

    def spend(self, event: GaussianRound, run_id: str, round_index: int) -> SpendRecord:
        """Record one round durably, or raise having recorded nothing."""
        ...

    def close(self) -> None:
        """Release the ledger."""
        ...


# ---------------------------------------------------------------------------- BudgetLedger


@dataclass(frozen=True)
class _Registration:
    """A federation's row: what it was registered with."""

    epsilon_budget: float
    delta: float
    unit: str
    created_at: str
    neighbouring: str | None  # None: schema 1, all add/remove


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
            outcome = self._append(event, event_json, run_id, round_index, base, total)
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


def _register(
    conn: sqlite3.Connection,
    path: Path,
    federation_id: str,
    epsilon_budget: float | None,
    delta: float | None,
    unit: str,
    neighbouring: str | None,
    create: bool,
) -> _Registration:
    """The federation's row, inserted first if it is new (and ``create`` allows it)."""
    with _immediate(conn):
        row = _registration(conn, federation_id)
        if row is not None:
            return row
        if not create or epsilon_budget is None or delta is None:
            raise LedgerError(
                f"federation {federation_id!r} is not in ledger {path}; opening a new one needs "
                "epsilon_budget and delta"
            )
        row = _Registration(
            float(epsilon_budget),
            float(delta),
            unit,
            datetime.now(UTC).isoformat(),
            neighbouring or ADD_REMOVE,
        )
        conn.execute(
            "INSERT INTO federations (federation_id, epsilon_budget, delta, unit, created_at, "
            "neighbouring) VALUES (?, ?, ?, ?, ?, ?)",
            (federation_id, row.epsilon_budget, row.delta, unit, row.created_at, row.neighbouring),
        )
        return row


def _registration(conn: sqlite3.Connection, federation_id: str) -> _Registration | None:
    columns = {str(r[1]) for r in conn.execute("PRAGMA table_info(federations)")}
    # A schema-1 ledger read without migrating (read-only) has no relation column.
    relation = "neighbouring" if "neighbouring" in columns else "NULL"
    row = conn.execute(
        f"SELECT epsilon_budget, delta, unit, created_at, {relation} FROM federations "
        "WHERE federation_id = ?",
        (federation_id,),
    ).fetchone()
    if row is None:
        return None
    return _Registration(
        float(row[0]),
        float(row[1]),
        str(row[2]),
        str(row[3]),
        None if row[4] is None else str(row[4]),
    )


def _check_registration(
    federation_id: str,
    row: _Registration,
    epsilon_budget: float | None,
    delta: float | None,
    unit: str,
    neighbouring: str | None,
) -> None:
    """A federation's budget, delta, unit and relation are fixed when it is registered."""
    for name, given, stored in (
        ("epsilon_budget", epsilon_budget, row.epsilon_budget),
        ("delta", delta, row.delta),
    ):
        if given is not None and float(given) != float(stored):
            raise LedgerError(
                f"{name} must match the value federation {federation_id!r} was registered "
                f"with ({stored}); got {given}. A budget is fixed for a federation."
            )
    if row.unit != unit and not (epsilon_budget is None and delta is None):
        raise LedgerError(
            f"unit must match the unit federation {federation_id!r} was registered with "
            f"({row.unit!r}); got {unit!r}"
        )
    stored_relation = row.neighbouring or ADD_REMOVE
    if neighbouring is not None and neighbouring != stored_relation:
        raise LedgerError(
            f"neighbouring must match the relation federation {federation_id!r} was registered "
            f"with ({stored_relation!r}); got {neighbouring!r}. A composition never mixes "
            "relations."
        )


def _verify_chain(
    path: Path, federation_id: str, start: int, prev: str, rows: Sequence[Sequence[Any]]
) -> list[SpendRecord]:
    """Verify rows ``start, start+1, ...`` against the chain ending in ``prev``; return records."""
    out: list[SpendRecord] = []
    for seq, position, run_id, round_index, event_json, created, prev_hash, digest in rows:
        where = (
            f"ledger {path}, federation {federation_id!r}, record #{position} "
            f"(row seq {seq}, run {run_id!r}, round {round_index})"
        )
        expected = start + len(out)
        if position != expected:
            raise LedgerCorrupted(f"{where}: expected record #{expected} next; a record is missing")
        if prev_hash != prev:
            raise LedgerCorrupted(f"{where}: its link to the previous record is broken")
        recomputed = _record_hash(
            federation_id, position, run_id, round_index, event_json, created, prev_hash
        )
        if recomputed != digest:
            raise LedgerCorrupted(f"{where}: its contents do not match its hash (edited)")
        try:
            event = GaussianRound.from_dict(json.loads(event_json))
        except (ValueError, TypeError, KeyError) as error:
            raise LedgerCorrupted(f"{where}: unreadable event: {error}") from error
        out.append(
            SpendRecord(federation_id, position, run_id, round_index, event, created, digest)
        )
        prev = digest
    return out


def _verify_head(
    path: Path, federation_id: str, head: Sequence[Any] | None, count: int, end: str
) -> None:
    """The head row must name the chain's last record (so truncation is seen)."""
    if head is None:
        if count:
            raise LedgerCorrupted(
                f"ledger {path}, federation {federation_id!r}: the head row is missing"
            )
        return
    if head[0] != count - 1 or head[1] != end:
        raise LedgerCorrupted(
            f"ledger {path}, federation {federation_id!r}: the head names record #{head[0]} but "
            f"the chain ends at record #{count - 1}; records were removed or the head was edited"
        )


# ------------------------------------------------------------------------ data-keyed budgets


def _check_label(label: object) -> None:
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise ValueError(
            "label must be 1-64 characters of letters, digits, '.', '_' or '-' starting with a "
            f"letter or digit (it names the federation in logs and metrics); got {label!r}"
        )


def _data_key(salt: str, data_identity: str, label: str) -> str:
    digest = hmac.new(bytes.fromhex(salt), data_identity.encode("utf-8"), hashlib.sha256)
    return f"{label}-{digest.hexdigest()[:16]}"


def _budget_federation_id(data_key: str, number: int) -> str:
    return data_key if number == 1 else f"{data_key}-b{number}"


def _actor() -> str:
    """Who starts a budget: user@host (pid), for the record."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no USER variable (containers)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def _budget_chain(
    conn: sqlite3.Connection, path: Path, ledger_id: str, data_key: str
) -> list[BudgetRecord]:
    """The verified budgets of one data key, oldest first."""
    rows = conn.execute(
        "SELECT number, federation_id, reason, actor, created_at, prev_hash, hash FROM budgets "
        "WHERE data_key = ? ORDER BY number",
        (data_key,),
    ).fetchall()
    out: list[BudgetRecord] = []
    prev = _budget_genesis(ledger_id, data_key)
    for number, fid, reason, actor, created, prev_hash, digest in rows:
        record = BudgetRecord(data_key, number, fid, reason, actor, created, digest)
        where = f"ledger {path}, budget {number} of {data_key!r}"
        if number != len(out) + 1 or fid != _budget_federation_id(data_key, number):
            raise LedgerCorrupted(f"{where}: expected budget {len(out) + 1}; a budget is missing")
        if prev_hash != prev or _budget_hash(ledger_id, record, prev_hash) != digest:
            raise LedgerCorrupted(f"{where}: its contents or link do not match its hash (edited)")
        out.append(record)
        prev = digest
    return out


def _append_budget(
    conn: sqlite3.Connection,
    ledger_id: str,
    data_key: str,
    chain: Sequence[BudgetRecord],
    reason: str,
    actor: str,
) -> BudgetRecord:
    """Insert the next budget of ``data_key`` (inside the caller's write transaction)."""
    number = len(chain) + 1
    unsigned = BudgetRecord(
        data_key,
        number,
        _budget_federation_id(data_key, number),
        reason,
        actor,
        datetime.now(UTC).isoformat(),
        "",
    )
    prev = chain[-1].hash if chain else _budget_genesis(ledger_id, data_key)
    record = replace(unsigned, hash=_budget_hash(ledger_id, unsigned, prev))
    conn.execute(
        "INSERT INTO budgets (data_key, number, federation_id, reason, actor, created_at, "
        "prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            data_key,
            number,
            record.federation_id,
            reason,
            actor,
            record.created_at,
            prev,
            record.hash,
        ),
    )
    return record


def resolve_federation(
    path: str | Path,
    data_identity: str,
    *,
    label: str,
    create: bool = True,
    mode: LedgerMode = "secure",
) -> str:
    """The federation id of the *current budget* for the data named by ``data_identity``.

    The id is ``f"{label}-{HMAC-SHA256(salt, data_identity)[:16 hex]}"`` (``-b2``, ``-b3``, ...
    for later budgets, see ``start_new_budget``), with a random salt kept in the ledger: it does
    not reveal the data, not even whether two neighbouring data sets were used. (A deterministic
    hash of private data, released in logs and metrics, would.) The ledger file must therefore be
    kept as private as the server's checkpoints. ``create=True`` creates the ledger and the first
    budget when missing (recorded, with who and when); ``create=False`` only reads.
    """
    if not isinstance(data_identity, str) or not data_identity:
        raise ValueError(f"data_identity must be a non-empty string; got {data_identity!r}")
    _check_label(label)
    _check_mode(mode)
    path = _abs(path)
    if not create:
        return _resolve_readonly(path, data_identity, label)
    conn = _connect_writable(path, create=True)
    try:
        meta = _ensure_schema(conn, path, mode)
        key = _data_key(meta["salt"], data_identity, label)
        with _immediate(conn):
            chain = _budget_chain(conn, path, meta["ledger_id"], key)
            if not chain:
                chain = [
                    _append_budget(conn, meta["ledger_id"], key, (), FIRST_BUDGET_REASON, _actor())
                ]
        return chain[-1].federation_id
    except sqlite3.Error as error:
        raise _classify(path, error) from error
    finally:
        conn.close()


def _resolve_readonly(path: Path, data_identity: str, label: str) -> str:
    conn = _connect_readonly(path)
    try:
        with _reading(conn):
            meta = _read_meta(conn)
            if "salt" not in meta:
                raise LedgerError(
                    f"ledger {path} has no budgets (legacy, no id: written by an older fedmeta)"
                )
            key = _data_key(meta["salt"], data_identity, label)
            chain = _budget_chain(conn, path, meta["ledger_id"], key)
    except sqlite3.Error as error:
        raise _classify(path, error) from error
    finally:
        conn.close()
    if not chain:
        raise LedgerError(
            f"ledger {path} has no budget for this data under label {label!r}; resolve with "
            "create=True (a run) to start one"
        )
    return chain[-1].federation_id


def start_new_budget(
    path: str | Path, federation_id: str, reason: str, *, who: str | None = None
) -> str:
    """Start a new budget for the data whose *current* budget is ``federation_id``; return its id.

    An explicit, recorded act (who, when, why; hash-chained and append-only): afterwards
    ``resolve_federation`` returns the new id and runs spend from a fresh budget. The old
    federation and its spends stay in the ledger. ``federation_id`` must be the current budget
    (two operators cannot both start "the next" one).
    """
    _check_federation_id(federation_id)
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"reason must be a non-empty text saying why; got {reason!r}")
    if who is not None and (not isinstance(who, str) or not who.strip()):
        raise ValueError(f"who must be a non-empty string or None; got {who!r}")
    path = _abs(path)
    conn = _connect_writable(path, create=False)
    try:
        meta = _ensure_schema(conn, path, None)
        with _immediate(conn):
            row = conn.execute(
                "SELECT data_key FROM budgets WHERE federation_id = ?", (federation_id,)
            ).fetchone()
            if row is None:
                raise LedgerError(
                    f"federation {federation_id!r} has no budget record in {path}: new budgets "
                    "apply to data-keyed federations (named by resolve_federation)"
                )
            chain = _budget_chain(conn, path, meta["ledger_id"], str(row[0]))
            if chain[-1].federation_id != federation_id:
                raise LedgerError(
                    f"federation {federation_id!r} is not the current budget of its data; the "
                    f"current one is {chain[-1].federation_id!r}: start a new budget from it"
                )
            record = _append_budget(
                conn, meta["ledger_id"], str(row[0]), chain, reason.strip(), who or _actor()
            )
        return record.federation_id
    except sqlite3.Error as error:
        raise _classify(path, error) from error
    finally:
        conn.close()


def budgets(path: str | Path) -> list[BudgetRecord]:
    """Every budget recorded in the ledger at ``path``, by data key then number (read-only)."""
    path = _abs(path)
    conn = _connect_readonly(path)
    try:
        with _reading(conn):
            meta = _read_meta(conn)
            if "ledger_id" not in meta:
                return []
            keys = [str(r[0]) for r in conn.execute("SELECT DISTINCT data_key FROM budgets")]
            return [
                record
                for key in sorted(keys)
                for record in _budget_chain(conn, path, meta["ledger_id"], key)
            ]
    except sqlite3.Error as error:
        raise _classify(path, error) from error
    finally:
        conn.close()


# ---------------------------------------------------------------------------------- backup


def _heads(path: Path) -> tuple[LedgerInfo, dict[str, tuple[int, str | None]]]:
    """Open every federation read-only (verifying its chain); return (info, position and head)."""
    info = BudgetLedger.describe(path)
    heads: dict[str, tuple[int, str | None]] = {}
    for fid in info.federations:
        with BudgetLedger.open_readonly(path, fid) as ledger:
            cp = ledger.checkpoint()
            heads[fid] = (cp.position, cp.head)
    return info, heads


def _contains(
    path: Path, older: Mapping[str, tuple[int, str | None]], *, this: str, other: str
) -> str | None:
    """``None`` if the ledger at ``path`` (``this``) holds every record of ``older`` (``other``)."""
    for fid, (position, head) in older.items():
        try:
            ledger = BudgetLedger.open_readonly(path, fid)
        except LedgerUnreadable:
            raise
        except LedgerError:
            return f"federation {fid!r} is in {other}, not in {this}"
        with ledger:
            records = ledger.records()
        if len(records) < position:
            return f"federation {fid!r} has {len(records)} records in {this}, {position} in {other}"
        if position and records[position - 1].hash != head:
            return f"federation {fid!r} has another history in {this} than in {other}"
    return None


def _check_destination(src_info: LedgerInfo, copy: Path, dest: Path, force: bool) -> None:
    """Refuse to overwrite a ledger holding spends ``copy`` lacks (unless ``force``)."""
    for suffix in ("-journal", "-wal"):
        side = _sidecar(dest, suffix)
        if side.exists() and not force:
            raise LedgerError(
                f"{side} exists: a writer has {dest} open or died mid-commit; open {dest} "
                "writable once (or stop its writer) and retry, or pass --force to discard it"
            )
    if not dest.exists() or force:
        return
    try:
        dest_info, dest_heads = _heads(dest)
    except LedgerUnreadable as error:
        raise LedgerError(
            f"{dest} exists and cannot be read ({error.reason}); replacing it would forget "
            "whatever it holds: pass --force if that is intended"
        ) from error
    if dest_info.ledger_id != src_info.ledger_id:
        raise LedgerError(
            f"{dest} is another ledger ({dest_info.ledger_id or 'legacy, no id'}, not "
            f"{src_info.ledger_id or 'legacy, no id'}); pass --force to replace it"
        )
    missing = _contains(copy, dest_heads, this="the copy", other=str(dest))
    if missing is not None:
        raise LedgerError(
            f"{dest} holds spends the source lacks ({missing}): restoring would forget privacy "
            "loss that happened; pass --force only if you know why"
        )


def backup(src: str | Path, dest: str | Path, *, force: bool = False) -> BackupResult:
    """Copy the ledger at ``src`` to ``dest`` consistently, atomically and verified.

    Uses SQLite's online backup API (a consistent snapshot even while runs spend), writes a
    temporary file beside ``dest``, fsyncs it, verifies every federation's chain in it, renames it
    over ``dest`` and verifies again by reopening. Restoring is the same call with the roles
    swapped; it refuses to replace a ledger that holds spends the backup lacks unless ``force``.
    """
    src_path, dest_path = _abs(src), _abs(dest)
    if dest_path == src_path:
        raise ValueError(f"--to must differ from --db; both are {src_path}")
    if not dest_path.parent.is_dir():
        raise ValueError(f"--to must be in an existing directory; {dest_path.parent} is not one")
    src_info, src_heads = _heads(src_path)
    tmp = dest_path.with_name(f".{dest_path.name}.backup-{uuid.uuid4().hex}")
    try:
        _copy(src_path, tmp)
        missing = _contains(tmp, src_heads, this="the copy", other=str(src_path))
        if missing is not None:
            raise LedgerError(f"the backup does not verify ({missing}); {dest_path} left alone")
        _, tmp_heads = _heads(tmp)
        _check_destination(src_info, tmp, dest_path, force)
        for suffix in ("-journal", "-wal", "-shm"):
            _sidecar(dest_path, suffix).unlink(missing_ok=True)  # only reached with force
        os.replace(tmp, dest_path)
        _fsync_dir(dest_path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if _contains(dest_path, tmp_heads, this=str(dest_path), other="the copy") is not None:
        raise LedgerError(f"{dest_path} does not verify after the rename")
    return BackupResult(dest_path, src_info.ledger_id, {f: p for f, (p, _) in tmp_heads.items()})


def _copy(src: Path, tmp: Path) -> None:
    source = _connect_readonly(src)
    target = sqlite3.connect(str(tmp), isolation_level=None)
    try:
        source.backup(target)
        # A schema-1 source was in WAL mode; the copy must read anywhere, without side files.
        target.execute("PRAGMA journal_mode = DELETE")
    except sqlite3.Error as error:
        raise _classify(src, error) from error
    finally:
        target.close()
        source.close()
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- transactions


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


@contextmanager
def _reading(conn: sqlite3.Connection) -> Iterator[None]:
    """One read transaction (a consistent snapshot), unless one is already open."""
    if conn.in_transaction:
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")
