"""The ledger file: complete after every commit (SIGKILL at random moments), read-only access that
writes nothing (read-only mount), distinct errors, no search under the write lock, backups."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tests.accounting.readonly_mount import need_readonly_mount
from tests.accounting.schema1 import write_schema1_ledger

import fedmeta.accounting.calibration as ledger_module  # where spend looks up its search
import fedmeta.accounting.ledger.budget as budget_module
from fedmeta.accounting import (
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    LedgerCorrupted,
    LedgerError,
    LedgerMissing,
    LedgerReadOnly,
    LedgerReplaced,
    LedgerRolledBack,
    LedgerUnreadable,
    NotALedger,
    accept_rollback,
    backup,
    budgets,
    resolve_federation,
)

REPO = Path(__file__).resolve().parents[2]
CHEAP = GaussianRound(FlatPoissonScheme(0.01), 1.0)
OTHER = GaussianRound(FlatPoissonScheme(0.02), 1.0)
DATA = "sinusoid|P20|T30"
#: A written ledger's directory: the file and its rollback anchor
# (accounting/fedmeta/accounting/ledger/anchor.py).
ANCHORED = ["ledger.sqlite", "ledger.sqlite.anchor"]


def _state(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def _ledger(path: Path, spends: int, fid: str = "fed") -> None:
    with BudgetLedger.open(path, fid, 3.0, 1e-6) as ledger:
        for i in range(spends):
            ledger.spend(CHEAP, "run", i)


# ------------------------------------------------------------------- the main file is complete


@pytest.mark.integration
def test_the_main_file_alone_holds_every_spend_after_each_commit(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    db = tmp_path / "state" / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 3.0, 1e-6) as ledger:
        for i in range(4):
            ledger.spend(CHEAP, "run", i)
            # Still open, as a writer killed now: no side file holds anything.
            assert sorted(p.name for p in db.parent.iterdir()) == ANCHORED
            copy = tmp_path / f"after-{i}.sqlite"
            shutil.copyfile(db, copy)
            with BudgetLedger.open_readonly(copy, "fed") as restored:
                assert restored.position() == i + 1
                assert restored.records()[-1].hash == ledger.records()[-1].hash


KILLS = 8
_WRITER = textwrap.dedent(
    """
    import sys
    from fedmeta.accounting import BudgetLedger, FlatPoissonScheme, GaussianRound
    event = GaussianRound(FlatPoissonScheme(0.01), 2.0)  # 1873 rounds; a 0.4 s search
    ledger = BudgetLedger.open(sys.argv[1], "fed", 1.0, 1e-6)
    ledger.rounds_affordable(event)  # the search, before the timed loop
    print("ready", flush=True)
    for i in range(1_000_000):
        print(ledger.spend(event, sys.argv[2], i).position, flush=True)
    """
)


@pytest.mark.integration
def test_after_sigkill_at_random_moments_a_copy_of_the_main_file_keeps_every_acknowledged_spend(
    tmp_path: Path,
) -> None:
    """Issue 10: after kill -9 every spend sat in -wal; a copy of the main file alone lost them.

    A kill can land inside a commit (the few page writes between journal and main file): then
    ``ledger.sqlite-journal`` exists, the main file alone may hold half of the unacknowledged
    last transaction, and it must be refused (never read short); the main file and the journal
    together hold everything. ``fedmeta ledger backup`` never meets that case.
    """
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    db = tmp_path / "ledger.sqlite"
    BudgetLedger.open(db, "fed", 1.0, 1e-6).close()
    acknowledged, inside_commit, refused = 0, 0, 0
    for kill in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(db), f"run-{kill}"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        printed = [int(line) for line in proc.stdout.read().split()]
        proc.stdout.close()
        if printed:
            acknowledged = printed[-1] + 1
        copy = tmp_path / f"copy-{kill}"
        copy.mkdir()
        shutil.copyfile(db, copy / "ledger.sqlite")
        journal = db.with_name("ledger.sqlite-journal")
        what = f"kill {kill} (seed {seed}), {acknowledged} acknowledged"
        if not journal.exists():
            with BudgetLedger.open_readonly(copy / "ledger.sqlite", "fed") as restored:
                assert restored.position() >= acknowledged, what
            continue
        inside_commit += 1
        try:
            with BudgetLedger.open_readonly(copy / "ledger.sqlite", "fed") as alone:
                assert alone.position() >= acknowledged, what  # never short
        except LedgerUnreadable:
            refused += 1  # refused as corrupted: never read short
        shutil.copyfile(journal, copy / "ledger.sqlite-journal")
        with BudgetLedger.open(copy / "ledger.sqlite", "fed") as together:  # rolls back
            assert together.position() >= acknowledged, what
    with BudgetLedger.open(db, "fed") as ledger:
        assert ledger.position() >= acknowledged > 0
    print(
        f"seed {seed}: {inside_commit} of {KILLS} kills landed inside a commit; the main file "
        f"alone was refused after {refused} of them"
    )


# ------------------------------------------------------------------------------- read-only


@pytest.mark.integration
def test_reading_writes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    fid = resolve_federation(db, DATA, label="sinusoid")
    _ledger(db, 3, fid)
    before = _state(db)
    info = BudgetLedger.describe(db)
    assert BudgetLedger.federations(db) == [fid] == list(info.federations)
    with BudgetLedger.open_readonly(db, fid) as ledger:
        assert ledger.position() == 3 and ledger.epsilon() > 0
        assert ledger.rounds_affordable(CHEAP) > 0
        with pytest.raises(LedgerReadOnly, match="opened read-only"):
            ledger.spend(CHEAP, "run", 3)
        assert ledger.position() == 3
    assert resolve_federation(db, DATA, label="sinusoid", create=False) == fid
    assert [b.federation_id for b in budgets(db)] == [fid]
    assert _state(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ANCHORED


_READER = textwrap.dedent(
    """
    import json, sys
    from fedmeta.accounting import *
    db, data = sys.argv[1], sys.argv[2]
    out = {"federations": BudgetLedger.federations(db)}
    fid = resolve_federation(db, data, label="sinusoid", create=False)
    with BudgetLedger.open_readonly(db, fid) as ledger:
        out["position"] = ledger.position()
        out["epsilon"] = ledger.epsilon()
        try:
            ledger.spend(GaussianRound(FlatPoissonScheme(0.01), 1.0), "x", 9)
        except LedgerReadOnly as error:
            out["spend"] = str(error)
    try:
        BudgetLedger.open(db, fid)
    except LedgerError as error:
        out["writable"] = [type(error).__name__, str(error)]
    print(json.dumps(out))
    """
)


@pytest.mark.integration
def test_reading_works_on_a_read_only_mount(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "ledger.sqlite"
    fid = resolve_federation(db, DATA, label="sinusoid")
    _ledger(db, 3, fid)
    prefix = need_readonly_mount(state)
    before = _state(db)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [*prefix, sys.executable, "-c", _READER, str(db), DATA],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["federations"] == [fid] and out["position"] == 3 and out["epsilon"] > 0
    assert "opened read-only" in out["spend"]
    assert out["writable"][0] == "LedgerReadOnly" and "is read-only here" in out["writable"][1]
    show = subprocess.run(
        [*prefix, sys.executable, "-m", "fedmeta.cli", "ledger", "show", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert show.returncode == 0, show.stderr
    assert f"federation {fid}: 3 spends" in show.stdout
    assert _state(db) == before and sorted(p.name for p in state.iterdir()) == ANCHORED


@pytest.mark.integration
def test_each_unreadable_file_has_its_own_one_line_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 50)
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (text TEXT)")
    conn.commit()
    conn.close()
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    stripped = tmp_path / "stripped.sqlite"  # a schema-1 main file without its -wal
    live = write_schema1_ledger(tmp_path / "s1.sqlite", "fed", CHEAP, 3, keep_open=True)
    assert live is not None
    shutil.copyfile(tmp_path / "s1.sqlite", stripped)
    live.close()
    corrupted = tmp_path / "corrupted.sqlite"
    _ledger(corrupted, 3)
    conn = sqlite3.connect(corrupted)
    conn.execute("DROP TRIGGER spends_append_only_update")
    conn.execute("UPDATE spends SET run_id = 'someone-else' WHERE position = 1")
    conn.commit()
    conn.close()
    cases: list[tuple[Path, type[Exception], str, str]] = [
        (tmp_path / "missing.sqlite", LedgerMissing, "missing", "file missing"),
        (junk, NotALedger, "not_sqlite", "is not a SQLite file"),
        (tmp_path, NotALedger, "not_sqlite", "is a directory"),
        (other, NotALedger, "not_ledger", "is a SQLite database but not a fedmeta ledger"),
        (empty, NotALedger, "not_ledger", "is an empty file"),
        (stripped, NotALedger, "not_ledger", "not a fedmeta ledger .in WAL mode.*-wal, which was"),
        (corrupted, LedgerCorrupted, "corrupted", "record #1 .*do not match its hash"),
    ]
    for path, kind, reason, message in cases:
        with pytest.raises(kind, match=message) as raised:
            BudgetLedger.open_readonly(path, "fed")
        error = raised.value
        assert isinstance(error, LedgerUnreadable) and error.reason == reason, path
        assert "\n" not in str(error)
    assert isinstance(LedgerMissing("x"), FileNotFoundError)
    with pytest.raises(LedgerUnreadable, match="the directory .*/nowhere does not exist"):
        BudgetLedger.open(tmp_path / "nowhere" / "ledger.sqlite", "fed", 2.0, 1e-6)
    before = _state(other)
    with pytest.raises(NotALedger, match="refusing to add ledger tables"):
        BudgetLedger.open(other, "fed", 2.0, 1e-6)
    assert _state(other) == before


# ------------------------------------------------------------------------- the write lock


def _gated_search(
    monkeypatch: pytest.MonkeyPatch, thread_name: str
) -> tuple[threading.Event, threading.Event, list[int]]:
    """Make the first PLD search in ``thread_name`` wait for a gate; count its searches."""
    gate, entered, searches = threading.Event(), threading.Event(), []
    real = ledger_module.max_rounds

    def search(*args: Any, **kwargs: Any) -> int:
        if threading.current_thread().name == thread_name:
            searches.append(1)
            if len(searches) == 1:
                entered.set()
                assert gate.wait(120), "the test never opened the gate"
        return int(real(*args, **kwargs))

    monkeypatch.setattr(ledger_module, "max_rounds", search)
    return gate, entered, searches


@pytest.mark.integration
@pytest.mark.parametrize("meanwhile", [CHEAP, OTHER], ids=["same-round", "other-round"])
def test_a_spend_never_searches_while_holding_the_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: GaussianRound
) -> None:
    db = tmp_path / "ledger.sqlite"
    BudgetLedger.open(db, "fed", 3.0, 1e-6).close()
    gate, entered, searches = _gated_search(monkeypatch, "slow-spender")
    result: dict[str, Any] = {}

    def slow_spender() -> None:
        with BudgetLedger.open(db, "fed") as ledger:
            result["record"] = ledger.spend(CHEAP, "slow", 0)

    slow = threading.Thread(target=slow_spender, name="slow-spender")
    slow.start()
    try:
        assert entered.wait(60)  # the slow spend is inside its search now
        done: dict[str, Any] = {}

        def meanwhile_work() -> None:  # another writer and a reader, on their own connections
            with BudgetLedger.open(db, "fed") as other:
                done["written"] = other.spend(meanwhile, "fast", 0).position
            with BudgetLedger.open_readonly(db, "fed") as reader:
                done["read"] = reader.position()

        worker = threading.Thread(target=meanwhile_work)
        worker.start()
        worker.join(timeout=45)  # the old code held the lock here: "database is locked" after 60 s
        assert done == {"written": 0, "read": 1}, "the slow spend's search held the write lock"
    finally:
        gate.set()
        slow.join(timeout=120)
    assert result["record"].position == 1  # after the record made meanwhile
    # A round of another kind changed what the search depended on: searched again, outside.
    assert len(searches) == (1 if meanwhile == CHEAP else 2)
    with BudgetLedger.open_readonly(db, "fed") as ledger:
        assert [(r.run_id, r.event) for r in ledger.records()] == [
            ("fast", meanwhile),
            ("slow", CHEAP),
        ]


@pytest.mark.unit
def test_spend_retries_are_bounded_and_record_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "ledger.sqlite"
    meddler = BudgetLedger.open(db, "fed", 3.0, 1e-6)
    ledger = BudgetLedger.open(db, "fed")
    monkeypatch.setattr(meddler, "_max_total", lambda base, event: 10**6)  # no PLD needed

    def search_while_others_record(base: Any, event: Any) -> int:
        meddler.spend(OTHER, "meddler", meddler.position())  # lands between search and lock
        return 10**6

    monkeypatch.setattr(ledger, "_max_total", search_while_others_record)
    with pytest.raises(LedgerError, match="gave up after 8 attempts"):
        ledger.spend(CHEAP, "unlucky", 0)
    assert [r.run_id for r in ledger.records()] == ["meddler"] * budget_module.SPEND_ATTEMPTS
    meddler.close()
    ledger.close()


# --------------------------------------------------------------------------------- backups


@pytest.mark.integration
def test_backup_is_complete_atomic_verified_and_never_forgets_spends(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    fid = resolve_federation(db, DATA, label="sinusoid")
    _ledger(db, 3, fid)
    _ledger(db, 2, "second")
    copy = tmp_path / "backups" / "ledger.sqlite"
    copy.parent.mkdir()
    result = backup(db, copy)
    assert result.positions == {fid: 3, "second": 2}
    assert result.ledger_id == BudgetLedger.describe(db).ledger_id
    assert sorted(p.name for p in copy.parent.iterdir()) == ["ledger.sqlite"]  # no temp left
    assert copy.read_bytes()[18:20] == b"\x01\x01"
    assert budgets(copy) == budgets(db)
    _ledger(db, 1, "second")  # the live ledger moves on
    with pytest.raises(
        LedgerError,
        match=r"holds spends the source lacks .*'second' has 2 records in the copy, 3 in",
    ):
        backup(copy, db)  # restoring the older copy would forget a spend
    assert BudgetLedger.describe(db).ledger_id == result.ledger_id
    with BudgetLedger.open_readonly(db, "second") as live:
        assert live.position() == 3
    assert backup(db, copy).positions == {fid: 3, "second": 3}  # a newer backup over an older
    elsewhere = tmp_path / "elsewhere.sqlite"
    _ledger(elsewhere, 1)
    with pytest.raises(LedgerError, match="is another ledger"):
        backup(db, elsewhere)
    assert backup(db, elsewhere, force=True).ledger_id == result.ledger_id


@pytest.mark.unit
def test_backup_refuses_a_destination_with_a_hot_journal_and_converts_schema1(
    tmp_path: Path,
) -> None:
    old = tmp_path / "old.sqlite"
    write_schema1_ledger(old, "fed", CHEAP, 4)
    copy = tmp_path / "copy.sqlite"
    result = backup(old, copy)
    assert result.ledger_id is None and result.positions == {"fed": 4}
    assert copy.read_bytes()[18:20] == b"\x01\x01"  # readable anywhere, no -wal/-shm needed
    _ledger(tmp_path / "busy.sqlite", 1)
    (tmp_path / "busy.sqlite-journal").write_bytes(b"x")
    with pytest.raises(LedgerError, match="busy.sqlite-journal exists"):
        backup(copy, tmp_path / "busy.sqlite")


@pytest.mark.unit
def test_a_writer_refuses_to_spend_into_a_replaced_or_overwritten_file(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    _ledger(db, 2)
    older = tmp_path / "older.sqlite"
    backup(db, older)
    with BudgetLedger.open(db, "fed") as writer:
        writer.spend(CHEAP, "run", 2)
        backup(older, db, force=True)  # a restore (rename) under a running writer
        with pytest.raises(LedgerReplaced, match="was replaced or removed"):
            writer.spend(CHEAP, "run", 3)
    with pytest.raises(LedgerRolledBack, match="behind its anchor"):  # the anchor saw spend 2
        BudgetLedger.open(db, "fed")
    accept_rollback(db, "restored the older copy on purpose (test)")
    with BudgetLedger.open(db, "fed") as writer:
        assert writer.position() == 2
        writer.spend(CHEAP, "run", 2)
        shutil.copyfile(older, db)  # overwritten in place (same inode)
        with pytest.raises(LedgerReplaced, match="no longer the one this process read"):
            writer.spend(CHEAP, "run", 3)


_DIE_MID_COMMIT = textwrap.dedent(
    """
    import os, sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("PRAGMA cache_size = 1")  # spill pages into the main file before the commit
    conn.execute("BEGIN IMMEDIATE")
    for i in range(2000):
        conn.execute("INSERT INTO heads VALUES (?, 0, ?)", (f"junk-{i}", "x" * 500))
    os._exit(9)  # dies with the journal hot and the main file half written
    """
)


@pytest.mark.integration
def test_a_hot_journal_is_reported_read_only_and_rolled_back_by_the_next_writer(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ledger.sqlite"
    _ledger(db, 3)
    died = subprocess.run([sys.executable, "-c", _DIE_MID_COMMIT, str(db)], timeout=120)
    assert died.returncode == 9 and db.with_name("ledger.sqlite-journal").exists()
    with pytest.raises(LedgerUnreadable, match="died in the middle of a commit") as raised:
        BudgetLedger.open_readonly(db, "fed")
    assert raised.value.reason == "hot_journal"
    with BudgetLedger.open(db, "fed") as ledger:  # rolls the unfinished transaction back
        assert ledger.position() == 3
    assert not db.with_name("ledger.sqlite-journal").exists()
    with BudgetLedger.open_readonly(db, "fed") as reader:
        assert reader.position() == 3
