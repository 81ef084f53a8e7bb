"""Ledger: check-then-commit, recomputation on open, tamper detection, SIGKILL, concurrent
writers."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    LedgerCorrupted,
    LedgerError,
    NotALedger,
    TwoStagePoissonScheme,
    epsilon,
    max_rounds,
)

REPO = Path(__file__).resolve().parents[2]
# One round of two-stage sampling whose budget of 2.0 allows exactly a handful of rounds.
ROUND = GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 1.0)
# Cheap rounds for the process tests: thousands fit in the budget.
CHEAP = GaussianRound(FlatPoissonScheme(0.01), 1.0)


@pytest.mark.unit
def test_spend_until_exhausted_then_reopen_recomputes(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with BudgetLedger.open(db, "fed", 2.0, 1e-6) as ledger:
        affordable = ledger.rounds_affordable(ROUND)
        assert affordable == max_rounds(ROUND, 2.0, 1e-6)
        for i in range(affordable):
            assert not ledger.would_exceed(ROUND)
            record = ledger.spend(ROUND, "run-a", i)
            assert record.position == i
        assert ledger.would_exceed(ROUND)
        with pytest.raises(BudgetExhausted):
            ledger.spend(ROUND, "run-a", affordable)
        assert ledger.position() == affordable  # nothing recorded by the failed spend
        spent = ledger.epsilon()
        assert spent == pytest.approx(epsilon([(ROUND, affordable)], 1e-6))
        assert spent <= 2.0 < epsilon([(ROUND, affordable + 1)], 1e-6)
    with BudgetLedger.open(db, "fed") as again:
        assert again.position() == affordable
        assert again.epsilon() == pytest.approx(spent)
        assert again.epsilon(method="rdp") >= spent
        assert [r.round_index for r in again.records()] == list(range(affordable))


@pytest.mark.unit
def test_groups_of_different_rounds_compose(tmp_path: Path) -> None:
    # e.g. the number of registered participants changed between rounds
    first = GaussianRound(FlatPoissonScheme(0.02), 1.0)
    other = GaussianRound(FlatPoissonScheme(0.025), 1.0)
    with BudgetLedger.open(tmp_path / "l.db", "fed", 1.0, 1e-6) as ledger:
        ledger.spend(first, "r", 0)
        ledger.spend(other, "r", 1)
        ledger.spend(first, "r", 2)
        assert ledger.epsilon() == pytest.approx(epsilon([(first, 2), (other, 1)], 1e-6))
        n = ledger.rounds_affordable(other)
        assert epsilon([(first, 2), (other, 1 + n)], 1e-6) <= 1.0
        assert epsilon([(first, 2), (other, 2 + n)], 1e-6) > 1.0


@pytest.mark.unit
def test_federations_are_separate_and_budgets_fixed(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    with BudgetLedger.open(db, "a", 2.0, 1e-6) as a, BudgetLedger.open(db, "b", 3.0, 1e-6) as b:
        a.spend(ROUND, "r", 0)
        assert b.position() == 0
    with pytest.raises(LedgerError, match="epsilon_budget must match"):
        BudgetLedger.open(db, "a", 4.0, 1e-6)
    assert BudgetLedger.federations(db) == ["a", "b"]


@pytest.mark.unit
def test_invalid_arguments_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="epsilon_budget must be"):
        BudgetLedger.open(tmp_path / "l.db", "a", -1.0, 1e-6)
    with BudgetLedger.open(tmp_path / "l.db", "a", 2.0, 1e-6) as ledger:
        with pytest.raises(ValueError, match="round_index must be"):
            ledger.spend(ROUND, "r", -1)
        assert ledger.position() == 0


def _tamper(db: Path, sql: str) -> None:
    conn = sqlite3.connect(db)
    for trigger in ("spends_append_only_update", "spends_append_only_delete"):
        conn.execute(f"DROP TRIGGER {trigger}")
    conn.execute(sql)
    conn.commit()
    conn.close()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("sql", "message"),
    [
        (
            "UPDATE spends SET event = replace(event, '1.0', '9.0') WHERE position = 1",
            "record #1 .*do not match its hash",
        ),
        ("DELETE FROM spends WHERE position = 1", "record #2 .*expected record #1"),
        ("DELETE FROM spends WHERE position = 2", "head names record #2"),
        ("UPDATE spends SET round_index = 7 WHERE position = 0", "record #0 .*edited"),
    ],
)
def test_tampering_is_detected_on_open(tmp_path: Path, sql: str, message: str) -> None:
    db = tmp_path / "l.db"
    with BudgetLedger.open(db, "fed", 2.0, 1e-6) as ledger:
        for i in range(3):
            ledger.spend(ROUND, "r", i)
    _tamper(db, sql)
    with pytest.raises(LedgerCorrupted, match=message):
        BudgetLedger.open(db, "fed")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("table", "sql", "message"),
    [
        (
            "federations",
            "UPDATE federations SET unit = 'household'",
            r"federation 'fed': stored unit must be one of \('task', 'participant'\); "
            "got 'household'",
        ),
        (
            "federations",
            "UPDATE federations SET neighbouring = 'swap'",
            r"federation 'fed': stored neighbouring must be one of .*; got 'swap'",
        ),
        (
            "meta",
            "UPDATE meta SET value = 'lax' WHERE key = 'mode'",
            r"stored mode must be one of \('secure', 'insecure'\); got 'lax'",
        ),
    ],
)
def test_unknown_stored_choice_is_corruption(
    tmp_path: Path, table: str, sql: str, message: str
) -> None:
    # A closed-set value read back from the file is checked once, where it is read: a value no
    # fedmeta writes is corruption (one line naming the ledger), never carried on as a string.
    db = tmp_path / "l.db"
    with BudgetLedger.open(db, "fed", 2.0, 1e-6) as ledger:
        ledger.spend(ROUND, "r", 0)
    conn = sqlite3.connect(db)
    conn.execute(f"DROP TRIGGER {table}_append_only_update")
    conn.execute(sql)
    conn.commit()
    conn.close()
    with pytest.raises(LedgerCorrupted, match=message) as refused:
        BudgetLedger.open_readonly(db, "fed")
    assert str(db) in str(refused.value) and "\n" not in str(refused.value)
    if table == "meta":
        with pytest.raises(LedgerCorrupted, match=message):
            BudgetLedger.describe(db)


@pytest.mark.unit
def test_append_only_triggers_and_garbage_file(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    with BudgetLedger.open(db, "fed", 2.0, 1e-6) as ledger:
        ledger.spend(ROUND, "r", 0)
    conn = sqlite3.connect(db)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM spends")
    conn.close()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(NotALedger, match="not a SQLite file") as refused:
        BudgetLedger.open(junk, "fed", 2.0, 1e-6)
    assert refused.value.reason == "not_sqlite"
    assert junk.read_bytes() == b"this is not a database" * 100  # never reset


_WRITER = textwrap.dedent(
    """
    import sys
    from fedmeta.accounting import BudgetLedger, FlatPoissonScheme, GaussianRound
    db, run_id, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    ledger = BudgetLedger.open(db, "fed", 3.0, 1e-6)
    ledger.rounds_affordable(event)  # warm the cache before the timed loop
    print("ready", flush=True)
    for i in range(count):
        record = ledger.spend(event, run_id, i)
        print(record.position, flush=True)
    """
)


def _writer(db: Path, run_id: str, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db), run_id, str(count)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.integration
def test_sigkill_mid_spend_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    BudgetLedger.open(db, "fed", 3.0, 1e-6).close()
    proc = _writer(db, "killed", 100_000)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    acknowledged = []
    deadline = time.monotonic() + 60
    while len(acknowledged) < 40 and time.monotonic() < deadline:
        acknowledged.append(int(proc.stdout.readline()))
    os.kill(proc.pid, signal.SIGKILL)  # most likely inside a transaction
    proc.wait(timeout=30)
    with BudgetLedger.open(db, "fed") as ledger:  # verifies the whole chain
        records = ledger.records()
        assert len(records) >= acknowledged[-1] + 1  # every acknowledged spend survived
        assert [r.position for r in records] == list(range(len(records)))
        assert ledger.epsilon() == pytest.approx(epsilon([(CHEAP, len(records))], 1e-6))
        ledger.spend(CHEAP, "after", 0)  # and the ledger is usable


@pytest.mark.integration
def test_two_concurrent_writer_processes_lose_no_record(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    BudgetLedger.open(db, "fed", 3.0, 1e-6).close()
    procs = [_writer(db, f"run-{k}", 25) for k in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
    with BudgetLedger.open(db, "fed") as ledger:
        records = ledger.records()
        assert len(records) == 50
        for k in range(2):
            assert sorted(r.round_index for r in records if r.run_id == f"run-{k}") == list(
                range(25)
            )
