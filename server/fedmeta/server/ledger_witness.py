"""One ledger per data, and a witness the state directory's restore cannot reach (issue 39).

**One ledger per data.** A budget lives in one ledger file; another file would hold another,
fresh budget for the same data. Every ledger a production run opens is remembered, by absolute
path, in a registry beside the witnesses (``ledgers.json`` in ``fedmeta.paths.witness_dir()``).
A run that would open a ledger which records none of its data, while another known ledger (not
the same ledger moved: another ledger id) records some of it, is refused in one line naming the
other ledger, before anything is created. A relative ``FEDMETA_STATE_DIR`` (another state
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
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from fedmeta.accounting import BudgetLedger, DataItems, LedgerError, current_budget, ledger_holds
from fedmeta.config import Config
from fedmeta.paths import STATE_DIR_ENV, WITNESS_DIR_ENV, witness_dir
from fedmeta.server.budget_keys import budget_identity, budget_label
from fedmeta.server.transport import Registered

REGISTRY_NAME = "ledgers.json"
log = logging.getLogger("fedmeta.server")


class LedgerElsewhere(LedgerError):
    """The data's budget is recorded in another ledger than the one this run would open."""


def witness_file(ledger_path: Path) -> Path:
    """The witness of the ledger at ``ledger_path`` (an anchor file named after its path)."""
    name = hashlib.sha256(str(ledger_path).encode("utf-8")).hexdigest()[:24]
    return witness_dir() / f"{name}.anchor"


def watch_ledger(ledger: BudgetLedger, cfg: Config) -> None:
    """Check ``ledger`` against its witness, keep the witness current, remember the ledger.

    A witness directory that cannot be created (a read-only file system) weakens detection, it
    does not stop a run: one warning names it (a path, nothing of the data).
    """
    witness = witness_file(ledger.path)
    try:
        witness.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        log.warning("no ledger witness: cannot create %s (%s); set %s to a writable directory "
                    "outside the state directory", witness.parent, error.strerror,
                    WITNESS_DIR_ENV)  # fmt: skip
        return
    ledger.watch(witness)
    if _production(cfg):
        _remember(ledger.path)


def refuse_second_ledger(cfg: Config, path: Path, registered: Sequence[Registered]) -> None:
    """Refuse (``LedgerElsewhere``, one line) a ledger that would be a second one for this data."""
    state = os.environ.get(STATE_DIR_ENV)
    if state and not Path(state).expanduser().is_absolute():
        raise LedgerElsewhere(
            f"{STATE_DIR_ENV}={state} is a relative path: each working directory would have its "
            "own state directory, so its own budget for the same data; set it to an absolute "
            "path (the directory that holds the data's ledger)"
        )
    if not _production(cfg) or _records(cfg, path, registered):
        return
    for other in _known():
        if other == path or not other.is_file() or _same_ledger(other, path):
            continue
        if _records(cfg, other, registered):
            raise LedgerElsewhere(
                f"ledger {path} would be a second budget for data already recorded in ledger "
                f"{other}: spend from that one (privacy.ledger_path={other}, or the "
                f"{STATE_DIR_ENV} that holds it), or move it whole with `fedmeta ledger backup "
                f"--db {other} --to {path}`; nothing was spent"
            )


def _production(cfg: Config) -> bool:
    return cfg.privacy.experiment is None and cfg.privacy.insecure_test_seed is None


def _records(cfg: Config, path: Path, registered: Sequence[Registered]) -> bool:
    """Whether the ledger at ``path`` records any of this run's data."""
    if not path.is_file():
        return False
    declared = [d for d in (DataItems.from_text(r.data_fingerprint) for r in registered) if d]
    if declared:
        return ledger_holds(path, declared) > 0
    terms = current_budget(path, budget_identity(cfg, registered), label=budget_label(cfg))
    return terms is not None


def _same_ledger(one: Path, other: Path) -> bool:
    """Two paths of one ledger (a moved or backed-up copy): the same ledger id."""
    if not other.is_file():
        return False
    try:
        return BudgetLedger.describe(one).ledger_id == BudgetLedger.describe(other).ledger_id
    except LedgerError:
        return False


def _known() -> list[Path]:
    try:
        data = json.loads((witness_dir() / REGISTRY_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [Path(p) for p in data.get("ledgers", []) if isinstance(p, str)]


def _remember(path: Path) -> None:
    """Add ``path`` to the registry (atomically replaced; a failure only weakens the check)."""
    known = _known()
    if path in known:
        return
    target = witness_dir() / REGISTRY_NAME
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"ledgers": [str(p) for p in [*known, path]]}, indent=1))
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
