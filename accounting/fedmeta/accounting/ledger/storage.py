"""Storage: the SQLite file, its schema and migration, connections, transactions, federations."""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from fedmeta.accounting.ledger.faults import LOW_SPACE_BYTES, free_bytes, unwritable
from fedmeta.accounting.ledger.records import (
    BUSY_TIMEOUT_S,
    LEDGER_MODES,
    SCHEMA_VERSION,
    SWITCH_TIMEOUT_S,
    LedgerCorrupted,
    LedgerError,
    LedgerMissing,
    LedgerMode,
    LedgerReadOnly,
    LedgerUnreadable,
    NotALedger,
    stored_choice,
)
from fedmeta.accounting.randomness import SystemRandomSource
from fedmeta.accounting.schemes import (
    NEIGHBOURING_RELATIONS,
)

_SQLITE_MAGIC = b"SQLite format 3\x00"
_LEDGER_TABLES = frozenset({"federations", "spends", "heads"})

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
    # Schema 3: per-participant budgets. A cohort is the set of participants a round could have
    # sampled (its id hashes its members, so it cannot be edited unseen).
    """CREATE TABLE IF NOT EXISTS cohorts (
        cohort_id      TEXT PRIMARY KEY,
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        members        TEXT NOT NULL,
        created_at     TEXT NOT NULL
    )""",
    # Who a participant key is, for the operator (name as registered), and each content digest
    # its data had: a new digest is an edit of its data, reported, never a new budget.
    """CREATE TABLE IF NOT EXISTS participants (
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        participant    TEXT NOT NULL,
        name           TEXT NOT NULL,
        digest         TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        UNIQUE (federation_id, participant, digest)
    )""",
    # Budgets keyed by the whole data set (schema 2) whose spends are charged to every
    # participant of the per-participant budgets of the same label (``fedmeta ledger migrate``).
    """CREATE TABLE IF NOT EXISTS carried (
        federation_id  TEXT PRIMARY KEY REFERENCES federations(federation_id),
        label          TEXT NOT NULL,
        actor          TEXT NOT NULL,
        created_at     TEXT NOT NULL
    )""",
    # Deliberately accepted rollbacks (``fedmeta ledger accept-rollback``): which anchor (a
    # ledger id and the hash of its last spend) the ledger may be behind, why, who, which day.
    """CREATE TABLE IF NOT EXISTS rollbacks (
        seq               INTEGER PRIMARY KEY AUTOINCREMENT,
        anchor_ledger_id  TEXT NOT NULL,
        anchor_head       TEXT NOT NULL,
        found             TEXT NOT NULL,
        reason            TEXT NOT NULL,
        actor             TEXT NOT NULL,
        created_at        TEXT NOT NULL
    )""",
    # Public data a run used (ledger/public.py): declared, spends nothing. Added without a schema
    # bump: an older fedmeta ignores the table, a newer one reads none from an older ledger.
    """CREATE TABLE IF NOT EXISTS public_data (
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        run_id         TEXT NOT NULL,
        declaration    TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        UNIQUE (federation_id, run_id, declaration)
    )""",
    # Rounds a run in progress may still charge, read by runs that start later (ledger/
    # reservations.py); an end row ends one. Added without a schema bump, as public_data.
    """CREATE TABLE IF NOT EXISTS reservations (
        seq            INTEGER PRIMARY KEY AUTOINCREMENT,
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        run_id         TEXT NOT NULL,
        cohort_id      TEXT,
        event          TEXT,
        rounds         INTEGER NOT NULL,
        position       INTEGER NOT NULL,
        created_at     TEXT NOT NULL
    )""",
    *(
        f"CREATE TRIGGER IF NOT EXISTS {table}_append_only_{op.lower()} BEFORE {op} ON {table} "
        "BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END"
        for table in ("spends", "federations", "budgets", "meta", "cohorts", "participants",
                      "carried", "rollbacks", "public_data", "reservations")
        for op in ("UPDATE", "DELETE")
    ),
)  # fmt: skip


# -------------------------------------------------------------------------------- connections


def absolute_path(path: str | Path) -> Path:
    """The absolute, symlink-resolved path (what a run records and a resume compares)."""
    return Path(path).expanduser().resolve()


def sidecar(path: Path, suffix: str) -> Path:
    """The file named ``path`` plus ``suffix`` beside it (SQLite's ``-journal``, ``-wal``)."""
    return path.with_name(path.name + suffix)


def file_identity(path: Path) -> tuple[int, int] | None:
    """``(device, inode)`` of ``path``, None when it is gone: a replaced file has another."""
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


