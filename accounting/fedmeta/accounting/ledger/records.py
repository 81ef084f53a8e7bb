"""Constants, errors and the frozen records a ledger hands out (no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar

from fedmeta.accounting.schemes import (
    one_of,
)
from fedmeta.accounting.tuning_release import Recorded

if TYPE_CHECKING:  # overlap.py imports this module
    from fedmeta.accounting.ledger.overlap import DataItems

SCHEMA_VERSION = 3
LedgerMode: TypeAlias = Literal["secure", "insecure"]
LEDGER_MODES: tuple[LedgerMode, ...] = ("secure", "insecure")
#: Why a ledger could not be read: a bounded set, used as a metric label by the exporter.
UNREADABLE_REASONS: tuple[str, ...] = (
    "missing",
    "cannot_open",
    "not_sqlite",
    "not_ledger",
    "corrupted",
    "hot_journal",
    "legacy_wal",
    "busy",
)
#: How often ``spend`` re-runs its search when other processes keep recording *other* kinds of
#: round meanwhile (records of the same kind never force a retry).
SPEND_ATTEMPTS = 8
#: How long SQLite waits for another connection's lock (a commit takes milliseconds).
BUSY_TIMEOUT_S = 60.0
#: How long a writable open waits for an older fedmeta to let go of a WAL ledger it converts.
SWITCH_TIMEOUT_S = 5.0
#: The reason recorded for the first budget of a data set.
FIRST_BUDGET_REASON = "first budget for this data"


# ------------------------------------------------------------------------------------- errors


class LedgerError(Exception):
    """Base class of ledger errors."""


class BudgetExhausted(LedgerError):
    """The planned round would exceed the budget; nothing was recorded or released."""

    def __init__(self, message: str, *, epsilon_after: float, epsilon_budget: float) -> None:
        super().__init__(message)
        self.epsilon_after = epsilon_after
        self.epsilon_budget = epsilon_budget


class LevelMismatch(LedgerError):
    """A spend of another privacy level than the data's recorded one; nothing was recorded.

    ``recorded`` and ``requested`` are ``"task"`` or ``"sample"`` (accounting/levels.py).
    """

    def __init__(self, message: str, *, recorded: str, requested: str) -> None:
        super().__init__(message)
        self.recorded = recorded
        self.requested = requested


class LedgerUnreadable(LedgerError):
    """The ledger file cannot be read; ``reason`` is one of ``UNREADABLE_REASONS``."""

    reason = "cannot_open"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class LedgerMissing(LedgerUnreadable, FileNotFoundError):
    """There is no file at the ledger's path."""

    reason = "missing"


class NotALedger(LedgerUnreadable):
    """Not a SQLite file (reason ``not_sqlite``), or SQLite but not a fedmeta ledger."""

    reason = "not_ledger"


class LedgerCorrupted(LedgerUnreadable):
    """The ledger file failed its integrity check; it is never silently reset."""

    reason = "corrupted"


_Choice = TypeVar("_Choice", bound=str)


def stored_choice(where: str, name: str, value: object, allowed: tuple[_Choice, ...]) -> _Choice:
    """``value``, read back from a ledger file, as one of ``allowed`` (narrowed once, here).

    Every closed-set value a ledger stores was checked before it was written, so anything else
    means the file was edited or written by a newer fedmeta: ``LedgerCorrupted``, one line.
    """
    try:
        return one_of(f"stored {name}", value, allowed)
    except ValueError as error:
        raise LedgerCorrupted(
            f"{where}: {error}; the file was edited or written by a newer fedmeta"
        ) from None


class LedgerReplaced(LedgerError):
    """The file at the ledger's path is no longer the one this object opened (restored, moved)."""


class LedgerUnwritable(LedgerError):
    """The ledger's file system refused a write (full, read-only, I/O error); nothing recorded.

    The message is one line naming the path and what to free or change.
    """


class LedgerReadOnly(LedgerError):
    """A write was attempted through a ledger opened with ``open_readonly``."""


