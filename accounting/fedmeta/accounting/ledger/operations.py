"""Operator commands on data-keyed budgets: resolve, new budget, list, migrate, accept rollback."""

from __future__ import annotations

import math
import re
import sqlite3
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from fedmeta.accounting.ledger.anchor import (
    Anchor,
    anchor_path,
    behind,
    current_anchor,
    read_anchor,
    record_acceptance,
    write_anchor,
)
from fedmeta.accounting.ledger.budget import (
    BudgetLedger,
)
from fedmeta.accounting.ledger.chain import (
    append_budget,
    budget_chain,
    data_key_of,
    default_actor,
)
from fedmeta.accounting.ledger.cohorts import coarse_day, label_of, legacy_uncarried
from fedmeta.accounting.ledger.inherit import inherit_labels
from fedmeta.accounting.ledger.records import (
    FIRST_BUDGET_REASON,
    BudgetRecord,
    LedgerError,
    LedgerMode,
)
from fedmeta.accounting.ledger.registration import find_registration
from fedmeta.accounting.ledger.storage import (
    absolute_path,
    check_federation_id,
    check_mode,
    classify_error,
    connect_readonly,
    connect_writable,
    ensure_schema,
    immediate_transaction,
    read_meta,
    read_transaction,
)
from fedmeta.accounting.schemes import Neighbouring, Unit, check_delta

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


# ------------------------------------------------------------------------ data-keyed budgets


def _check_label(label: object) -> None:
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise ValueError(
            "label must be 1-64 characters of letters, digits, '.', '_' or '-' starting with a "
            f"letter or digit (it names the federation in logs and metrics); got {label!r}"
        )


def resolve_federation(
    path: str | Path,
    data_identity: str,
    *,
    label: str,
    create: bool = True,
    mode: LedgerMode = "secure",
    inherit: Collection[str] = (),
) -> str:
    """The federation id of the *current budget* for the data named by ``data_identity``.

    The id is ``f"{label}-{HMAC-SHA256(salt, data_identity)[:16 hex]}"`` (``-b2``, ``-b3``, ...
    for later budgets, see ``start_new_budget``), with a random salt kept in the ledger: it does
    not reveal the data, not even whether two neighbouring data sets were used. (A deterministic
    hash of private data, released in logs and metrics, would.) The ledger file must therefore be
    kept as private as the server's checkpoints. ``create=True`` creates the ledger and the first
    budget when missing (recorded, with who and when); ``create=False`` only reads. ``inherit``:
    labels whose current budgets a newly created first budget inherits (ledger/inherit.py).
    """
    if not isinstance(data_identity, str) or not data_identity:
        raise ValueError(f"data_identity must be a non-empty string; got {data_identity!r}")
    _check_label(label)
    check_mode(mode)
    path = absolute_path(path)
    if not create:
        return _resolve_readonly(path, data_identity, label)
    conn = connect_writable(path, create=True)
    try:
        meta = ensure_schema(conn, path, mode)
        key = data_key_of(meta["salt"], data_identity, label)
        with immediate_transaction(conn):
            chain = budget_chain(conn, path, meta["ledger_id"], key)
            if not chain:
                _refuse_unmigrated(conn, path, meta, label)
                chain = [
                    append_budget(
                        conn, meta["ledger_id"], key, (), FIRST_BUDGET_REASON, default_actor()
                    )
                ]
                if inherit:
                    inherit_labels(conn, chain[0].federation_id, inherit, coarse_day())
        return chain[-1].federation_id
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()


def _refuse_unmigrated(
    conn: sqlite3.Connection, path: Path, meta: Mapping[str, str], label: str
) -> None:
    """A first per-participant budget must not start while schema-2 spends of its label wait.

    Schema 2 keyed a budget by every participant's data together, so those spends cannot be told
    apart by participant; starting afresh beside them would forget them.
    """
    legacy = legacy_uncarried(conn, meta, label)
    if legacy:
        raise LedgerError(
            f"ledger {path} holds spends keyed by whole data sets (schema 2) for {label!r} "
            f"({', '.join(legacy)}); carry them to every participant with `fedmeta ledger "
            f"migrate --db {path}` (recorded), then rerun"
        )


def migrate_to_participants(path: str | Path, *, who: str | None = None) -> list[str]:
    """Carry every schema-2 budget's spends into the per-participant budgets of its label.

    Conservative: each carried spend counts against *every* participant of the first
    per-participant budget of the same label (the old records do not say who could have been
    sampled). Recorded (who, when), append-only. Returns the carried federation ids.
    """
    path = absolute_path(path)
    conn = connect_writable(path, create=False)
    try:
        meta = ensure_schema(conn, path, None)
        with immediate_transaction(conn):
            legacy = legacy_uncarried(conn, meta, None)
            keys = dict(conn.execute("SELECT federation_id, data_key FROM budgets"))
            conn.executemany(
                "INSERT INTO carried (federation_id, label, actor, created_at) VALUES (?, ?, ?, ?)",
                [
                    (fid, label_of(keys[fid]), who or default_actor(), coarse_day())
                    for fid in legacy
                ],
            )
        return legacy
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()