def classify_error(path: Path, error: sqlite3.Error) -> LedgerError:
    """Turn a SQLite error met while opening, reading or writing into a one-line ledger error."""
    code = getattr(error, "sqlite_errorcode", 0) & 0xFF
    if code == 13:  # SQLITE_FULL
        return unwritable(path, "full")
    free = free_bytes(path.parent)
    if code == 10 and free is not None and free < LOW_SPACE_BYTES:  # SQLITE_IOERR, disk full
        return unwritable(path, "full")
    if code == 14 and not os.access(path.parent, os.W_OK):  # SQLITE_CANTOPEN: no journal here
        return unwritable(path, "readonly")
    if code == 26:  # SQLITE_NOTADB
        return NotALedger(f"{path} is not a SQLite database ({error})", reason="not_sqlite")
    if code in (5, 6):  # SQLITE_BUSY, SQLITE_LOCKED
        return LedgerUnreadable(f"ledger {path} stayed locked: {error}", reason="busy")
    if code == 8 and sidecar(path, "-journal").exists():  # SQLITE_READONLY (hot journal)
        return LedgerUnreadable(
            f"ledger {path}: a writer died in the middle of a commit ({path.name}-journal "
            "exists); the next writable open rolls it back, a read-only one cannot",
            reason="hot_journal",
        )
    if code == 8:  # SQLITE_READONLY without a hot journal: a writer on a read-only file or mount
        return unwritable(path, "readonly")
    if code == 11:  # SQLITE_CORRUPT
        return LedgerCorrupted(f"ledger {path} is corrupted: {error}")
    return LedgerUnreadable(f"cannot open the ledger {path}: {error}")


def table_names(conn: sqlite3.Connection) -> set[str]:
    """The tables the file holds (a ledger written before a table was added lacks it)."""
    return {str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _not_a_ledger(path: Path, header: bytes) -> NotALedger:
    hint = ""
    if header[18:20] == b"\x02\x02":
        hint = (
            " (in WAL mode: if it is a copy of a ledger written by an older fedmeta, its records "
            f"were in {path.name}-wal, which was not copied with it)"
        )
    return NotALedger(f"{path} is a SQLite database but not a fedmeta ledger{hint}")


@contextmanager
def closed_on_error(conn: sqlite3.Connection, path: Path) -> Iterator[None]:
    """Close ``conn`` if the block raises; a SQLite error becomes the one-line ledger error."""
    try:
        yield
    except sqlite3.Error as error:
        conn.close()
        raise classify_error(path, error) from error
    except BaseException:
        conn.close()
        raise


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A connection that writes nothing: ``mode=ro``, no pragma that changes the file."""
    header = _read_header(path)
    if not header:
        raise NotALedger(f"{path} is an empty file, not a fedmeta ledger")
    _check_sqlite_header(path, header)
    params = {"mode": "ro"}
    if header[18:20] == b"\x02\x02":  # a schema-1 ledger still in WAL mode
        wal = sidecar(path, "-wal")
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
        raise classify_error(path, error) from error
    with closed_on_error(conn, path):
        if not _LEDGER_TABLES <= table_names(conn):
            raise _not_a_ledger(path, header)
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
                "mount); make it writable, or move this ledger whole (`fedmeta ledger backup`) "
                "and point privacy.ledger_path at the copy; reading works with open_readonly"
            )


def connect_writable(path: Path, *, create: bool) -> sqlite3.Connection:
    """A writer's connection: rollback journal, ``synchronous=EXTRA``, integrity checked."""
    _check_writable_location(path, create=create)
    try:
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    with closed_on_error(conn, path):
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        _use_rollback_journal(conn, path)
        # EXTRA: also fsync the directory after deleting the journal (the commit point), so a
        # returned spend survives power loss, not only a killed process.
        conn.execute("PRAGMA synchronous = EXTRA")
        conn.execute("PRAGMA foreign_keys = ON")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise LedgerCorrupted(f"ledger {path} failed SQLite's integrity check: {check}")
    return conn


def _use_rollback_journal(conn: sqlite3.Connection, path: Path) -> None:
    """Switch a schema-1 (WAL) ledger to the rollback journal; a no-op for schema 2."""
    mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    if mode == "delete":
        return
    # The switch needs every other connection closed; do not wait the spend's full minute for it.
    conn.execute(f"PRAGMA busy_timeout = {int(SWITCH_TIMEOUT_S * 1000)}")
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


def read_meta(conn: sqlite3.Connection) -> dict[str, str]:
    """The ``meta`` table (ledger id, schema, mode, salt) as a dict."""
    if "meta" not in table_names(conn):
        return {}
    return {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}


def stored_mode(path: Path, meta: Mapping[str, str]) -> LedgerMode | None:
    """The meta table's mode, checked; ``None`` for a schema-1 ledger, which recorded none."""
    mode = meta.get("mode")
    return None if mode is None else stored_choice(f"ledger {path}", "mode", mode, LEDGER_MODES)


def ensure_schema(conn: sqlite3.Connection, path: Path, mode: LedgerMode | None) -> dict[str, str]:
    """Create or migrate the schema and the identity; check the mode. Returns the meta table.

    A schema-1 ledger (no meta table) gets its identity here, in the mode of the first writable
    open that meets it: schema 1 recorded no mode. ``mode=None`` checks nothing and refuses to
    create an identity (the caller is not a run).
    """
    with immediate_transaction(conn):
        tables = table_names(conn)
        if tables - {"sqlite_sequence"} and not _LEDGER_TABLES <= tables:
            raise NotALedger(
                f"{path} is a SQLite database but not a fedmeta ledger; refusing to add ledger "
                "tables to it"
            )
        for statement in _CREATE:
            conn.execute(statement)
        _add_columns(conn)
        meta = read_meta(conn)
        if not meta:
            if mode is None:
                raise LedgerError(
                    f"ledger {path} has no identity yet (written by an older fedmeta); open it "
                    "once with BudgetLedger.open (any run does) to add one"
                )
            meta = _new_meta(mode, migrated="spends" in tables)
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", sorted(meta.items()))
        if PER_PARTICIPANT not in meta:
            meta = {**meta, PER_PARTICIPANT: _per_participant_since(conn)}
            conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (PER_PARTICIPANT,
                         meta[PER_PARTICIPANT]))  # fmt: skip
    if mode is not None and meta["mode"] != mode:
        raise LedgerError(
            f"mode must match the ledger's: {path} is a {meta['mode']!r} ledger, opened with mode "
            f"{mode!r}; reproducible test noise (insecure) is not private, so test runs and "
            "secure runs never share a ledger: use another ledger file"
        )
    return meta


