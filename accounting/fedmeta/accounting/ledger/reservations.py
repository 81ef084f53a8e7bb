"""Reservations: the rounds a run in progress may still charge, for the runs that start after it.

The individual filter decides who takes part in a run's rounds from the ledger *as the run found
it* and the run's own spends (allowance.py): it never reads what another run records meanwhile,
since a decision that followed what arrives during the run would be chosen adaptively (docs/
privacy.md, "Overlap and the individual filter"). Two runs over overlapping data at once would
then each decide without the other, and the ledger's re-check under its write lock would stop one
of them at ``budget_exhausted`` for a reason that follows the overlap: a private fact.

So a starting run *reserves*: it records, before its first spend, the cohort of its participants
(their data records, made then for items no record held), the costliest event a round of it can
have (its population at its smallest) and the rounds it may still take part in. A run that starts
later counts, for every record a reservation's cohort reaches, the reserved rounds not yet spent
as if spent: its decisions then leave room for the earlier run's remaining rounds, and the earlier
run, which never reads the later one, cannot take a record over the budget the later one checked.
A round of the earlier run is at most as costly as its reserved event (a two-stage round's
privacy profile grows with its sampling rates, which a smaller population only raises), so its
actual rounds are dominated by the reserved ones (errs high: the later run may exclude more).

Reserving and reading the others' reservations happen in one write transaction, so of two runs
starting at once the second sees the first. A reservation ends with an end row when the run ends
(any stop but an interruption, which a resume continues; a resume reserves again, superseding).
A run that crashed keeps its reservation until it is resumed or the operator ends it
(``fedmeta ledger end-reservation``): erring towards excluding. Append-only, like every ledger
table. Operator-only: which runs reserved which participants' records is as private as the ledger.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from fedmeta.accounting.checks import check_int
from fedmeta.accounting.ledger.chain import canonical_json
from fedmeta.accounting.ledger.cohorts import coarse_day
from fedmeta.accounting.ledger.records import LedgerCorrupted
from fedmeta.accounting.ledger.storage import (
    absolute_path,
    classify_error,
    connect_writable,
    ensure_schema,
    immediate_transaction,
    table_names,
)
from fedmeta.accounting.tuning_release import Recorded, recorded_from_dict

__all__ = [
    "Hold",
    "Reservation",
    "active_reservations",
    "end_if_held",
    "end_reservation",
    "end_run_reservation",
    "recorded_count",
    "write_reservation",
]


@dataclass(frozen=True)
class Reservation:
    """A run's reserved rounds: ``rounds`` of ``event`` at most, charged to ``cohort_id``'s keys.

    ``position``: the ledger's number of records when it was made (the run's later spends are
    those of its records from there).
    """

    run_id: str
    cohort_id: str
    event: Recorded
    rounds: int
    position: int


@dataclass(frozen=True)
class Hold:
    """What a run's decisions read, fixed when it started or resumed (individual.py).

    ``since``: the ledger's records then; ``others``: the reservations of the runs then in
    progress, the run's own excluded.
    """

    since: int
    others: tuple[Reservation, ...] = ()

    def __post_init__(self) -> None:
        check_int("since", self.since, minimum=0)


def write_reservation(conn: sqlite3.Connection, federation_id: str, made: Reservation) -> None:
    """Append ``made`` (inside the caller's write transaction)."""
    check_int("rounds", made.rounds, minimum=0)
    event = canonical_json(made.event.to_dict())
    _append(conn, (federation_id, made.run_id, made.cohort_id, event, made.rounds, made.position))


def end_reservation(
    conn: sqlite3.Connection, federation_id: str, run_id: str, position: int
) -> None:
    """Append the end of ``run_id``'s reservation (inside the caller's write transaction)."""
    _append(conn, (federation_id, run_id, None, None, 0, position))


def recorded_count(conn: sqlite3.Connection, federation_id: str) -> int:
    """The federation's number of spend records on disk: where a reservation is made or ended."""
    (count,) = conn.execute(
        "SELECT COUNT(*) FROM spends WHERE federation_id = ?", (federation_id,)
    ).fetchone()
    return int(count)


def _append(conn: sqlite3.Connection, row: tuple[object, ...]) -> None:
    conn.execute(
        "INSERT INTO reservations (federation_id, run_id, cohort_id, event, rounds, position, "
        "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (*row, coarse_day()),
    )


def active_reservations(
    conn: sqlite3.Connection, path: Path, federation_id: str
) -> list[Reservation]:
    """Each run's last reservation no end row followed; none in a ledger older than the table."""
    tables = table_names(conn)
    if "reservations" not in tables:
        return []
    last: dict[str, tuple[str | None, str | None, int, int]] = {}
    for run_id, cid, event, rounds, position in conn.execute(
        "SELECT run_id, cohort_id, event, rounds, position FROM reservations "
        "WHERE federation_id = ? ORDER BY seq",
        (federation_id,),
    ):
        last[str(run_id)] = (cid, event, int(rounds), int(position))
    out = []
    for run_id, (cid, event, rounds, position) in last.items():
        if cid is None:
            continue  # ended
        try:
            decoded = recorded_from_dict(json.loads(str(event)))
        except (ValueError, KeyError, TypeError) as error:
            raise LedgerCorrupted(
                f"ledger {path}, federation {federation_id!r}: the reservation of run {run_id!r} "
                f"holds no valid event ({error}); it was edited outside fedmeta"
            ) from None
        out.append(Reservation(run_id, str(cid), decoded, rounds, position))
    return out


def end_if_held(conn: sqlite3.Connection, path: Path, federation_id: str, run_id: str) -> bool:
    """End ``run_id``'s reservation if it holds one (inside the caller's write transaction)."""
    held = any(r.run_id == run_id for r in active_reservations(conn, path, federation_id))
    if held:
        end_reservation(conn, federation_id, run_id, recorded_count(conn, federation_id))
    return held


def end_run_reservation(path: str | Path, federation_id: str, run_id: str) -> bool:
    """``fedmeta ledger end-reservation``: end a run's reservation; whether it had one.

    For a run that crashed and will not be resumed (a resume reserves anew). Ending the
    reservation of a run still in progress never overspends (the ledger's re-check under its lock
    still refuses), but later starts then leave it no room: it may stop at ``budget_exhausted``.
    """
    path = absolute_path(path)
    conn = connect_writable(path, create=False)
    try:
        ensure_schema(conn, path, None)
        with immediate_transaction(conn):
            return end_if_held(conn, path, federation_id, run_id)
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()
