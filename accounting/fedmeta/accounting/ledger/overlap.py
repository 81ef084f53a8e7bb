"""Composition by overlap: a participant's data named by its items, charged with what they spent.

A budget belongs to the data (privacy-accounting note, section 4; issue 39). A participant that
declares its data as the content digests of its items (``DataItems``: 64-bit digests at source
resolution, metalearning/items.py) is charged, in each round, to every *data record* of the ledger
that holds one of its items, and to a new record holding the items no record holds yet. So:

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
file names no item by a hash anyone could recompute from an image, and its record). Both are
append-only; created on first use, so older ledgers need no migration and older fedmeta versions
ignore them.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmeta.accounting.ledger.records import LedgerError
from fedmeta.accounting.ledger.storage import (
    absolute_path,
    classify_error,
    connect_readonly,
    read_transaction,
)

__all__ = ["ITEMS_TEXT_PREFIX", "DataItems", "ensure_tables", "ledger_holds", "resolve_records"]

#: How a participant's item set travels as text (its registration's data fingerprint).
ITEMS_TEXT_PREFIX = "items-v1:"

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
    *(
        f"CREATE TRIGGER IF NOT EXISTS {table}_append_only_{op.lower()} BEFORE {op} ON {table} "
        f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
        for table in ("data_records", "data_items")
        for op in ("UPDATE", "DELETE")
    ),
)


@dataclass(frozen=True)
class DataItems:
    """A participant's data as the set of its items' 64-bit content digests (sorted, unique)."""

    packed: bytes  # big-endian uint64 digests, sorted ascending, no repeats

    def __post_init__(self) -> None:
        if not isinstance(self.packed, bytes) or not self.packed or len(self.packed) % 8:
            raise ValueError("packed must be a non-empty whole number of 8-byte digests")

    @classmethod
    def of(cls, digests: Iterable[int] | np.ndarray) -> DataItems:
        """From item digests in any order, repeats allowed (at least one)."""
        arr = np.unique(np.asarray(list(digests) if not isinstance(digests, np.ndarray)
                                   else digests, dtype=np.uint64))  # fmt: skip
        return cls(arr.astype(">u8").tobytes())

    def array(self) -> np.ndarray:
        """The digests, uint64 ascending."""
        return np.frombuffer(self.packed, dtype=">u8").astype(np.uint64)

    def __len__(self) -> int:
        return len(self.packed) // 8

    @functools.cached_property
    def set_digest(self) -> str:
        """SHA-256 (32 hex digits) of the whole set: names the record this data starts."""
        return hashlib.sha256(b"fedmeta-item-set-v1\n" + self.packed).hexdigest()[:32]

    def to_text(self) -> str:
        """``items-v1:<base64>``: what a participant sends the (trusted) server."""
        return ITEMS_TEXT_PREFIX + base64.b64encode(self.packed).decode("ascii")

    @staticmethod
    def from_text(text: str) -> DataItems | None:
        """The items ``text`` carries; None when it is another kind of fingerprint."""
        return _from_text(text) if text.startswith(ITEMS_TEXT_PREFIX) else None


@functools.lru_cache(maxsize=256)
def _from_text(text: str) -> DataItems:
    """Decoded once per text: every round names the same participants."""
    try:
        raw = base64.b64decode(text[len(ITEMS_TEXT_PREFIX) :], validate=True)
        return DataItems.of(np.frombuffer(raw, dtype=">u8"))
    except (ValueError, binascii.Error) as error:
        raise ValueError(f"an item set must be {ITEMS_TEXT_PREFIX}<base64 of 8-byte digests>; "
                         f"{error}") from None  # fmt: skip


def ensure_tables(conn: sqlite3.Connection) -> None:
    """Create the two tables and their triggers (inside the caller's write transaction)."""
    for statement in _CREATE:
        conn.execute(statement)


def has_tables(conn: sqlite3.Connection) -> bool:
    """Whether this ledger has ever recorded an item set."""
    names = {str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master")}
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


@dataclass
class _Known:
    """The federation's recorded items (sorted) and each one's record identity."""

    items: np.ndarray  # int64, ascending
    owners: np.ndarray  # record row ids, aligned with items
    identities: dict[int, str]  # record row id -> identity

    def owners_of(self, keyed: np.ndarray) -> tuple[set[str], np.ndarray]:
        """The identities of the records holding any of ``keyed``, and the items none holds."""
        if not len(self.items):
            return set(), keyed
        pos = np.minimum(np.searchsorted(self.items, keyed), len(self.items) - 1)
        hit = self.items[pos] == keyed
        found = {self.identities[int(r)] for r in np.unique(self.owners[pos[hit]])}
        return found, keyed[~hit]


def _load(conn: sqlite3.Connection, federation_id: str) -> _Known:
    if not has_tables(conn):
        return _Known(np.zeros(0, np.int64), np.zeros(0, np.int64), {})
    identities = {
        int(r): str(i)
        for r, i in conn.execute(
            "SELECT record, identity FROM data_records WHERE federation_id = ?", (federation_id,)
        )
    }
    if not identities:
        return _Known(np.zeros(0, np.int64), np.zeros(0, np.int64), {})
    rows = conn.execute(
        "SELECT i.item, i.record FROM data_items i JOIN data_records r ON r.record = i.record "
        "WHERE r.federation_id = ? ORDER BY i.item",
        (federation_id,),
    ).fetchall()
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    return _Known(arr[:, 0].copy(), arr[:, 1].copy(), identities)


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

    ``write``: record the new items (inside the caller's write transaction); else (a read-only
    look) new items are named by the record they would start, and nothing is written.
    """
    if write:
        ensure_tables(conn)
    known = _load(conn, federation_id)
    out: dict[str, list[str]] = {}
    for name, items in sorted(declared.items()):
        keyed = np.unique(keyed_items(salt, federation_id, items))
        found, fresh = known.owners_of(keyed)
        if len(fresh):
            identity = f"items:{items.set_digest}"
            found.add(identity)
            if write:
                _record(conn, federation_id, identity, fresh, day, known)
        out[name] = sorted(found)
    return out


def _record(
    conn: sqlite3.Connection,
    federation_id: str,
    identity: str,
    fresh: np.ndarray,
    day: str,
    known: _Known,
) -> None:
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


def held_items(conn: sqlite3.Connection, declared: Iterable[DataItems]) -> int:
    """How many of ``declared``'s items this ledger records, in any federation (read-only)."""
    meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    if "salt" not in meta or not has_tables(conn):
        return 0
    found = 0
    federations = [str(r[0]) for r in conn.execute(
        "SELECT DISTINCT federation_id FROM data_records")]  # fmt: skip
    for fid in federations:
        known = _load(conn, fid)
        for items in declared:
            keyed = np.unique(keyed_items(meta["salt"], fid, items))
            found += len(keyed) - len(known.owners_of(keyed)[1])
    return found


def ledger_holds(path: str | Path, declared: Sequence[DataItems]) -> int:
    """How many of ``declared``'s items the ledger at ``path`` records (read-only)."""
    path = absolute_path(path)
    conn = connect_readonly(path)
    try:
        with read_transaction(conn):
            return held_items(conn, declared)
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()
