"""Public data a run used, recorded beside the budget its private rounds spend (issue 19).

A model warm-started from public data owes part of its accuracy to that data, and a reader of the
ledger (an auditor, the next operator) must see which runs on a budget rested on it. A record names
the data, its content digest, how many items it holds, how the run used it and whether its
disjointness from the private data was checked. It spends nothing: the public data is not the
participants' data, so it carries no privacy cost here, which is exactly why it must be declared.
Like every ledger table it is append-only; a resumed run records nothing twice.
"""

from __future__ import annotations

import json
import sqlite3
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedmeta.accounting.ledger.cohorts import coarse_day
from fedmeta.accounting.ledger.records import LedgerCorrupted
from fedmeta.accounting.ledger.storage import table_names

__all__ = ["PublicDataRecord", "PublicDataUse", "public_uses", "record_public_use"]


@dataclass(frozen=True)
class PublicDataUse:
    """What public data a run used and how (``description``: what it is, for a reader)."""

    description: str
    digest: str  # hex content digest of the public data as used
    items: int  # e.g. classes
    use: str  # e.g. "non-private pre-training before private training"
    disjoint_from_private: bool  # True only when the run checked it (it refuses overlap)

    def __post_init__(self) -> None:
        for name in ("description", "use"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{name} must be a non-empty string; got {value!r}")
        if not (isinstance(self.digest, str) and 16 <= len(self.digest) <= 128
                and set(self.digest) <= set(string.hexdigits.lower())):  # fmt: skip
            raise ValueError(f"digest must be 16-128 lowercase hex digits; got {self.digest!r}")
        if not isinstance(self.items, int) or isinstance(self.items, bool) or self.items < 1:
            raise ValueError(f"items must be an int >= 1; got {self.items!r}")
        if not isinstance(self.disjoint_from_private, bool):
            raise ValueError(
                f"disjoint_from_private must be a bool; got {self.disjoint_from_private!r}"
            )

    def to_json(self) -> str:
        """The stored form: canonical JSON, so equal declarations are equal rows."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PublicDataUse:
        """Rebuild (and so re-validate) a stored declaration."""
        return cls(**{k: data[k] for k in ("description", "digest", "items", "use",
                                           "disjoint_from_private")})  # fmt: skip


@dataclass(frozen=True)
class PublicDataRecord:
    """One stored declaration: which run made it, and the day (UTC) it was recorded."""

    run_id: str
    use: PublicDataUse
    created_at: str


def record_public_use(
    conn: sqlite3.Connection, federation_id: str, run_id: str, use: PublicDataUse
) -> None:
    """Insert the declaration if new (inside the caller's write transaction)."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string; got {run_id!r}")
    conn.execute(
        "INSERT OR IGNORE INTO public_data (federation_id, run_id, declaration, created_at) "
        "VALUES (?, ?, ?, ?)",
        (federation_id, run_id, use.to_json(), coarse_day()),
    )


def public_uses(conn: sqlite3.Connection, path: Path, federation_id: str) -> list[PublicDataRecord]:
    """The federation's declarations, oldest first; none in a ledger older than the table."""
    tables = table_names(conn)
    if "public_data" not in tables:
        return []
    rows = conn.execute(
        "SELECT run_id, declaration, created_at FROM public_data WHERE federation_id = ? "
        "ORDER BY rowid",
        (federation_id,),
    )
    out = []
    for run_id, decl, day in rows:
        try:
            use = PublicDataUse.from_dict(json.loads(decl))
        except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError is a ValueError
            raise LedgerCorrupted(
                f"ledger {path}, federation {federation_id!r}: the public-data declaration of run "
                f"{run_id!r} is not a valid one ({error}); it was edited outside fedmeta"
            ) from None
        out.append(PublicDataRecord(str(run_id), use, str(day)))
    return out
