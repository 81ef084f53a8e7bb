"""Composition by overlap: a participant's data named by its items, charged with what they spent.

A budget belongs to the data (privacy-accounting note, section 4; issue 39). A participant that
declares its data as its items (``DataItems``, fedmeta/item_identity.py on the floor: each item's
64-bit digest at source resolution and its *look*, a perceptual hash of the model's input) is
charged, in each round, to every *data record* of the ledger that holds one of its items - the
same digest, or a look within ``LOOK_TOLERANCE`` bits (issue 52: a JPEG, resized, cropped or
grey-level copy is the recorded item) - and to a new record holding the items no record holds
yet. So:

* the same items in another file format, through another loader or path, or under another node
  key are the same records: the same budget;
* a subset, a superset or a reshuffle of recorded items is charged to every record it touches:
  the run is allowed only if *each* such record (the most-spent one included) stays within the
  budget after it; its new items start a record of their own, charged from then on;
* data that shares no item with any record is new data, with a budget of its own.

Why this is a valid composition (task-level add/remove, as in participants.py): a task of the new
run is built from items; every item that already had a record carries that record's rounds, and
the new run's rounds are added to that record. Each item belongs to exactly one record, so an
item's privacy loss is the composition of its record's rounds: the ledger checks every record a
round charges. Charging a record for a run that used only some of its items over-counts for the
others: conservative.

On disk: ``data_records`` (one row per record: its federation and identity, the participant key is
``HMAC(salt, identity)`` as for every participant) and ``data_items`` (one row per item: a keyed
64-bit digest of the federation id and the item's digest under the ledger's secret salt, so the
file names no item by a hash anyone could recompute from an image, and its record) and
``data_looks`` (one row per look: the look XORed with a one-time pad drawn, by the row's number,
from SHAKE-256 of the salt and the federation, so no stored value is a look; they are unsealed in
memory and searched with faiss). All three are append-only; created on first use.

**Records from before looks** (issue 52) hold digests only: their items are still charged
exactly, and when an item equal to one of theirs comes again its look is added to that record
(``data_looks``), so its near-duplicates are charged from then on. Nothing recorded is dropped
or re-keyed. What stays open: a near-duplicate of an old item whose exact copy never comes back
(docs/ledger.md, "Keys by content").
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedmeta.accounting.ledger.records import LedgerError
from fedmeta.accounting.ledger.storage import (
    absolute_path,
    classify_error,
    connect_readonly,
    read_transaction,
    table_names,
)
from fedmeta.item_identity import ITEMS_TEXT_PREFIX, LOOK_BYTES, LOOK_TOLERANCE, DataItems

__all__ = ["ITEMS_TEXT_PREFIX", "DataItems", "ensure_tables", "ledger_holds", "resolve_records"]

_CREATE = (
    """CREATE TABLE IF NOT EXISTS data_records (
        record         INTEGER PRIMARY KEY AUTOINCREMENT,
        federation_id  TEXT NOT NULL,
        identity       TEXT NOT NULL,
        items          INTEGER NOT NULL,
        created_at     TEXT NOT NULL,
        UNIQUE (federation_id, identity)
    )""",
    """CREATE TABLE IF NOT EXISTS data_items (
        item    INTEGER PRIMARY KEY,
        record  INTEGER NOT NULL REFERENCES data_records(record)
    )""",
    """CREATE TABLE IF NOT EXISTS data_looks (
        look    INTEGER PRIMARY KEY AUTOINCREMENT,
        record  INTEGER NOT NULL REFERENCES data_records(record),
        sealed  BLOB NOT NULL
    )""",
    *(
        f"CREATE TRIGGER IF NOT EXISTS {table}_append_only_{op.lower()} BEFORE {op} ON {table} "
        f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
        for table in ("data_records", "data_items", "data_looks")
        for op in ("UPDATE", "DELETE")
    ),
)


def ensure_tables(conn: sqlite3.Connection) -> None:
    """Create the two tables and their triggers (inside the caller's write transaction)."""
    for statement in _CREATE:
        conn.execute(statement)


def has_tables(conn: sqlite3.Connection) -> bool:
    """Whether this ledger has ever recorded an item set."""
    names = table_names(conn)
    return {"data_records", "data_items"} <= names


def keyed_items(salt: str, federation_id: str, items: DataItems) -> np.ndarray:
    """The stored names of ``items`` in ``federation_id`` (int64; BLAKE2b keyed by the salt)."""
    key = bytes.fromhex(salt)[:64]
    person = federation_id.encode("utf-8")
    head = hashlib.blake2b(person, digest_size=16).digest()
    joined = b"".join(
        hashlib.blake2b(head + item, key=key, digest_size=8).digest()
        for item in (items.packed[i : i + 8] for i in range(0, len(items.packed), 8))
    )
    return np.frombuffer(joined, dtype=">i8").astype(np.int64)



def _pads(salt: str, federation_id: str, rows: int) -> np.ndarray:
    """The one-time pads of look rows ``0..rows-1`` (uint8 ``[rows, 32]``).

    SHAKE-256 (FIPS 202) of the salt and the federation, cut into 32-byte pads by row number.
    """
    seed = b"fedmeta-look-pad-v1\0" + bytes.fromhex(salt) + b"\0" + federation_id.encode()
    stream = hashlib.shake_256(seed).digest(LOOK_BYTES * rows)
    return np.frombuffer(stream, dtype=np.uint8).reshape(rows, LOOK_BYTES)


@dataclass(frozen=True)
class _Near:
    """A range search's answer for each of some looks."""

    records: np.ndarray  # the records holding any look within the tolerance (row ids)
    hit: np.ndarray  # per look: whether a recorded look lies within the tolerance
    nearest: np.ndarray  # per look: the record of the nearest recorded look (-1: none)
    stored: np.ndarray  # per look: whether this very look is recorded


@dataclass
class _Known:
    """The federation's recorded items (sorted) and looks, each with its record."""

    items: np.ndarray  # int64, ascending
    owners: np.ndarray  # record row ids, aligned with items
    identities: dict[int, str]  # record row id -> identity
    looks: np.ndarray = field(default_factory=lambda: np.zeros((0, LOOK_BYTES), np.uint8))
    look_owners: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _index: Any = field(default=None, repr=False)  # faiss.IndexBinaryFlat over looks, built once

    def owners_of(self, keyed: np.ndarray) -> tuple[set[str], np.ndarray]:
        """The identities of the records holding any of ``keyed``, and the items none holds."""
        found, hit = self.exact(keyed)
        return {self.identities[int(r)] for r in found}, keyed[~hit]

    def exact(self, keyed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The records holding ``keyed`` (row ids) and, per item, whether one holds it."""
        if not len(self.items):
            return np.zeros(0, np.int64), np.zeros(len(keyed), bool)
        pos = np.minimum(np.searchsorted(self.items, keyed), len(self.items) - 1)
        hit = self.items[pos] == keyed
        return np.unique(self.owners[pos[hit]]), hit

    def near(self, looks: np.ndarray, tolerance: int = LOOK_TOLERANCE) -> _Near:
        """Which recorded looks lie within ``tolerance`` bits of each of ``looks``.

        Charging's ``LOOK_TOLERANCE`` by default. Exact range search (faiss, Hamming distance).
        """
        if not len(self.looks) or not len(looks):
            none = np.full(len(looks), -1, np.int64)
            return _Near(np.zeros(0, np.int64), none >= 0, none, none >= 0)
        if self._index is None:
            import faiss  # a maintained index: SIMD Hamming search, range queries

            self._index = faiss.IndexBinaryFlat(LOOK_BYTES * 8)
            self._index.add(np.ascontiguousarray(self.looks))
        lims, dist, labels = self._index.range_search(np.ascontiguousarray(looks), tolerance + 1)
        counts = np.diff(lims.astype(np.int64))
        rows = np.repeat(np.arange(len(looks)), counts)
        order = np.lexsort((dist, rows))  # each row's matches, nearest first
        hit = counts > 0
        first = lims[:-1].astype(np.int64)[hit]
        nearest = np.full(len(looks), -1, np.int64)
        nearest[hit] = self.look_owners[labels[order][first]]
        stored = np.zeros(len(looks), bool)
        stored[hit] = dist[order][first] == 0
        return _Near(np.unique(self.look_owners[labels]), hit, nearest, stored)

    def add_looks(self, looks: np.ndarray, record: int) -> None:
        self.looks = np.concatenate([self.looks, looks])
        self.look_owners = np.concatenate([self.look_owners, np.full(len(looks), record)])
        self._index = None


def _load(conn: sqlite3.Connection, salt: str, federation_id: str) -> _Known:
    empty = _Known(np.zeros(0, np.int64), np.zeros(0, np.int64), {})
    tables = table_names(conn)
    if not {"data_records", "data_items"} <= tables:
        return empty
    identities = {
        int(r): str(i)
        for r, i in conn.execute(
            "SELECT record, identity FROM data_records WHERE federation_id = ?", (federation_id,)
        )
    }
    if not identities:
        return empty
    rows = conn.execute(
        "SELECT i.item, i.record FROM data_items i JOIN data_records r ON r.record = i.record "
        "WHERE r.federation_id = ? ORDER BY i.item",
        (federation_id,),
    ).fetchall()
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    known = _Known(arr[:, 0].copy(), arr[:, 1].copy(), identities)
    if "data_looks" in tables:
        _load_looks(conn, salt, federation_id, known)
    return known


def _load_looks(conn: sqlite3.Connection, salt: str, federation_id: str, known: _Known) -> None:
    """Unseal the federation's looks into ``known`` (in memory only)."""
    rows = conn.execute(
        "SELECT l.look, l.record, l.sealed FROM data_looks l JOIN data_records r "
        "ON r.record = l.record WHERE r.federation_id = ? ORDER BY l.look",
        (federation_id,),
    ).fetchall()
    if not rows:
        return
    ids = np.asarray([r[0] for r in rows], dtype=np.int64)
    sealed = np.frombuffer(b"".join(bytes(r[2]) for r in rows), dtype=np.uint8)
    pads = _pads(salt, federation_id, int(ids.max()) + 1)[ids]
    known.looks = sealed.reshape(-1, LOOK_BYTES) ^ pads
    known.look_owners = np.asarray([r[1] for r in rows], dtype=np.int64)


def resolve_records(
    conn: sqlite3.Connection,
    salt: str,
    federation_id: str,
    declared: Mapping[str, DataItems],
    *,
    write: bool,
    day: str,
) -> dict[str, list[str]]:
    """Each declared data set (by its name) -> the identities of the records it is charged to.

    A record is charged when it holds one of the set's digests or a look within the tolerance of
    one of its looks. ``write``: record the new items (inside the caller's write transaction);
    else (a read-only look) new items are named by the record they would start, and nothing is
    written.
    """
    if write:
        ensure_tables(conn)
    known = _load(conn, salt, federation_id)
    out: dict[str, list[str]] = {}
    for name, items in sorted(declared.items()):
        keyed = keyed_items(salt, federation_id, items)
        looks = items.look_array()
        records, exact = known.exact(keyed)
        near = known.near(looks if looks is not None else np.zeros((0, LOOK_BYTES), np.uint8))
        found = {known.identities[int(r)] for r in np.concatenate([records, near.records])}
        fresh = ~exact if looks is None else ~(exact | near.hit)
        if write and looks is not None:  # before the new record: its looks are stored with it
            _keep_looks(conn, (salt, federation_id), known, looks, keyed, near, fresh)
        if fresh.any():
            identity = f"items:{items.set_digest}"
            found.add(identity)
            if write:
                record = _record(conn, federation_id, identity, np.unique(keyed[fresh]), day, known)
                if looks is not None:
                    _seal(conn, salt, federation_id, looks[fresh], record, known)
        out[name] = sorted(found)
    return out


def _keep_looks(
    conn: sqlite3.Connection,
    where: tuple[str, str],
    known: _Known,
    looks: np.ndarray,
    keyed: np.ndarray,
    near: _Near,
    fresh: np.ndarray,
) -> None:
    """The looks of charged items not recorded yet join the record they were charged by.

    An item recorded by digest alone (before looks) that comes again gives its record its look,
    so its near-duplicates are charged to that record from now on; a near-duplicate's own look
    joins the record of its nearest look, so a copy near *it* (though farther from the record's
    look than the tolerance) is charged there too: the tolerance is not transitive, this errs
    towards charging.
    """
    keep = ~fresh & ~near.stored
    if not keep.any():
        return
    owners = near.nearest.copy()
    pos = np.minimum(np.searchsorted(known.items, keyed), max(len(known.items) - 1, 0))
    by_digest = known.items[pos] == keyed if len(known.items) else np.zeros(len(keyed), bool)
    owners[by_digest] = known.owners[pos[by_digest]]
    for record in np.unique(owners[keep]):
        _seal(conn, *where, looks[keep & (owners == record)], int(record), known)


def _seal(conn: sqlite3.Connection, salt: str, federation_id: str, looks: np.ndarray,
          record: int, known: _Known) -> None:  # fmt: skip
    """Append ``looks`` to ``record``, each XORed with its row's pad (and to ``known``)."""
    looks = np.unique(looks, axis=0)
    first = int(conn.execute("SELECT COALESCE(MAX(look), 0) + 1 FROM data_looks").fetchone()[0])
    rows = np.arange(first, first + len(looks))
    sealed = looks ^ _pads(salt, federation_id, first + len(looks))[rows]
    conn.executemany(
        "INSERT INTO data_looks (look, record, sealed) VALUES (?, ?, ?)",
        ((int(r), record, s.tobytes()) for r, s in zip(rows, sealed, strict=True)),
    )
    known.add_looks(looks, record)


def _record(
    conn: sqlite3.Connection,
    federation_id: str,
    identity: str,
    fresh: np.ndarray,
    day: str,
    known: _Known,
) -> int:
    """A new record holding ``fresh`` (items no record holds), added to ``known`` too."""
    try:
        record = conn.execute(
            "INSERT INTO data_records (federation_id, identity, items, created_at) "
            "VALUES (?, ?, ?, ?)",
            (federation_id, identity, int(len(fresh)), day),
        ).lastrowid
    except sqlite3.IntegrityError:
        raise LedgerError(
            f"federation {federation_id!r}: the data record {identity} exists but does not hold "
            "all of its items (the ledger was edited); restore it from a backup"
        ) from None
    assert record is not None
    conn.executemany(
        "INSERT INTO data_items (item, record) VALUES (?, ?)",
        ((int(i), record) for i in fresh.tolist()),
    )
    order = np.argsort(np.concatenate([known.items, fresh]), kind="stable")
    known.items = np.concatenate([known.items, fresh])[order]
    known.owners = np.concatenate([known.owners, np.full(len(fresh), record, np.int64)])[order]
    known.identities[int(record)] = identity
    return int(record)


def held_items(
    conn: sqlite3.Connection, declared: Iterable[DataItems], tolerance: int = LOOK_TOLERANCE
) -> int:
    """How many of ``declared``'s items this ledger records, in any federation (read-only).

    By digest, or by a look within the tolerance (a near-duplicate is the recorded item).
    """
    meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    if "salt" not in meta or not has_tables(conn):
        return 0
    found = 0
    federations = [str(r[0]) for r in conn.execute(
        "SELECT DISTINCT federation_id FROM data_records")]  # fmt: skip
    for fid in federations:
        known = _load(conn, meta["salt"], fid)
        for items in declared:
            held = known.exact(keyed_items(meta["salt"], fid, items))[1]
            if (looks := items.look_array()) is not None:
                held |= known.near(looks, tolerance).hit
            found += int(held.sum())
    return found


def ledger_holds(
    path: str | Path, declared: Sequence[DataItems], *, tolerance: int = LOOK_TOLERANCE
) -> int:
    """How many of ``declared``'s items the ledger at ``path`` records (read-only)."""
    path = absolute_path(path)
    conn = connect_readonly(path)
    try:
        with read_transaction(conn):
            return held_items(conn, declared, tolerance)
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()
