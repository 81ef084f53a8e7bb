"""File-system faults: one line naming the ledger's path and what to free or change (issue 21)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from fedmeta.accounting.ledger.records import LedgerUnwritable

#: Below this much free space an I/O error while writing is reported as a full disk.
LOW_SPACE_BYTES = 1 << 20


def free_bytes(directory: Path) -> int | None:
    """Bytes free on the file system of ``directory``, or None when it cannot be read."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def unwritable(path: Path, cause: str) -> LedgerUnwritable:
    """One line for a write the file system refused: the path, the cause, what to do."""
    free = free_bytes(path.parent)
    if cause == "full" or (free is not None and free < LOW_SPACE_BYTES):
        return LedgerUnwritable(
            f"ledger {path}: no space left on the file system holding {path.parent} "
            f"({free if free is not None else 'unknown'} bytes free); free space there (a spend "
            "needs a few KB), then rerun; the budget lives in this ledger, so another ledger "
            "file would not hold it; nothing was recorded"
        )
    if cause == "readonly":
        return LedgerUnwritable(
            f"ledger {path} cannot be written: {path.parent} is read-only (file, directory or "
            "mount); make it writable, or move this ledger whole (`fedmeta ledger backup --db "
            f"{path} --to NEW`) and point privacy.ledger_path at the copy; nothing was recorded"
        )
    return LedgerUnwritable(
        f"ledger {path}: the file system holding {path.parent} failed a write ({cause}); check "
        "that disk, then rerun; nothing was recorded"
    )


def ensure_directory(path: Path) -> None:
    """Create the ledger's directory, or say in one line why it cannot be (read-only, full)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        cause = {errno.ENOSPC: "full", errno.EROFS: "readonly", errno.EACCES: "readonly"}
        raise unwritable(path, cause.get(error.errno or 0, error.strerror or "")) from error
