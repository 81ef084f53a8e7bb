"""Cohorts and participants on disk: who each recorded round could have sampled.

A participant is named in the ledger by ``HMAC-SHA256(salt, identity)`` (32 hex digits), with the
ledger's secret salt, like a federation id: the key is stable for a stable identity (the data set's
declared identity plus the participant's index in simulation, the node's registered key in a
deployment) and reveals nothing by itself. The name the participant registered under and each
content digest of its data are kept beside the key for the operator (``fedmeta ledger show
--participants``); a new digest is an edit of that participant's data, which the add/remove
relation covers task by task, so it is reported, never a new budget.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sqlite3
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

from fedmeta.accounting.ledger.chain import cohort_id
from fedmeta.accounting.ledger.records import LedgerCorrupted, LedgerError, Participant
from fedmeta.accounting.ledger.storage import PER_PARTICIPANT, column_or_null, table_names
from fedmeta.accounting.schemes import Neighbouring
from fedmeta.accounting.tuning_release import Recorded


def participant_key(salt: str, identity: str) -> str:
    """The ledger's name for a participant's data: keyed, so it reveals nothing by itself."""
    digest = hmac.new(bytes.fromhex(salt), b"participant\n" + identity.encode(), hashlib.sha256)
    return digest.hexdigest()[:32]


def coarse_day() -> str:
    """Today's date (UTC): the only time kept beside participants (no sub-round time)."""
    return datetime.now(UTC).date().isoformat()


def record_cohort(
    conn: sqlite3.Connection,
    federation_id: str,
    salt: str,
    participants: Sequence[Participant],
) -> tuple[str, frozenset[str]]:
    """Insert the cohort and its participants if new (inside the caller's write transaction)."""
    keys = {participant_key(salt, p.identity): p for p in participants}
    members = sorted(keys)
    cid = cohort_id(federation_id, members)
    day = coarse_day()
    conn.execute(
        "INSERT OR IGNORE INTO cohorts (cohort_id, federation_id, members, created_at) "
        "VALUES (?, ?, ?, ?)",
        (cid, federation_id, json.dumps(members), day),
    )
    conn.executemany(
        "INSERT OR IGNORE INTO participants (federation_id, participant, name, digest, created_at)"
        " VALUES (?, ?, ?, ?, ?)",
        [(federation_id, k, p.name, p.digest, day) for k, p in sorted(keys.items())],
    )
    return cid, frozenset(members)


def load_cohorts(
    conn: sqlite3.Connection, path: Path, federation_id: str, known: Mapping[str, object]
) -> dict[str, frozenset[str]]:
    """The federation's cohorts not in ``known``, each verified against its id (hash)."""
    if "cohorts" not in table_names(conn):
        return {}
    out: dict[str, frozenset[str]] = {}
    rows = conn.execute(
        "SELECT cohort_id, members FROM cohorts WHERE federation_id = ?", (federation_id,)
    )
    for cid, members_json in rows:
        if cid in known:
            continue
        members = json.loads(members_json)
        if cohort_id(federation_id, members) != cid:
            raise LedgerCorrupted(
                f"ledger {path}, federation {federation_id!r}: cohort {cid[:12]}... does not match "
                "its members (edited)"
            )
        out[str(cid)] = frozenset(str(m) for m in members)
    return out


def participant_rows(conn: sqlite3.Connection, federation_id: str) -> dict[str, list[str]]:
    """Participant key -> [name, digest, digest, ...] (first name; digests oldest first)."""
    out: dict[str, list[str]] = {}
    if column_or_null(conn, "participants", "name") == "NULL":
        return out
    rows = conn.execute(
        "SELECT participant, name, digest FROM participants WHERE federation_id = ? ORDER BY rowid",
        (federation_id,),
    )
    for key, name, digest in rows:
        out.setdefault(str(key), [str(name)]).append(str(digest))
    return out


def _budget_row(conn: sqlite3.Connection, federation_id: str) -> tuple[str, int, int] | None:
    row = conn.execute(
        "SELECT data_key, number, seq FROM budgets WHERE federation_id = ?", (federation_id,)
    ).fetchone()
    return None if row is None else (str(row[0]), int(row[1]), int(row[2]))


def label_of(data_key: str) -> str:
    """The label part of ``label-<16 hex>``."""
    return data_key.rsplit("-", 1)[0]


def carried_federations(
    conn: sqlite3.Connection, meta: Mapping[str, str], federation_id: str
) -> list[str]:
    """Legacy federations whose spends count against every participant of ``federation_id``.

    Only the first per-participant budget of a label inherits them: a deliberate new budget
    (``fedmeta ledger new-budget``) starts afresh, as it always did.
    """
    if PER_PARTICIPANT not in meta:  # not migrated (read-only): no per-participant budgets yet
        return []
    budget = _budget_row(conn, federation_id)
    if budget is None:
        return []
    data_key, number, seq = budget
    if number != 1 or seq <= int(meta[PER_PARTICIPANT]):
        return []
    if column_or_null(conn, "carried", "label") == "NULL":
        return []
    rows = conn.execute(
        "SELECT federation_id FROM carried WHERE label = ? ORDER BY federation_id",
        (label_of(data_key),),
    )
    return [str(r[0]) for r in rows]


def legacy_uncarried(
    conn: sqlite3.Connection, meta: Mapping[str, str], label: str | None
) -> list[str]:
    """Current budgets keyed by the whole data set (schema 2) with spends, not yet carried."""
    since = int(meta.get(PER_PARTICIPANT, "0"))
    rows = conn.execute(
        "SELECT b.data_key, b.federation_id FROM budgets b WHERE b.seq <= ? AND b.number = "
        "(SELECT MAX(number) FROM budgets c WHERE c.data_key = b.data_key) AND EXISTS "
        "(SELECT 1 FROM spends s WHERE s.federation_id = b.federation_id) AND NOT EXISTS "
        "(SELECT 1 FROM carried k WHERE k.federation_id = b.federation_id) ORDER BY b.seq",
        (since,),
    )
    return [str(fid) for key, fid in rows if label is None or label_of(str(key)) == label]


def check_carried_relation(
    path: Path, federation_id: str, neighbouring: Neighbouring, carried: Counter[Recorded]
) -> None:
    """A composition never mixes relations: carried rounds must share the federation's."""
    for event in carried:
        if event.neighbouring != neighbouring:
            raise LedgerError(
                f"ledger {path}: federation {federation_id!r} composes {neighbouring!r} rounds, "
                f"but spends carried from a schema-2 budget are {event.neighbouring!r}; start a "
                "separate ledger file for this relation"
            )
