"""A federation's registration in the ledger: its budget, delta, unit and relation, fixed once.

``register_federation`` writes the row the first time a federation is opened for writing;
``check_registration`` refuses a later open that asks for other terms (a budget's terms are fixed
with it). The SQLite file itself is ``storage``'s.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from fedmeta.accounting.ledger.records import (
    LedgerError,
    stored_choice,
)
from fedmeta.accounting.ledger.storage import immediate_transaction
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    NEIGHBOURING_RELATIONS,
    UNITS,
    Neighbouring,
    Unit,
)


@dataclass(frozen=True)
class Registration:
    """A federation's row: what it was registered with."""

    epsilon_budget: float
    delta: float
    unit: Unit
    created_at: str
    neighbouring: Neighbouring | None  # None: schema 1, all add/remove


def register_federation(
    conn: sqlite3.Connection,
    path: Path,
    federation_id: str,
    epsilon_budget: float | None,
    delta: float | None,
    unit: Unit,
    neighbouring: Neighbouring | None,
    create: bool,
) -> Registration:
    """The federation's row, inserted first if it is new (and ``create`` allows it)."""
    with immediate_transaction(conn):
        row = find_registration(conn, path, federation_id)
        if row is not None:
            return row
        if not create or epsilon_budget is None or delta is None:
            raise LedgerError(
                f"federation {federation_id!r} is not in ledger {path}; opening a new one needs "
                "epsilon_budget and delta"
            )
        row = Registration(
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


def find_registration(
    conn: sqlite3.Connection, path: Path, federation_id: str
) -> Registration | None:
    """The federation's registration row, or None when it is not registered."""
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
    where = f"ledger {path}, federation {federation_id!r}"
    return Registration(
        float(row[0]),
        float(row[1]),
        stored_choice(where, "unit", row[2], UNITS),
        str(row[3]),
        None
        if row[4] is None
        else stored_choice(where, "neighbouring", row[4], NEIGHBOURING_RELATIONS),
    )


def check_registration(
    federation_id: str,
    row: Registration,
    epsilon_budget: float | None,
    delta: float | None,
    unit: Unit,
    neighbouring: Neighbouring | None,
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
