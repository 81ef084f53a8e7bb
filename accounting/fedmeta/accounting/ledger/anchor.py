"""Rollback detection: a small anchor file beside the ledger names its id and last spend.

Restoring an older copy of the ledger file (or one from another machine) silently brings back
spent budget: the hash chain cannot see it, since an older copy is a valid prefix (issue 18, item
4). After every spend the ledger writes ``PATH.anchor`` (``ledger_id``, the spend count, and the
last spend's row number and hash); every open compares the file with it, and checkpoints carry the
same facts (``LedgerCheckpoint``). A ledger that is behind its anchor, or is another ledger than
the one its anchor names, is refused with one line naming what was found and the command that
accepts the rollback deliberately (recorded in the ledger, then the anchor follows the ledger).

Threat model: accidents and restores by an operator, not an adversary with write access to the
state directory (who can delete the anchor too); an anchor kept on other storage (a copy of the
file) is checked the same way with ``--anchor``.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedmeta.accounting.ledger.records import LedgerError
from fedmeta.accounting.ledger.storage import table_names


class LedgerRolledBack(LedgerError):
    """The ledger is behind an anchor it was shown (an older copy restored, or replaced)."""


@dataclass(frozen=True)
class Anchor:
    """Where the ledger stood after its last spend (``seq``/``head``: that spend's row and hash)."""

    ledger_id: str
    spends: int
    seq: int
    head: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"ledger_id": self.ledger_id, "spends": self.spends, "seq": self.seq,
                "head": self.head}  # fmt: skip


def anchor_path(path: Path) -> Path:
    """The anchor beside the ledger at ``path``."""
    return path.with_name(path.name + ".anchor")


def accept_command(path: Path, ledger_id: str | None = None, head: str | None = None) -> str:
    """The command that accepts a rollback deliberately (printed in every refusal)."""
    named = f" --ledger-id {ledger_id} --head {head}" if ledger_id and head else ""
    return f"fedmeta ledger accept-rollback --db {path}{named} --reason TEXT"


def current_anchor(conn: sqlite3.Connection, ledger_id: str) -> Anchor | None:
    """The ledger's own state as an anchor (``None`` without spends)."""
    row = conn.execute("SELECT seq, hash FROM spends ORDER BY seq DESC LIMIT 1").fetchone()
    if row is None:
        return None
    count = int(conn.execute("SELECT COUNT(*) FROM spends").fetchone()[0])
    return Anchor(ledger_id, count, int(row[0]), str(row[1]))


def write_anchor(path: Path, anchor: Anchor) -> None:
    """Replace the anchor beside the ledger at ``path`` atomically (see ``write_anchor_at``)."""
    write_anchor_at(anchor_path(path), anchor)


def write_anchor_at(target: Path, anchor: Anchor) -> None:
    """Replace the anchor file ``target`` atomically; a failure (a full disk) is ignored.

    A missing anchor only weakens detection; it never blocks a spend already recorded.
    """
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(anchor.to_dict(), handle, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)


