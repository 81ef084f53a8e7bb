"""The hash chain: canonical hashing of records and budgets, and their verification."""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
import os
import socket
import sqlite3
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedmeta.accounting.ledger.records import (
    BudgetRecord,
    LedgerCorrupted,
    SpendRecord,
)
from fedmeta.accounting.schemes import (
    Neighbouring,
    Unit,
)
from fedmeta.accounting.tuning_release import recorded_from_dict

# ------------------------------------------------------------------------------------ hashing


def canonical_json(data: Any) -> str:
    """The one JSON spelling every hash is taken over (sorted keys, no spaces, no NaN)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def genesis_hash(
    federation_id: str,
    budget: float,
    delta: float,
    unit: Unit,
    created: str,
    neighbouring: Neighbouring | None,
) -> str:
    """The hash a federation's first record chains to (its own row)."""
    data: dict[str, Any] = {
        "federation_id": federation_id,
        "epsilon_budget": budget,
        "delta": delta,
        "unit": unit,
        "created_at": created,
    }
    if neighbouring is not None:  # schema-1 federations recorded no relation (all add/remove)
        data["neighbouring"] = neighbouring
    return _sha256(canonical_json(data))


def record_hash(
    federation_id: str,
    position: int,
    run_id: str,
    round_index: int,
    event_json: str,
    created_at: str,
    prev_hash: str,
    cohort: str | None = None,
) -> str:
    """The hash of one spend record, chained to ``prev_hash``."""
    data: dict[str, Any] = {
        "federation_id": federation_id,
        "position": position,
        "run_id": run_id,
        "round_index": round_index,
        "event": event_json,
        "created_at": created_at,
        "prev_hash": prev_hash,
    }
    if cohort is not None:  # records before per-participant budgets named no cohort
        data["cohort"] = cohort
    return _sha256(canonical_json(data))


def cohort_id(federation_id: str, members: Sequence[str]) -> str:
    """The id of a cohort: a hash of its federation and sorted members (so it cannot be edited)."""
    return _sha256(canonical_json({"federation_id": federation_id, "members": sorted(members)}))


def _budget_hash(ledger_id: str, record: BudgetRecord, prev_hash: str) -> str:
    return _sha256(
        canonical_json(
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
    return _sha256(canonical_json({"ledger_id": ledger_id, "data_key": data_key}))


def verify_chain(
    path: Path, federation_id: str, start: int, prev: str, rows: Sequence[Sequence[Any]]
) -> list[SpendRecord]:
    """Verify rows ``start, start+1, ...`` against the chain ending in ``prev``; return records."""
    out: list[SpendRecord] = []
    for seq, position, run_id, round_index, event_json, created, prev_hash, digest, cohort in rows:
        where = (
            f"ledger {path}, federation {federation_id!r}, record #{position} "
            f"(row seq {seq}, run {run_id!r}, round {round_index})"
        )
        expected = start + len(out)
        if position != expected:
            raise LedgerCorrupted(f"{where}: expected record #{expected} next; a record is missing")
        if prev_hash != prev:
            raise LedgerCorrupted(f"{where}: its link to the previous record is broken")
        recomputed = record_hash(
            federation_id, position, run_id, round_index, event_json, created, prev_hash, cohort
        )
        if recomputed != digest:
            raise LedgerCorrupted(f"{where}: its contents do not match its hash (edited)")
        try:
            event = recorded_from_dict(json.loads(event_json))
        except (ValueError, TypeError, KeyError) as error:
            raise LedgerCorrupted(f"{where}: unreadable event: {error}") from error
        out.append(
            SpendRecord(
                federation_id, position, run_id, round_index, event, created, digest, cohort
            )
        )
        prev = digest
    return out


def verify_head(
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


def data_key_of(salt: str, data_identity: str, label: str) -> str:
    """The budget key of a data set: ``label-HMAC(salt, data identity)``, truncated to 64 bits."""
    digest = hmac.new(bytes.fromhex(salt), data_identity.encode("utf-8"), hashlib.sha256)
    return f"{label}-{digest.hexdigest()[:16]}"


def _budget_federation_id(data_key: str, number: int) -> str:
    return data_key if number == 1 else f"{data_key}-b{number}"


def default_actor() -> str:
    """Who starts a budget: user@host (pid), for the record."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no USER variable (containers)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def budget_chain(
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


def append_budget(
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
