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

Layout (issue 20): ``records`` (constants, errors, frozen records), ``chain`` (hashing and
verification), ``storage`` (the SQLite file: schema, migration, connections, transactions),
``registration`` (a federation's fixed terms), ``protocol`` (``Ledger``), ``budget``
(``BudgetLedger``: the budget rules), ``operations`` (operator commands on data-keyed budgets) and
``backup`` (the verified copy). Everything public is re-exported here, so
``from fedmeta.accounting.ledger import X`` is the one import path.
"""

from __future__ import annotations

from fedmeta.accounting.calibration import affordable_rounds
from fedmeta.accounting.ledger.allowance import allowance
from fedmeta.accounting.ledger.anchor import LedgerRolledBack, check_rollback
from fedmeta.accounting.ledger.backup import backup
from fedmeta.accounting.ledger.budget import BudgetLedger
from fedmeta.accounting.ledger.chain import (
    genesis_hash,
    record_hash,
)
from fedmeta.accounting.ledger.epsilon_cache import EpsilonCache
from fedmeta.accounting.ledger.faults import ensure_directory
from fedmeta.accounting.ledger.operations import (
    BudgetTerms,
    accept_rollback,
    budgets,
    current_budget,
    migrate_to_participants,
    resolve_federation,
    start_new_budget,
)
from fedmeta.accounting.ledger.overlap import DataItems, ledger_holds
from fedmeta.accounting.ledger.participants import multiset
from fedmeta.accounting.ledger.projection import Exposures, SpendProjection
from fedmeta.accounting.ledger.protocol import (
    Ledger,
)
from fedmeta.accounting.ledger.public import PublicDataRecord, PublicDataUse
from fedmeta.accounting.ledger.records import (
    BUSY_TIMEOUT_S,
    FIRST_BUDGET_REASON,
    LEDGER_MODES,
    SCHEMA_VERSION,
    SPEND_ATTEMPTS,
    UNREADABLE_REASONS,
    BackupResult,
    BudgetExhausted,
    BudgetRecord,
    LedgerCheckpoint,
    LedgerCorrupted,
    LedgerError,
    LedgerInfo,
    LedgerMissing,
    LedgerMode,
    LedgerReadOnly,
    LedgerReplaced,
    LedgerUnreadable,
    LedgerUnwritable,
    LevelMismatch,
    NotALedger,
    Participant,
    ParticipantExposure,
    SpendRecord,
)
from fedmeta.accounting.ledger.reservations import Hold, Reservation, end_run_reservation

__all__ = [
    "BUSY_TIMEOUT_S",
    "BackupResult",
    "BudgetExhausted",
    "LevelMismatch",
    "BudgetLedger",
    "BudgetRecord",
    "BudgetTerms",
    "EpsilonCache",
    "Exposures",
    "allowance",
    "multiset",
    "FIRST_BUDGET_REASON",
    "LEDGER_MODES",
    "Ledger",
    "LedgerCheckpoint",
    "LedgerCorrupted",
    "LedgerError",
    "LedgerInfo",
    "LedgerMissing",
    "LedgerMode",
    "LedgerReadOnly",
    "LedgerReplaced",
    "LedgerRolledBack",
    "LedgerUnreadable",
    "LedgerUnwritable",
    "NotALedger",
    "DataItems",
    "Participant",
    "ParticipantExposure",
    "PublicDataRecord",
    "PublicDataUse",
    "Hold",
    "Reservation",
    "end_run_reservation",
    "SCHEMA_VERSION",
    "SPEND_ATTEMPTS",
    "SpendProjection",
    "SpendRecord",
    "UNREADABLE_REASONS",
    "genesis_hash",
    "record_hash",
    "affordable_rounds",
    "accept_rollback",
    "backup",
    "budgets",
    "check_rollback",
    "current_budget",
    "ledger_holds",
    "ensure_directory",
    "migrate_to_participants",
    "resolve_federation",
    "start_new_budget",
]