def read_anchor(path: Path) -> Anchor | None:
    """The anchor at ``path`` (a ``.anchor`` file), ``None`` if absent; one line if unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Anchor(str(data["ledger_id"]), int(data["spends"]), int(data["seq"]),
                      str(data["head"]))  # fmt: skip
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LedgerError(
            f"the ledger's anchor {path} cannot be read ({error}); if the ledger is known to be "
            "current, remove the anchor (the next spend writes a new one)"
        ) from error


def behind(conn: sqlite3.Connection, ledger_id: str | None, anchor: Anchor) -> str | None:
    """What makes the ledger behind ``anchor`` (one phrase), or ``None`` if it is not."""
    if ledger_id != anchor.ledger_id:
        return (
            f"the anchor names ledger {anchor.ledger_id} with {anchor.spends} spend(s); this file "
            f"is ledger {ledger_id or '(legacy, no id)'}: the ledger was replaced or recreated"
        )
    row = conn.execute("SELECT hash FROM spends WHERE seq = ?", (anchor.seq,)).fetchone()
    if row is None or str(row[0]) != anchor.head:
        count = int(conn.execute("SELECT COUNT(*) FROM spends").fetchone()[0])
        return (
            f"the anchor records {anchor.spends} spend(s) ending in {anchor.head[:12]}; this "
            f"file holds {count} and not that one: an older copy was restored"
        )
    return None


def accepted(conn: sqlite3.Connection, ledger_id: str, head: str) -> bool:
    """Whether a recorded ``accept-rollback`` covers the spend ``head`` of ledger ``ledger_id``."""
    if "rollbacks" not in table_names(conn):
        return False
    row = conn.execute(
        "SELECT 1 FROM rollbacks WHERE anchor_ledger_id = ? AND anchor_head = ?",
        (ledger_id, head),
    ).fetchone()
    return row is not None


def record_acceptance(
    conn: sqlite3.Connection, ledger_id: str, head: str, found: str, reason: str, actor: str
) -> None:
    """Record a deliberate rollback (inside the caller's write transaction)."""
    conn.execute(
        "INSERT INTO rollbacks (anchor_ledger_id, anchor_head, found, reason, actor, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (ledger_id, head, found, reason, actor, datetime.now(UTC).date().isoformat()),
    )


def check_witness(
    conn: sqlite3.Connection, path: Path, ledger_id: str | None, witness: Path,
    *, follow: bool = True,
) -> None:
    """Refuse a ledger behind a witness kept outside its state directory (issue 39, item 5).

    The witness is an anchor file written after every spend somewhere a restore of the state
    directory does not reach (ledger/witness.py). A ledger behind it (an older copy, the whole
    state directory restored, the ledger deleted and recreated) is refused unless that rollback
    was accepted on record; then, and when there is no witness yet, the witness is brought up to
    the ledger (``follow``; a dry run checks without writing).
    """
    anchor = read_anchor(witness)
    found = None if anchor is None else behind(conn, ledger_id, anchor)
    if anchor is not None and found is not None and not accepted(conn, anchor.ledger_id,
                                                                  anchor.head):  # fmt: skip
        raise LedgerRolledBack(
            f"ledger {path} is behind its witness {witness}: {found}; if that is deliberate, "
            f"accept it with `{accept_command(path, anchor.ledger_id, anchor.head)}` (recorded), "
            "else restore the newer ledger"
        )
    now = None if ledger_id is None else current_anchor(conn, ledger_id)
    if follow and now is not None and now != anchor:
        write_anchor_at(witness, now)


def check_rollback(path: Path, witness: Path | None) -> None:
    """Refuse, reading only, what a writable open refuses: a ledger behind its anchor or witness.

    For ``--dry-run`` (issue 52, item 5): the exit status of the run it previews, with nothing
    written (a read-only connection; the witness is read, never brought up to date). No file at
    ``path``: nothing to check (the run creates a new ledger there).
    """
    from fedmeta.accounting.ledger.storage import (
        absolute_path,
        classify_error,
        connect_readonly,
        read_meta,
        read_transaction,
    )

    path = absolute_path(path)
    if not path.is_file():
        return
    conn = connect_readonly(path)
    try:
        with read_transaction(conn):
            ledger_id = read_meta(conn).get("ledger_id")
            check_anchor(conn, path, ledger_id)
            if witness is not None:
                check_witness(conn, path, ledger_id, witness, follow=False)
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()


def check_anchor(conn: sqlite3.Connection, path: Path, ledger_id: str | None) -> None:
    """Refuse a ledger behind its anchor (unless that rollback was accepted, recorded)."""
    anchor = read_anchor(anchor_path(path))
    if anchor is None:
        return
    found = behind(conn, ledger_id, anchor)
    if found is not None and not accepted(conn, anchor.ledger_id, anchor.head):
        raise LedgerRolledBack(
            f"ledger {path} is behind its anchor {anchor_path(path).name}: {found}; if that is "
            f"deliberate, accept it with `{accept_command(path)}` (recorded), else restore the "
            "newer ledger"
        )
