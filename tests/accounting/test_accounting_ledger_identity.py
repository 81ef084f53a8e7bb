"""The ledger's identity, schema-1 migration, secure/insecure modes, relations, resume checks,
data-keyed budgets, and ``fedmeta ledger show|new-budget``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from tests.accounting.schema1 import write_schema1_ledger

from fedmeta.accounting import (
    PARTICIPANT_LEVEL_NOT_MEANINGFUL,
    BudgetLedger,
    BudgetTerms,
    FlatPoissonScheme,
    GaussianRound,
    LedgerCheckpoint,
    LedgerCorrupted,
    LedgerError,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    budgets,
    current_budget,
    epsilon,
    participant_level_note,
    resolve_federation,
    start_new_budget,
)

REPO = Path(__file__).resolve().parents[2]
CHEAP = GaussianRound(FlatPoissonScheme(0.01), 1.0)
POISSON = GaussianRound(TwoStagePoissonScheme(20, 4, 0.5), 2.0, max_tasks_per_participant=10)
DATA = "omniglot|sha256:0f1e2d|P20|T30"


def _file_state(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def _fedmeta(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedmeta.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.unit
def test_a_new_ledger_has_an_identity_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with BudgetLedger.open("ledger.sqlite", "fed", 2.0, 1e-6) as ledger:
        assert ledger.path == (tmp_path / "ledger.sqlite").resolve() and ledger.path.is_absolute()
        first_id = ledger.ledger_id
        assert first_id is not None and len(first_id) == 32 and int(first_id, 16) >= 0
    with BudgetLedger.open(tmp_path / "ledger.sqlite", "other", 1.0, 1e-6) as again:
        assert again.ledger_id == first_id  # the file's identity, not the federation's
    info = BudgetLedger.describe(tmp_path / "ledger.sqlite")
    assert (info.ledger_id, info.schema_version, info.mode) == (first_id, 3, "secure")
    assert not info.legacy and info.federations == ("fed", "other")
    with BudgetLedger.open(tmp_path / "second.sqlite", "fed", 2.0, 1e-6) as second:
        assert second.ledger_id != first_id
    conn = sqlite3.connect(tmp_path / "ledger.sqlite")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("UPDATE meta SET value = 'x' WHERE key = 'ledger_id'")
    conn.close()


@pytest.mark.unit
def test_a_schema1_ledger_reads_read_only_and_migrates_on_first_writable_open(
    tmp_path: Path,
) -> None:
    db = tmp_path / "old.sqlite"
    write_schema1_ledger(db, "fed", CHEAP, 5)
    before = _file_state(db)
    info = BudgetLedger.describe(db)
    assert info.legacy and info.ledger_id is None and info.schema_version == 1
    with BudgetLedger.open_readonly(db, "fed") as old:
        assert old.position() == 5 and old.ledger_id is None and old.neighbouring == "add_remove"
        eps = old.epsilon()
    assert _file_state(db) == before and sorted(os.listdir(tmp_path)) == ["old.sqlite"]
    with BudgetLedger.open(db, "fed", mode="insecure") as ledger:  # adopts the opener's mode
        assert ledger.ledger_id is not None and ledger.mode == "insecure"
        assert ledger.position() == 5 and ledger.epsilon() == pytest.approx(eps)
        ledger.spend(CHEAP, "new-run", 0)  # the chain goes on
    assert db.read_bytes()[18:20] == b"\x01\x01"  # a rollback journal now, not WAL
    with BudgetLedger.open_readonly(db, "fed") as migrated:
        assert migrated.position() == 6 and migrated.ledger_id == ledger.ledger_id


@pytest.mark.unit
def test_a_killed_schema1_writer_keeps_its_records_in_wal_until_a_writable_open(
    tmp_path: Path,
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    conn = write_schema1_ledger(live / "l.sqlite", "fed", CHEAP, 4, keep_open=True)
    assert conn is not None
    with pytest.raises(LedgerError, match="could not switch"):  # an old writer still has it open
        BudgetLedger.open(live / "l.sqlite", "fed")
    killed = tmp_path / "killed"  # the files as a kill -9 left them
    shutil.copytree(live, killed)
    conn.close()
    with pytest.raises(LedgerError, match="holds records: open it writable once") as refused:
        BudgetLedger.describe(killed / "l.sqlite")
    assert getattr(refused.value, "reason", None) == "legacy_wal"
    with BudgetLedger.open(killed / "l.sqlite", "fed") as ledger:
        assert ledger.position() == 4
    assert not (killed / "l.sqlite-wal").exists()


@pytest.mark.unit
def test_secure_and_insecure_runs_never_share_a_ledger(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    BudgetLedger.open(db, "fed", 2.0, 1e-6).close()
    with pytest.raises(LedgerError, match="'secure' ledger, opened with mode 'insecure'"):
        BudgetLedger.open(db, "fed", mode="insecure")
    with pytest.raises(LedgerError, match="'secure' ledger, opened with mode 'insecure'"):
        resolve_federation(db, DATA, label="omniglot", mode="insecure")
    test_db = tmp_path / "test-mode.sqlite"
    fid = resolve_federation(test_db, DATA, label="omniglot", mode="insecure")
    with pytest.raises(LedgerError, match="'insecure' ledger, opened with mode 'secure'"):
        BudgetLedger.open(test_db, fid, 2.0, 1e-6)
    with pytest.raises(ValueError, match="mode must be one of"):
        BudgetLedger.open(db, "fed", mode="private")  # type: ignore[arg-type]


@pytest.mark.unit
def test_each_federation_records_its_neighbouring_relation(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with BudgetLedger.open(db, "sub", 2.0, 1e-6, neighbouring="replace_one") as ledger:
        assert ledger.neighbouring == "replace_one"
        with pytest.raises(LedgerError, match="'replace_one' rounds, this round is 'add_remove'"):
            ledger.spend(CHEAP, "r", 0)
        assert ledger.position() == 0
    with pytest.raises(LedgerError, match=r"registered with \('replace_one'\); got 'add_remove'"):
        BudgetLedger.open(db, "sub", neighbouring="add_remove")
    with BudgetLedger.open(db, "sub") as reopened:  # None: the stored relation
        assert reopened.neighbouring == "replace_one"
    with BudgetLedger.open(db, "default", 2.0, 1e-6) as default:
        assert default.neighbouring == "add_remove"
    with pytest.raises(ValueError, match="neighbouring must be one of"):
        BudgetLedger.open(db, "x", 2.0, 1e-6, neighbouring="swap")


@pytest.mark.unit
def test_checkpoint_and_resume_refuse_another_or_an_older_ledger(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with BudgetLedger.open(db, "fed", 3.0, 1e-6) as ledger:
        start = ledger.checkpoint()
        assert (start.position, start.head, start.path) == (0, None, str(db.resolve()))
        for i in range(3):
            ledger.spend(CHEAP, "run", i)
        saved = LedgerCheckpoint.from_dict(json.loads(json.dumps(ledger.checkpoint().to_dict())))
        assert saved.position == 3 and saved.ledger_id == ledger.ledger_id
        ledger.check_resume(saved)  # itself: fine
        ledger.check_resume(start)
        ledger.spend(CHEAP, "run", 3)
        ledger.check_resume(saved)  # ahead of the checkpoint: fine (the run's own later spend)
    with BudgetLedger.open(tmp_path / "other.sqlite", "fed", 3.0, 1e-6) as other:
        for i in range(5):
            other.spend(CHEAP, "run", i)
        with pytest.raises(LedgerError, match="a different ledger, refusing to resume"):
            other.check_resume(saved)
    with BudgetLedger.open(db, "fed") as ledger:
        old = LedgerCheckpoint(ledger.ledger_id, str(db), "fed", 9, "f" * 64)
        with pytest.raises(LedgerError, match="holds only 4: the ledger is behind"):
            ledger.check_resume(old)
        forged = LedgerCheckpoint(ledger.ledger_id, str(db), "fed", 3, "0" * 64)
        with pytest.raises(LedgerError, match="history diverged"):
            ledger.check_resume(forged)
    with pytest.raises(ValueError, match="head must be None exactly at position 0"):
        LedgerCheckpoint("id", "p", "fed", 0, "abc")
    with pytest.raises(ValueError, match="position must be an integer >= 0"):
        LedgerCheckpoint("id", "p", "fed", -1, None)


@pytest.mark.unit
def test_the_federation_id_is_keyed_by_the_data_and_reveals_nothing(tmp_path: Path) -> None:
    db = tmp_path / "state" / "ledger.sqlite"
    db.parent.mkdir()
    fid = resolve_federation(db, DATA, label="omniglot")
    assert fid.startswith("omniglot-") and len(fid) == len("omniglot-") + 16
    assert resolve_federation(db, DATA, label="omniglot") == fid  # the same data: the same budget
    assert resolve_federation(db, DATA, label="omniglot", create=False) == fid
    neighbour = resolve_federation(db, DATA.replace("T30", "T31"), label="omniglot")
    assert neighbour != fid
    # Salted: the id is neither a plain hash of the identity nor the same in another ledger.
    assert hashlib.sha256(DATA.encode()).hexdigest()[:16] not in fid
    assert resolve_federation(tmp_path / "another.sqlite", DATA, label="omniglot") != fid
    with pytest.raises(LedgerError, match="no budget for this data"):
        resolve_federation(db, "never seen", label="omniglot", create=False)
    with pytest.raises(ValueError, match="label must be"):
        resolve_federation(db, DATA, label="omniglot data")
    with pytest.raises(ValueError, match="data_identity must be"):
        resolve_federation(db, "", label="omniglot")


@pytest.mark.unit
def test_the_budget_follows_the_data_not_the_run(tmp_path: Path) -> None:
    """Issue 9: another --out or --seed over the same data must not start again at zero."""
    db = tmp_path / "state" / "ledger.sqlite"
    db.parent.mkdir()
    spent = []
    for run in ("seed-0-out-a", "seed-1-out-b"):
        fid = resolve_federation(db, DATA, label="omniglot")
        with BudgetLedger.open(db, fid, 20.0, 1e-5) as ledger:
            for i in range(3):
                ledger.spend(POISSON, run, i)
            spent.append(ledger.epsilon())
    assert spent[1] > spent[0]
    assert spent[1] == pytest.approx(epsilon([(POISSON, 6)], 1e-5))


@pytest.mark.integration
def test_a_new_budget_is_an_explicit_recorded_act(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    first = resolve_federation(db, DATA, label="omniglot")
    with BudgetLedger.open(db, first, 2.0, 1e-6) as ledger:
        ledger.spend(CHEAP, "r", 0)
    second = start_new_budget(db, first, "participants re-consented, new data release", who="ops")
    assert second == f"{first}-b2"
    assert resolve_federation(db, DATA, label="omniglot") == second
    with pytest.raises(LedgerError, match=f"the current one is '{second}'"):
        start_new_budget(db, first, "again")  # only from the current budget
    with pytest.raises(ValueError, match="reason must be a non-empty text"):
        start_new_budget(db, second, "  ")
    with pytest.raises(LedgerError, match="no budget record"):
        start_new_budget(db, "hand-named", "why")
    records = budgets(db)
    assert [(r.number, r.federation_id) for r in records] == [(1, first), (2, second)]
    assert records[0].reason == "first budget for this data" and "@" in records[0].actor
    assert (records[1].reason, records[1].actor) == (
        "participants re-consented, new data release",
        "ops",
    )
    with BudgetLedger.open_readonly(db, first) as old:  # the old budget keeps its spends
        assert old.position() == 1
    conn = sqlite3.connect(db)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM budgets WHERE number = 2")
    conn.execute("DROP TRIGGER budgets_append_only_update")
    conn.execute("UPDATE budgets SET reason = 'nothing to see' WHERE number = 2")
    conn.commit()
    conn.close()
    with pytest.raises(LedgerCorrupted, match="budget 2 of .*edited"):
        budgets(db)
    with pytest.raises(LedgerCorrupted, match="budget 2 of .*edited"):
        resolve_federation(db, DATA, label="omniglot")


@pytest.mark.integration
def test_a_new_budget_can_set_its_terms_and_current_budget_reads_them(tmp_path: Path) -> None:
    """Issue 22: the operator sets the new budget's epsilon (delta kept, or given) on record."""
    db = tmp_path / "ledger.sqlite"
    assert current_budget(db, DATA, label="omniglot") is None  # no file yet: nothing created
    assert not db.exists()
    first = resolve_federation(db, DATA, label="omniglot")
    assert current_budget(db, DATA, label="omniglot") == BudgetTerms(first, None, None)
    with BudgetLedger.open(db, first, 2.0, 1e-6, neighbouring="replace_one") as ledger:
        ledger.spend(GaussianRound(FlatPoissonScheme(0.01), 1.0, neighbouring="replace_one"),
                     "r", 0)  # fmt: skip
    assert current_budget(db, DATA, label="omniglot") == BudgetTerms(first, 2.0, 1e-6)
    assert current_budget(db, "other data", label="omniglot") is None
    with pytest.raises(ValueError, match="epsilon_budget must be a finite number > 0"):
        start_new_budget(db, first, "bad", epsilon_budget=-1.0)
    with pytest.raises(ValueError, match="delta needs epsilon_budget"):
        start_new_budget(db, first, "bad", delta=1e-5)
    assert [r.number for r in budgets(db)] == [1], "a refused new budget recorded something"
    second = start_new_budget(db, first, "refresh", epsilon_budget=4.0)
    assert current_budget(db, DATA, label="omniglot") == BudgetTerms(second, 4.0, 1e-6)
    with BudgetLedger.open_readonly(db, second) as ledger:  # the old relation is carried over
        assert (ledger.epsilon_budget, ledger.delta, ledger.neighbouring) == (
            4.0, 1e-6, "replace_one")  # fmt: skip
    third = start_new_budget(db, second, "new delta", epsilon_budget=3.0, delta=1e-7)
    assert current_budget(db, DATA, label="omniglot") == BudgetTerms(third, 3.0, 1e-7)