# ----------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class SpendRecord:
    """One recorded round: which run, which round index, which event, and its chain hash."""

    federation_id: str
    position: int
    run_id: str
    round_index: int
    event: Recorded  # a round, or a tuning release (tuning_release.py)
    created_at: str
    hash: str
    #: The participants the round could have sampled (``cohorts`` table); ``None``: every one.
    cohort: str | None = None


@dataclass(frozen=True)
class Participant:
    """A participant a round could sample, as the ledger charges it.

    ``identity`` is stable across runs (for data without item digests: the data set's declared
    identity plus the participant's index); ``name`` is what it registered as (for the operator);
    ``digest`` is the content digest of its data (recorded, a change reported, never a key).
    """

    identity: str
    name: str
    digest: str = ""
    #: The data as its items' content digests (ledger/overlap.py): when given, the participant is
    #: charged to every data record its items overlap, and ``identity`` keys nothing.
    items: DataItems | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.identity, str) or not self.identity:
            raise ValueError(f"identity must be a non-empty string; got {self.identity!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string; got {self.name!r}")


@dataclass(frozen=True)
class ParticipantExposure:
    """One participant's row in the operator's table (``ledger show --participants``).

    ``data_versions`` counts the distinct content digests its data had across runs (more than 1:
    the data was edited; the budget continued, as the add/remove relation covers edits).
    ``runs``: per run charged to it, ``(run id, spends charged, the run's spends)``: fewer charged
    than spent is the individual filter's exclusion (docs/privacy.md), the operator's to see.
    """

    key: str
    name: str
    rounds: int
    epsilon: float
    data_versions: int
    runs: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class BudgetRecord:
    """One budget of a data set: number ``n`` (1 = the first), who started it, when and why."""

    data_key: str
    number: int
    federation_id: str
    reason: str
    actor: str
    created_at: str
    hash: str


@dataclass(frozen=True)
class LedgerInfo:
    """What a ledger file says about itself (read-only). ``ledger_id is None``: legacy, no id."""

    path: Path
    ledger_id: str | None
    schema_version: int
    mode: LedgerMode | None
    created_at: str | None
    federations: tuple[str, ...]

    @property
    def legacy(self) -> bool:
        """Written before ledgers had an identity (schema 1); a writable open adds one."""
        return self.ledger_id is None


@dataclass(frozen=True)
class LedgerCheckpoint:
    """Where a run stood in the ledger: store it in every checkpoint, check it on resume.

    ``head`` is the hash of record ``position - 1`` (``None`` at position 0): with it a resumed run
    also refuses a ledger with the same id whose history diverged.
    """

    ledger_id: str | None
    path: str
    federation_id: str
    position: int
    head: str | None

    def __post_init__(self) -> None:
        if isinstance(self.position, bool) or not isinstance(self.position, int):
            raise ValueError(f"position must be an integer >= 0; got {self.position!r}")
        if self.position < 0:
            raise ValueError(f"position must be an integer >= 0; got {self.position!r}")
        if not isinstance(self.federation_id, str) or not self.federation_id:
            raise ValueError(
                f"federation_id must be a non-empty string; got {self.federation_id!r}"
            )
        if (self.head is None) != (self.position == 0):
            raise ValueError(
                f"head must be None exactly at position 0; got head {self.head!r} at position "
                f"{self.position}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict; ``LedgerCheckpoint.from_dict`` inverts it."""
        return {
            "ledger_id": self.ledger_id,
            "path": self.path,
            "federation_id": self.federation_id,
            "position": self.position,
            "head": self.head,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LedgerCheckpoint:
        """Rebuild (and validate) a checkpoint entry written by ``to_dict``."""
        return cls(
            ledger_id=data.get("ledger_id"),
            path=str(data.get("path", "")),
            federation_id=data["federation_id"],
            position=data["position"],
            head=data.get("head"),
        )


@dataclass(frozen=True)
class BackupResult:
    """A verified backup: where it is and how many records each federation holds there."""

    path: Path
    ledger_id: str | None
    positions: dict[str, int] = field(default_factory=dict)
