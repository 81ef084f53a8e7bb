"""Budgets keyed by a data set's name, carried into the budget keyed by its content (issue 39).

Before issue 39 a budget's data was named by the data set's kind (``omniglot``, ``image_folder``)
and its participants by their index or node key; since, image data is named by its items
(ledger/overlap.py), in one budget per ledger. The older budgets' records name no items, so the
first content-keyed budget of a ledger *inherits* them: every round of every current budget of
those labels counts against every participant of the new budget (conservative: nobody's spent
budget is forgotten; an operator who knows the data differ starts a new budget with `fedmeta ledger
new-budget`, recorded). Recorded once, when that budget is created, in ``inherited``
(append-only).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection

from fedmeta.accounting.ledger.cohorts import label_of
from fedmeta.accounting.ledger.storage import table_names

_CREATE = (
    """CREATE TABLE IF NOT EXISTS inherited (
        federation_id  TEXT NOT NULL,
        source         TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        PRIMARY KEY (federation_id, source)
    )""",
    *(
        f"CREATE TRIGGER IF NOT EXISTS inherited_append_only_{op.lower()} BEFORE {op} ON "
        "inherited BEGIN SELECT RAISE(ABORT, 'inherited is append-only'); END"
        for op in ("UPDATE", "DELETE")
    ),
)



def inherit_labels(
    conn: sqlite3.Connection, federation_id: str, labels: Collection[str], day: str
) -> list[str]:
    """Record that ``federation_id`` inherits the current budgets of ``labels``; return them.

    Inside the caller's write transaction. Budgets already carried into another (schema 2) are
    reached through it, never twice.
    """
    for statement in _CREATE:
        conn.execute(statement)
    current = conn.execute(
        "SELECT b.federation_id, b.data_key FROM budgets b WHERE b.number = "
        "(SELECT MAX(number) FROM budgets c WHERE c.data_key = b.data_key) ORDER BY b.seq"
    ).fetchall()
    carried = (
        {str(r[0]) for r in conn.execute("SELECT federation_id FROM carried")}
        if "carried" in table_names(conn)
        else set()
    )
    sources = [
        str(fid)
        for fid, key in current
        if label_of(str(key)) in labels and fid != federation_id and fid not in carried
    ]
    conn.executemany(
        "INSERT OR IGNORE INTO inherited (federation_id, source, created_at) VALUES (?, ?, ?)",
        [(federation_id, fid, day) for fid in sources],
    )
    return sources


def inherited_sources(conn: sqlite3.Connection, federation_id: str) -> list[str]:
    """The budgets ``federation_id`` inherited (none on a ledger that never recorded any)."""
    if "inherited" not in table_names(conn):
        return []
    rows = conn.execute(
        "SELECT source FROM inherited WHERE federation_id = ? ORDER BY source", (federation_id,)
    )
    return [str(r[0]) for r in rows]