@pytest.mark.unit
def test_participant_level_note_is_one_definition() -> None:
    fixed = GaussianRound(TwoStageFixedScheme(20, 4, 2, 10), 2.0)
    assert participant_level_note(POISSON) == PARTICIPANT_LEVEL_NOT_MEANINGFUL
    no_cap = GaussianRound(TwoStagePoissonScheme(20, 4, 0.5), 2.0)
    assert participant_level_note(no_cap) == PARTICIPANT_LEVEL_NOT_MEANINGFUL
    assert participant_level_note(fixed) is None
    assert "no participants" in str(participant_level_note(CHEAP))
    assert PARTICIPANT_LEVEL_NOT_MEANINGFUL.startswith("not meaningful: no per-participant cap")


@pytest.mark.integration
def test_cli_show_new_budget_and_backup(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    fid = resolve_federation(db, DATA, label="omniglot")
    with BudgetLedger.open(db, fid, 20.0, 1e-5) as ledger:
        for i in range(2):
            ledger.spend(POISSON, "run-1", i)
    new = _fedmeta(
        "ledger", "new-budget", "--db", str(db), "--federation", fid, "--reason", "new release"
    )
    assert new.returncode == 0, new.stderr
    assert f"{fid}-b2" in new.stdout
    before = _file_state(db)
    shown = _fedmeta("ledger", "show", "--db", str(db), "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["ledger_id"] and report["mode"] == "secure"
    [data] = report["data"]
    assert data["current"] == f"{fid}-b2"
    assert [b["reason"] for b in data["budgets"]] == ["first budget for this data", "new release"]
    [fed] = report["federations"]  # the new budget has no federation row until a run opens it
    assert fed["neighbouring"] == "add_remove" and fed["records"] == 2
    assert fed["participant_level_note"] == PARTICIPANT_LEVEL_NOT_MEANINGFUL
    # Numbered from 1, as summary.json and rounds.csv number rounds (spent as indices 0 and 1).
    assert fed["runs"]["run-1"] == {"spends": 2, "first_round": 1, "last_round": 2}
    text = _fedmeta("ledger", "show", "--db", str(db))
    assert (
        "relation add_remove" in text.stdout and "participant level: not meaningful" in text.stdout
    )
    assert "reason: new release" in text.stdout
    assert _file_state(db) == before and not list(tmp_path.glob("ledger.sqlite-*"))
    copy = tmp_path / "backup.sqlite"
    done = _fedmeta("ledger", "backup", "--db", str(db), "--to", str(copy))
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout
    assert BudgetLedger.describe(copy).ledger_id == report["ledger_id"]
    bad = _fedmeta("ledger", "new-budget", "--db", str(db), "--federation", fid, "--reason", "x")
    assert bad.returncode == 2 and "not the current budget" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.unit
def test_cli_show_reports_a_schema1_ledger_as_legacy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedmeta.cli import main

    db = tmp_path / "old.sqlite"
    write_schema1_ledger(db, "fed", CHEAP, 2)
    before = _file_state(db)
    assert main(["ledger", "show", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "legacy, no id" in out and "federation fed: 2 spends" in out
    assert _file_state(db) == before


@pytest.mark.unit
def test_cli_ledger_commands_default_to_the_state_directory_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedmeta ledger show` without --db reads the ledger `fedmeta simulate` spends from."""
    from fedmeta.cli import main
    from fedmeta.paths import default_ledger_path

    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    assert main(["ledger", "show"]) == 2  # none yet: a clear error naming the default path
    assert f"no ledger at {tmp_path / 'state' / 'ledger.sqlite'}" in capsys.readouterr().err
    db = default_ledger_path(secure=True)
    db.parent.mkdir(parents=True)
    write_schema1_ledger(db, "fed", CHEAP, 2)
    assert main(["ledger", "show"]) == 0
    assert "federation fed: 2 spends" in capsys.readouterr().out
    # registered without fedmeta's state directory there is no default: --db stays required
    import argparse

    from fedmeta.cli.ledger import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["ledger", "show"])
    assert "--db" in capsys.readouterr().err
