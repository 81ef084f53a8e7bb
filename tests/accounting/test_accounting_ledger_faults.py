"""Resource faults (issue 21): a full or read-only state directory gives one line naming the path
and what to free or change, never "internal error"; a failed spend records nothing, and a spend
that did record is reported as recorded (the round is released exactly when its spend is durable).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tests.accounting.readonly_mount import need_readonly_mount

from fedmeta.accounting import (
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    LedgerError,
    LedgerUnwritable,
)
from fedmeta.accounting.ledger.faults import ensure_directory

REPO = Path(__file__).resolve().parents[2]
CHEAP = GaussianRound(FlatPoissonScheme(0.01), 1.0)


class _FailingConnection:
    """A connection that fails one kind of statement with a given SQLite error, like a full disk.

    SQLite rolls a transaction back by itself after SQLITE_FULL; ``auto_rollback`` reproduces
    that, so the ledger's own ROLLBACK meets "no transaction is active" (the bug of issue 21).
    """

    def __init__(self, conn: sqlite3.Connection, fail_on: str, code: int, auto_rollback: bool):
        self._conn, self._fail_on, self._code, self._auto = conn, fail_on, code, auto_rollback

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.startswith(self._fail_on):
            if self._auto:
                self._conn.execute("ROLLBACK")
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = self._code  # type: ignore[attr-defined]
            raise error
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.unit
@pytest.mark.parametrize("fail_on", ["INSERT INTO spends", "COMMIT"])
@pytest.mark.parametrize("auto_rollback", [True, False])
def test_a_full_disk_during_a_spend_is_one_line_and_records_nothing(
    tmp_path: Path, fail_on: str, auto_rollback: bool
) -> None:
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 3.0, 1e-6) as ledger:
        ledger.spend(CHEAP, "run", 0)
        real = ledger._conn
        ledger._conn = _FailingConnection(real, fail_on, 13, auto_rollback)  # type: ignore[assignment]
        with pytest.raises(LedgerUnwritable) as raised:
            ledger.spend(CHEAP, "run", 1)
        ledger._conn = real
        assert ledger.position() == 1
    message = str(raised.value)
    assert "\n" not in message and str(db) in message and "no space left" in message
    # No advice to spend from another ledger file: that would be a fresh budget (issue 39).
    assert "nothing was recorded" in message and "elsewhere" not in message
    assert "another ledger file would not hold it" in message
    assert "no transaction is active" not in message
    with BudgetLedger.open_readonly(db, "fed") as reread:
        assert [r.round_index for r in reread.records()] == [0]


@pytest.mark.unit
def test_a_commit_that_landed_despite_an_error_is_reported_as_recorded(tmp_path: Path) -> None:
    """If SQLite reports an error after its commit point, the spend is read back, not denied:
    denying it would let the caller skip a release whose spend is on record (harmless), but
    reporting "nothing was recorded" would be false."""
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 3.0, 1e-6) as ledger:
        real = ledger._conn

        class _CommitThenFail(_FailingConnection):
            wrote = False

            def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
                self.wrote = self.wrote or sql.startswith("INSERT INTO heads")
                if sql == "COMMIT" and self.wrote:  # the spend's commit, not a read's
                    self.wrote = False
                    real.execute("COMMIT")
                    error = sqlite3.OperationalError("disk I/O error")
                    error.sqlite_errorcode = 10  # type: ignore[attr-defined]
                    raise error
                return real.execute(sql, *args)

        ledger._conn = _CommitThenFail(real, "COMMIT", 10, False)  # type: ignore[assignment]
        record = ledger.spend(CHEAP, "run", 0)
        ledger._conn = real
        assert record.position == 0 and ledger.position() == 1


@pytest.mark.unit
def test_a_state_directory_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory should be")
    with pytest.raises(LedgerError) as raised:
        ensure_directory(blocker / "ledger" / "ledger.sqlite")
    assert "\n" not in str(raised.value) and str(blocker / "ledger") in str(raised.value)


_FILL = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from fedmeta.accounting import BudgetLedger, FlatPoissonScheme, GaussianRound, LedgerError
    state = Path(sys.argv[1])
    db = state / "ledger.sqlite"
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    ledger = BudgetLedger.open(db, "fed", 3.0, 1e-6)
    ledger.spend(event, "run", 0)
    with open(state / "filler", "wb", buffering=0) as handle:  # fill it to the last block
        try:
            while True:
                handle.write(b"x" * 4096)
        except OSError:
            pass
    out = {}
    try:
        for i in range(1, 200):  # a few spends may still fit in pages SQLite already holds
            ledger.spend(event, "run", i)
        out["error"] = None
    except LedgerError as error:
        out["error"] = [type(error).__name__, str(error)]
    (state / "filler").unlink()
    ledger.close()
    with BudgetLedger.open(db, "fed") as again:
        out["position"] = again.position()
        out["rounds"] = [r.round_index for r in again.records()]
    print(json.dumps(out))
    """
)


@pytest.mark.integration
def test_a_really_full_file_system_is_one_line_and_the_ledger_stays_whole(tmp_path: Path) -> None:
    """A 256 KB tmpfs in a private mount namespace (root only; skipped elsewhere, with why)."""
    state = tmp_path / "state"
    state.mkdir()
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("a full-disk test needs root and `unshare` to mount a private tmpfs")
    script = 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(state),
         sys.executable, "-c", _FILL, str(state)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["error"] is not None, "the file system never filled"
    name, message = out["error"]
    assert name == "LedgerUnwritable" and "\n" not in message
    assert str(state / "ledger.sqlite") in message and "no space left" in message
    # every acknowledged spend is there, in order, and none that failed
    assert out["rounds"] == list(range(out["position"])) and out["position"] >= 1


_READONLY_SPEND = textwrap.dedent(
    """
    import json, sys
    from fedmeta.accounting import BudgetLedger, LedgerError
    from fedmeta.accounting.ledger.faults import ensure_directory
    from pathlib import Path
    out = {}
    for name, call in (
        ("open", lambda: BudgetLedger.open(sys.argv[1], "fed", 3.0, 1e-6)),
        ("mkdir", lambda: ensure_directory(Path(sys.argv[2]) / "new" / "ledger.sqlite")),
    ):
        try:
            call()
            out[name] = None
        except LedgerError as error:
            out[name] = [type(error).__name__, str(error)]
    print(json.dumps(out))
    """
)


@pytest.mark.integration
def test_a_read_only_state_directory_is_one_line_naming_what_to_change(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 3.0, 1e-6) as ledger:
        ledger.spend(CHEAP, "run", 0)
    prefix = need_readonly_mount(state)
    run = subprocess.run(
        [*prefix, sys.executable, "-c", _READONLY_SPEND, str(db), str(state)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for name in ("open", "mkdir"):
        assert out[name] is not None and "\n" not in out[name][1], out
        assert "read-only" in out[name][1] and str(state) in out[name][1]
        assert "privacy.ledger_path" in out[name][1]
