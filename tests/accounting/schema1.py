"""Write a ledger exactly as fedmeta wrote it before ledgers had an identity (schema 1).

Schema 1: WAL journal, no ``meta`` or ``budgets`` table, no relation column; records hash-chained
from the federation's row as today. Used to test that such ledgers still open (and are migrated by
the first writable open). The SQL is the schema-1 module's, verbatim.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from fedmeta.accounting.ledger import genesis_hash, record_hash
from fedmeta.accounting.schemes import GaussianRound

SCHEMA1 = """
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


def write_schema1_ledger(
    path: Path,
    federation_id: str,
    event: GaussianRound,
    count: int,
    *,
    budget: float = 3.0,
    delta: float = 1e-6,
    keep_open: bool = False,
) -> sqlite3.Connection | None:
    """Write ``count`` records of ``event``; with ``keep_open`` the records stay in ``-wal``.

    ``keep_open=True`` returns the open connection: the state a schema-1 writer killed with
    SIGKILL leaves behind (every record in ``PATH-wal``, the main file a bare first page).
    """
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")  # as after a kill: nothing checkpointed yet
    conn.executescript(SCHEMA1)
    created = "2026-01-01T00:00:00+00:00"
    conn.execute(
        "INSERT INTO federations VALUES (?, ?, ?, ?, ?)",
        (federation_id, budget, delta, "task", created),
    )
    prev = genesis_hash(federation_id, budget, delta, "task", created, None)
    data = event.to_dict()
    data.pop("neighbouring")  # schema-1 records predate the relation (all add/remove)
    event_json = json.dumps(data, sort_keys=True, separators=(",", ":"))
    for position in range(count):
        digest = record_hash(
            federation_id, position, "old-run", position, event_json, created, prev
        )
        conn.execute(
            "INSERT INTO spends (federation_id, position, run_id, round_index, event, created_at, "
            "prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (federation_id, position, "old-run", position, event_json, created, prev, digest),
        )
        conn.execute(
            "INSERT INTO heads VALUES (?, ?, ?) ON CONFLICT(federation_id) DO UPDATE SET "
            "position = excluded.position, hash = excluded.hash",
            (federation_id, position, digest),
        )
        prev = digest
    if keep_open:
        return conn
    conn.close()  # the last connection checkpoints and removes -wal, as a clean schema-1 exit did
    return None
