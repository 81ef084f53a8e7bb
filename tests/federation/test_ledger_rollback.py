"""Rollback detection (issue 18, item 4): an older ledger copy is refused in one line naming what
was found and the command that accepts it (recorded); a resume after the state directory was
deleted is refused in one line naming the file to restore, before any new ledger is created."""

from __future__ import annotations

import re
import shlex
import shutil
import sqlite3
from pathlib import Path

import pytest

from fedmeta.accounting import (
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    LedgerRolledBack,
)
from fedmeta.cli import main
from fedmeta.config_io import load_config
from fedmeta.server.app import execute
from fedmeta.server.startup import FederationError
from fedmeta.simulation.local_grid import InProcessGrid

from .test_round import SMALL

EVENT = GaussianRound(FlatPoissonScheme(0.05), 1.0)


def _accept(message: str, reason: str) -> int:
    command = re.search(r"`(fedmeta ledger accept-rollback [^`]*)`", message)
    assert command is not None, message
    argv = shlex.split(command.group(1).replace("TEXT", shlex.quote(reason)))[1:]
    return main(argv)


@pytest.mark.unit
def test_an_older_copy_of_the_ledger_is_refused_until_accepted(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 5.0, 1e-5) as ledger:
        ledger.spend(EVENT, "run", 0)
    shutil.copy(db, tmp_path / "old.sqlite")  # an operator's earlier copy
    with BudgetLedger.open(db, "fed") as ledger:
        ledger.spend(EVENT, "run", 1)
        ledger.spend(EVENT, "run", 2)
    shutil.copy(tmp_path / "old.sqlite", db)  # restored over the newer ledger
    with pytest.raises(LedgerRolledBack) as refused:
        BudgetLedger.open(db, "fed")
    message = str(refused.value)
    assert "\n" not in message and "3 spend(s)" in message and "holds 1" in message
    assert _accept(message, "restored the 09:00 copy after disk failure") == 0
    with BudgetLedger.open(db, "fed") as ledger:  # accepted: runs go on, and the anchor follows
        assert ledger.position() == 1
        ledger.spend(EVENT, "run", 3)
    conn = sqlite3.connect(db)
    reasons = [r[0] for r in conn.execute("SELECT reason FROM rollbacks")]
    conn.close()
    assert reasons == ["restored the 09:00 copy after disk failure"]


@pytest.mark.unit
def test_a_ledger_replaced_by_another_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 5.0, 1e-5) as ledger:
        ledger.spend(EVENT, "run", 0)
    db.unlink()  # the ledger deleted, its anchor left beside it
    with pytest.raises(LedgerRolledBack, match="replaced or recreated"):
        BudgetLedger.open(db, "fed", 5.0, 1e-5)


@pytest.mark.integration
def test_deleting_the_state_directory_and_resuming_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = load_config(None, [*SMALL, f"privacy.ledger_path={state / 'ledger.sqlite'}",
                             "rounds=4", "training.checkpoint_every=2"])  # fmt: skip
    out = tmp_path / "run"
    execute(cfg, InProcessGrid(6), out_dir=out, observers=[], echo=False)
    more = cfg.model_copy(update={"rounds": 6})
    shutil.rmtree(state)
    state.mkdir()
    # The checkpoint records the ledger it spent from: a resume refuses before creating anything.
    with pytest.raises(FederationError) as refused:
        execute(more, InProcessGrid(6), out_dir=out, resume=True, observers=[], echo=False)
    message = str(refused.value)
    assert "\n" not in message and str(state / "ledger.sqlite") in message
    assert "missing" in message and "restore" in message
    assert list(state.iterdir()) == []  # no stray empty ledger that would restart the count
