"""Composed epsilons kept between processes, each under the hash of everything it was composed from.

Why: a reader such as ``fedmeta ledger show`` must show the epsilon the records give, recomposed
from them (package docstring, "Recomputed, not trusted"), yet composing means importing
dp-accounting and scipy (seconds on a loaded 2-core machine) and the PLD work itself, each time,
for records that have not changed since the last look.

How it stays a recomputation: an entry is found only under :func:`composition_key`, the SHA-256 of
the composition's whole input as read *now*: the multiset of recorded events (each event's
canonical JSON, the spelling the hash chain covers, with its count; read from records whose chain
the open has just verified), delta, unit, method, and the accountant itself (:func:`accountant`:
a digest of the source of ``fedmeta.accounting`` and the versions of dp-accounting, scipy and
numpy). A new record, another delta or unit, an edit to the accounting code or another library
version is another key: the epsilon is composed afresh and then kept. A number is never read as
"the epsilon of this ledger"; it is read as "what this accountant composed from exactly these
rounds", so nothing stored can stand for records it was not computed from. Who can write the cache
file can put a wrong number under a right key; that is the chain's own threat model (someone who
recomputes every hash is outside it), and ``fedmeta ledger show --recompute`` composes everything
afresh, reading no entry.

The cache is derived data: unreadable, missing or damaged, it is a miss, never an error, and it
lives outside the ledger's directory (nothing is added beside a ledger, and a read-only ledger is
still only read).
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
from functools import cache
from importlib import metadata
from pathlib import Path

from fedmeta.accounting.composition import Method
from fedmeta.accounting.ledger.chain import canonical_json
from fedmeta.accounting.ledger.participants import Multiset
from fedmeta.accounting.schemes import Unit

#: The key's own format: a change to what goes into a key changes this.
KEY_FORMAT = 1
#: The libraries the composition runs on (their versions are part of the accountant).
LIBRARIES = ("dp-accounting", "scipy", "numpy")
_BUSY_S = 2.0
_CREATE = "CREATE TABLE IF NOT EXISTS epsilons (key TEXT PRIMARY KEY, epsilon REAL NOT NULL)"


@cache
def accountant() -> str:
    """A digest of what composes: ``fedmeta.accounting``'s source files and its libraries' versions.

    Read once per process (a few dozen small files). A source tree edited in place, as in an
    editable install, changes it without a version change, which is why the source is hashed.
    """
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    for name in LIBRARIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{name}=={version}\0".encode())
    return digest.hexdigest()


def composition_key(counts: Multiset, delta: float, unit: Unit, method: Method) -> str:
    """The SHA-256 of one composition's whole input (module docstring)."""
    rounds = [[canonical_json(event.to_dict()), count] for event, count in counts]
    return hashlib.sha256(canonical_json({
        "format": KEY_FORMAT, "accountant": accountant(), "delta": delta, "unit": unit,
        "method": method, "rounds": sorted(rounds),
    }).encode()).hexdigest()  # fmt: skip


class EpsilonCache:
    """Composed epsilons by :func:`composition_key`, in a SQLite file of their own.

    ``read=False`` finds nothing and keeps what is composed: a recomputation that also replaces
    whatever the file held under the same keys.
    """

    def __init__(self, path: Path, *, read: bool = True) -> None:
        self.path = path
        self.read = read

    def get(self, key: str) -> float | None:
        """The epsilon kept under ``key``, or None (none, not reading, or the file unreadable)."""
        if not self.read or not self.path.is_file():
            return None
        try:
            with contextlib.closing(self._connect()) as conn:
                row = conn.execute("SELECT epsilon FROM epsilons WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error:
            return None
        value = None if row is None else row[0]
        # A stored value that no composition returns (negative, NaN, not a number) is a miss.
        return float(value) if isinstance(value, float) and value >= 0 else None

    def put(self, key: str, value: float) -> None:
        """Keep ``value`` under ``key``; a cache that cannot be written is left as it is."""
        if not value >= 0:  # NaN, or nothing a composition returns
            return
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Its owner's only, as the ledger is: the per-participant epsilons are in it too.
            self.path.touch(mode=0o600, exist_ok=True)
            with contextlib.closing(self._connect()) as conn, conn:
                conn.execute(_CREATE)
                conn.execute("INSERT OR REPLACE INTO epsilons VALUES (?, ?)", (key, value))
        except (OSError, sqlite3.Error):
            return

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=_BUSY_S)