#: Meta key: budgets numbered up to this ``budgets.seq`` were keyed by the whole data set (schema
#: 2); later ones by the data set's declared identity, with per-participant composition.
PER_PARTICIPANT = "per_participant_budgets_after_seq"


def _per_participant_since(conn: sqlite3.Connection) -> str:
    return str(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM budgets").fetchone()[0])


def _add_columns(conn: sqlite3.Connection) -> None:
    """Additive migrations: schema 1 had no relation, schema 2 no cohort on a spend."""
    for table, column in (("federations", "neighbouring"), ("spends", "cohort")):
        columns = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}
        if column not in columns:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")


def column_or_null(conn: sqlite3.Connection, table: str, column: str) -> str:
    """``column`` if the table has it, else ``NULL`` (an older ledger read without migrating)."""
    columns = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}
    return column if column in columns else "NULL"


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


def check_mode(mode: object) -> None:
    """Refuse a ledger mode other than ``secure`` or ``insecure``."""
    if mode not in LEDGER_MODES:
        raise ValueError(f"mode must be one of {LEDGER_MODES}; got {mode!r}")


def check_neighbouring(neighbouring: object) -> None:
    """Refuse a neighbouring relation the accountant does not know."""
    if neighbouring is not None and neighbouring not in NEIGHBOURING_RELATIONS:
        raise ValueError(
            f"neighbouring must be one of {NEIGHBOURING_RELATIONS}; got {neighbouring!r}"
        )


def check_federation_id(federation_id: object) -> None:
    """Refuse an empty or non-string federation id."""
    if not isinstance(federation_id, str) or not federation_id:
        raise ValueError(f"federation_id must be a non-empty string; got {federation_id!r}")


# ---------------------------------------------------------------------------- BudgetLedger


# ----------------------------------------------------------------------------- transactions


@contextmanager
def immediate_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """Run a write transaction taken up front (BEGIN IMMEDIATE), rolled back on any error.

    A failed COMMIT (a full disk) is rolled back too, so the connection never stays inside a
    half-done transaction.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back what is still open, without hiding the error that caused it.

    After SQLITE_FULL, SQLITE_IOERR or SQLITE_NOMEM SQLite may already have rolled the transaction
    back itself; a ROLLBACK then fails with "no transaction is active", and raising that would
    replace the real cause (a full disk) by an internal-looking one (issue 21).
    """
    if not conn.in_transaction:
        return
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # the caller re-raises the original error; the connection is closed after it


@contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One read transaction (a consistent snapshot), unless one is already open."""
    if conn.in_transaction:
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")
