"""``backup``: a consistent, atomic, verified copy of a ledger (also the way to restore one).

SQLite's online backup copies a snapshot under a read transaction; the copy is verified (every
chain) before it replaces the destination atomically, and a destination that is another ledger or
holds spends the source lacks is refused unless forced (docs/ledger.md, "Back up and restore").
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Mapping
from pathlib import Path

from fedmeta.accounting.ledger.budget import (
    BudgetLedger,
)
from fedmeta.accounting.ledger.records import (
    BackupResult,
    LedgerError,
    LedgerInfo,
    LedgerUnreadable,
)
from fedmeta.accounting.ledger.storage import (
    absolute_path,
    classify_error,
    connect_readonly,
    sidecar,
)


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
        side = sidecar(dest, suffix)
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
    src_path, dest_path = absolute_path(src), absolute_path(dest)
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
            sidecar(dest_path, suffix).unlink(missing_ok=True)  # only reached with force
        os.replace(tmp, dest_path)
        _fsync_dir(dest_path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if _contains(dest_path, tmp_heads, this=str(dest_path), other="the copy") is not None:
        raise LedgerError(f"{dest_path} does not verify after the rename")
    return BackupResult(dest_path, src_info.ledger_id, {f: p for f, (p, _) in tmp_heads.items()})


def _copy(src: Path, tmp: Path) -> None:
    source = connect_readonly(src)
    target = sqlite3.connect(str(tmp), isolation_level=None)
    try:
        source.backup(target)
        # A schema-1 source was in WAL mode; the copy must read anywhere, without side files.
        target.execute("PRAGMA journal_mode = DELETE")
    except sqlite3.Error as error:
        raise classify_error(src, error) from error
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
