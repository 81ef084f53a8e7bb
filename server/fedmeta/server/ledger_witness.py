"""One ledger per data, and a witness the state directory's restore cannot reach (issue 39).

**One ledger per data.** A budget lives in one ledger file; another file would hold another,
fresh budget for the same data. Every ledger a production run opens is remembered, by absolute
path, in the registry of ledgers: one per account at a fixed place, or one shared by several
accounts or machines (server/fedmeta/server/ledger_registry.py). A run whose data, in whole or in
part, is recorded in another remembered ledger (not the same ledger moved: another ledger id) is
refused in one line naming that ledger, before anything is created, whether or not its own ledger
records some of the data too (issue 52). A relative ``FEDMETA_STATE_DIR`` (another state
directory from each working directory) is refused the same way. Experiments (public data, their
own ledgers by design) and the reproducible test mode are outside this rule.

**A witness outside the state directory.** After every spend the ledger writes its anchor (ledger
id, spend count, last spend's row and hash) beside itself *and* to a witness file named after the
ledger's absolute path in the witness directory (``$FEDMETA_WITNESS_DIR``, else a sibling of the
state directory); every open compares the ledger with it (accounting ledger/anchor.py,
``check_witness``). The anchor beside the ledger catches an older copy of the ledger file alone;
the witness also catches the whole state directory restored (ledger and anchor together), an old
ledger without an anchor, and a ledger deleted and recreated. What it cannot catch: the witness
restored or deleted together with the state directory (keep it on other storage), or an
adversary with write access to both.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from fedmeta.accounting import BudgetLedger, DataItems, LedgerError, ledger_holds
from fedmeta.config_privacy import PrivacyConfig
from fedmeta.paths import STATE_DIR_ENV, WITNESS_DIR_ENV, witness_dir
from fedmeta.server.budget_keys import BudgetKey, recorded_terms
from fedmeta.server.ledger_registry import check_writable, known_ledgers, remember
from fedmeta.server.transport import Registered

log = logging.getLogger("fedmeta.server")


class LedgerElsewhere(LedgerError):
    """The data's budget is recorded in another ledger than the one this run would open."""


def witness_file(ledger_path: Path) -> Path:
    """The witness of the ledger at ``ledger_path`` (an anchor file named after its path)."""
    name = hashlib.sha256(str(ledger_path).encode("utf-8")).hexdigest()[:24]
    return witness_dir() / f"{name}.anchor"


def watch_ledger(ledger: BudgetLedger, privacy: PrivacyConfig) -> None:
    """Remember the ledger in the registry, check it against its witness, keep the witness current.

    A witness directory that cannot be created (a read-only file system) weakens detection, it
    does not stop a run: one warning names it (a path, nothing of the data). A registry that
    cannot be updated does (ledger_registry.py).
    """
    if _production(privacy):
        remember(ledger.path, ledger.ledger_id)
    witness = witness_file(ledger.path)
    try:
        witness.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        log.warning("no ledger witness: cannot create %s (%s); set %s to a writable directory "
                    "outside the state directory", witness.parent, error.strerror,
                    WITNESS_DIR_ENV)  # fmt: skip
        return
    ledger.watch(witness)


def refuse_second_ledger(
    privacy: PrivacyConfig, key: BudgetKey, path: Path, registered: Sequence[Registered], *,
    writing: bool = True,
) -> None:  # fmt: skip
    """Refuse (``LedgerElsewhere``, one line) a ledger that would be a second one for this data.

    Every remembered ledger (the account's or the shared registry, ledger_registry.py) other than
    this one (another ledger id: a moved copy is the same ledger) that records any of the run's
    data, in whole or in part, refuses it, whether or not this ledger records some of it too:
    each would hold part of the data's budget (issue 52, items 1 and 4). ``writing``: also check,
    before anything is created, that the registry can be updated (a dry run writes nothing).
    """
    state = os.environ.get(STATE_DIR_ENV)
    if state and not Path(state).expanduser().is_absolute():
        raise LedgerElsewhere(
            f"{STATE_DIR_ENV}={state} is a relative path: each working directory would have its "
            "own state directory, so its own budget for the same data; set it to an absolute "
            "path (the directory that holds the data's ledger)"
        )
    if not _production(privacy):
        return
    if writing:
        check_writable()
    for other in known_ledgers():
        if other == path or _same_ledger(other, path):
            continue
        if not other.is_file():
            log.warning("the registered ledger %s is missing: data it recorded is not checked "
                        "against it (restore it, or see docs/ledger.md)", other)  # fmt: skip
            continue
        if _records(key, other, registered):
            raise LedgerElsewhere(_second_ledger_reason(key, path, other, registered))


def _second_ledger_reason(
    key: BudgetKey, path: Path, other: Path, registered: Sequence[Registered]
) -> str:
    """One line: which ledger records the data, and what to do."""
    if _records(key, path, registered):
        return (
            f"ledger {path} would be a second budget for data already recorded in ledger {other} "
            "(in part: both ledgers record some of this run's data, so neither holds its whole "
            "budget): run each part on the ledger that records it, or only data that ledger "
            "records; nothing was spent"
        )
    return (
        f"ledger {path} would be a second budget for data already recorded in ledger "
        f"{other}: spend from that one (privacy.ledger_path={other}, or the "
        f"{STATE_DIR_ENV} that holds it), or move it whole with `fedmeta ledger backup "
        f"--db {other} --to {path}`; nothing was spent"
    )


def _production(privacy: PrivacyConfig) -> bool:
    return privacy.experiment is None and privacy.insecure_test_seed is None


def _records(key: BudgetKey, path: Path, registered: Sequence[Registered]) -> bool:
    """Whether the ledger at ``path`` records any of this run's data."""
    if not path.is_file():
        return False
    declared = [d for d in (DataItems.from_text(r.data_fingerprint) for r in registered) if d]
    if declared:
        return ledger_holds(path, declared) > 0
    return recorded_terms(path, key) is not None


def _same_ledger(one: Path, other: Path) -> bool:
    """Two paths of one ledger (a moved or backed-up copy): the same ledger id."""
    if not other.is_file():
        return False
    try:
        return BudgetLedger.describe(one).ledger_id == BudgetLedger.describe(other).ledger_id
    except LedgerError:
        return False