def accept_rollback(
    path: str | Path,
    reason: str,
    *,
    ledger_id: str | None = None,
    head: str | None = None,
    who: str | None = None,
) -> str:
    """Accept, deliberately and on record, that the ledger is behind an anchor; say what was found.

    Without ``ledger_id``/``head`` the anchor is the file beside the ledger; with them, the spend
    a checkpoint recorded (``LedgerCheckpoint``). The acceptance is appended to the ledger (who,
    which day, why); the anchor file then follows the ledger. Spent budget that the restored file
    lacks is *not* private again: this only lets runs go on, as ``new-budget`` does.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"reason must be a non-empty text saying why; got {reason!r}")
    path = absolute_path(path)
    conn = connect_writable(path, create=False)
    try:
        meta = ensure_schema(conn, path, None)
        with immediate_transaction(conn):
            found, anchor = _rollback_found(conn, path, meta["ledger_id"], ledger_id, head)
            record_acceptance(
                conn, anchor[0], anchor[1], found, reason.strip(), who or default_actor()
            )
            now = current_anchor(conn, meta["ledger_id"])
        if now is None:
            anchor_path(path).unlink(missing_ok=True)
        else:
            write_anchor(path, now)
        return found
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()


def _rollback_found(
    conn: sqlite3.Connection, path: Path, own_id: str, ledger_id: str | None, head: str | None
) -> tuple[str, tuple[str, str]]:
    """What the ledger lacks and the (ledger id, head) accepted; refuses if it lacks nothing."""
    if ledger_id and head:
        anchor = Anchor(ledger_id, 0, -1, head)
        known = (
            ledger_id == own_id
            and conn.execute("SELECT 1 FROM spends WHERE hash = ?", (head,)).fetchone()
        )
        found = None if known else f"ledger {ledger_id}'s spend {head[:12]} is not in {path}"
    else:
        saved = read_anchor(anchor_path(path))
        if saved is None:
            raise LedgerError(f"no anchor beside {path}: nothing to accept")
        anchor, found = saved, behind(conn, own_id, saved)
    if found is None:
        raise LedgerError(f"ledger {path} is not behind that anchor: nothing to accept")
    return found, (anchor.ledger_id, anchor.head)


def _resolve_readonly(path: Path, data_identity: str, label: str) -> str:
    conn = connect_readonly(path)
    try:
        with read_transaction(conn):
            federation = _current_federation(conn, path, data_identity, label)
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()
    if federation is None:
        raise LedgerError(
            f"ledger {path} has no budget for this data under label {label!r}; resolve with "
            "create=True (a run) to start one"
        )
    return federation


def _current_federation(
    conn: sqlite3.Connection, path: Path, data_identity: str, label: str
) -> str | None:
    """The id of the data's current budget, read inside the caller's transaction; None if none."""
    meta = read_meta(conn)
    if "salt" not in meta:
        raise LedgerError(
            f"ledger {path} has no budgets (legacy, no id: written by an older fedmeta)"
        )
    key = data_key_of(meta["salt"], data_identity, label)
    chain = budget_chain(conn, path, meta["ledger_id"], key)
    return chain[-1].federation_id if chain else None


@dataclass(frozen=True)
class BudgetTerms:
    """The current budget of one data set: its federation id and, once set, epsilon and delta.

    ``epsilon_budget``/``delta`` are None while the budget is started but not yet set (a
    ``new-budget`` without terms: the next run's configuration sets them).
    """

    federation_id: str
    epsilon_budget: float | None
    delta: float | None


def current_budget(path: str | Path, data_identity: str, *, label: str) -> BudgetTerms | None:
    """The terms of the data's current budget in the ledger at ``path``; None if it has none.

    Read-only and cheap (spends are not verified here: the run that spends opens the ledger,
    which verifies everything). None when the file does not exist or holds no budget for this
    data.
    """
    path = absolute_path(path)
    if not path.is_file():
        return None
    conn = connect_readonly(path)
    try:
        with read_transaction(conn):  # one snapshot: the current budget and its terms
            federation = _current_federation(conn, path, data_identity, label)
            row = None if federation is None else find_registration(conn, path, federation)
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()
    if federation is None:
        return None
    if row is None:
        return BudgetTerms(federation, None, None)
    return BudgetTerms(federation, row.epsilon_budget, row.delta)


def start_new_budget(
    path: str | Path,
    federation_id: str,
    reason: str,
    *,
    who: str | None = None,
    epsilon_budget: float | None = None,
    delta: float | None = None,
) -> str:
    """Start a new budget for the data whose *current* budget is ``federation_id``; return its id.

    An explicit, recorded act (who, when, why; hash-chained and append-only): afterwards
    ``resolve_federation`` returns the new id and runs spend from a fresh budget. The old
    federation and its spends stay in the ledger. ``federation_id`` must be the current budget
    (two operators cannot both start "the next" one). ``epsilon_budget`` (with ``delta``, default
    the old budget's) sets the new budget's terms now, with the old one's unit and relation;
    without it the next run's configuration sets them.
    """
    if delta is not None and epsilon_budget is None:
        raise ValueError("delta needs epsilon_budget: a new budget's terms are set together")
    terms = _terms_like(path, federation_id, epsilon_budget, delta)
    new_id = _start_new_budget(path, federation_id, reason, who=who)
    if terms is not None:
        eps, dlt, unit, relation, mode = terms
        BudgetLedger.open(
            path, new_id, eps, dlt, unit=unit, neighbouring=relation, mode=mode, create=True
        ).close()
    return new_id


def _terms_like(
    path: str | Path, federation_id: str, epsilon_budget: float | None, delta: float | None
) -> tuple[float, float, Unit, Neighbouring, LedgerMode] | None:
    """A new budget's terms: the given epsilon (and delta), the old budget's unit and relation.

    Checked before anything is recorded, so a bad value starts no budget.
    """
    if epsilon_budget is None:
        return None
    try:
        old = BudgetLedger.open_readonly(path, federation_id)
    except LedgerError:  # a budget started but never set: no old terms to carry
        if delta is None:
            raise LedgerError(
                f"federation {federation_id!r} has no terms to carry over (never spent on): "
                "give the new budget's delta too"
            ) from None
        _check_terms(epsilon_budget, delta)
        return float(epsilon_budget), float(delta), "task", "add_remove", "secure"
    try:
        terms = (float(epsilon_budget), float(old.delta if delta is None else delta), old.unit,
                 old.neighbouring, old.mode or "secure")  # fmt: skip
    finally:
        old.close()
    _check_terms(terms[0], terms[1])
    return terms


def _check_terms(epsilon_budget: float, delta: float) -> None:
    if not (math.isfinite(epsilon_budget) and epsilon_budget > 0):
        raise ValueError(f"epsilon_budget must be a finite number > 0; got {epsilon_budget!r}")
    check_delta(delta)


def _start_new_budget(
    path: str | Path, federation_id: str, reason: str, *, who: str | None = None
) -> str:
    check_federation_id(federation_id)
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"reason must be a non-empty text saying why; got {reason!r}")
    if who is not None and (not isinstance(who, str) or not who.strip()):
        raise ValueError(f"who must be a non-empty string or None; got {who!r}")
    path = absolute_path(path)
    conn = connect_writable(path, create=False)
    try:
        meta = ensure_schema(conn, path, None)
        with immediate_transaction(conn):
            row = conn.execute(
                "SELECT data_key FROM budgets WHERE federation_id = ?", (federation_id,)
            ).fetchone()
            if row is None:
                raise LedgerError(
                    f"federation {federation_id!r} has no budget record in {path}: new budgets "
                    "apply to data-keyed federations (named by resolve_federation)"
                )
            chain = budget_chain(conn, path, meta["ledger_id"], str(row[0]))
            if chain[-1].federation_id != federation_id:
                raise LedgerError(
                    f"federation {federation_id!r} is not the current budget of its data; the "
                    f"current one is {chain[-1].federation_id!r}: start a new budget from it"
                )
            record = append_budget(
                conn, meta["ledger_id"], str(row[0]), chain, reason.strip(), who or default_actor()
            )
        return record.federation_id
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()


def budgets(path: str | Path) -> list[BudgetRecord]:
    """Every budget recorded in the ledger at ``path``, by data key then number (read-only)."""
    path = absolute_path(path)
    conn = connect_readonly(path)
    try:
        with read_transaction(conn):
            meta = read_meta(conn)
            if "ledger_id" not in meta:
                return []
            keys = [str(r[0]) for r in conn.execute("SELECT DISTINCT data_key FROM budgets")]
            return [
                record
                for key in sorted(keys)
                for record in budget_chain(conn, path, meta["ledger_id"], key)
            ]
    except sqlite3.Error as error:
        raise classify_error(path, error) from error
    finally:
        conn.close()
