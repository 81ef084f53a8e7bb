"""The ledger's record of public data a run used: declared once, read back, append-only, shown."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedmeta.accounting import (
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    LedgerCorrupted,
    LedgerReadOnly,
    PublicDataUse,
)
from fedmeta.cli import main

ROUND = GaussianRound(FlatPoissonScheme(0.01), 1.0)
USE = PublicDataUse(
    description="Omniglot background alphabets", digest="ab" * 32, items=964,
    use="non-private meta-training (2000 steps) before private training",
    disjoint_from_private=True,
)  # fmt: skip


def _ledger(db: Path) -> BudgetLedger:
    return BudgetLedger.open(db, "fed", 8.0, 1e-6)


@pytest.mark.unit
def test_a_declaration_is_recorded_once_per_run_and_read_back_read_only(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with _ledger(db) as ledger:
        ledger.record_public_use(USE, "run-a")
        ledger.record_public_use(USE, "run-a")  # a resumed run declares again: a no-op
        ledger.spend(ROUND, "run-a", 0)
        ledger.record_public_use(USE, "run-b")
    with BudgetLedger.open_readonly(db, "fed") as reader:
        records = reader.public_uses()
        assert [r.run_id for r in records] == ["run-a", "run-b"]
        assert records[0].use == USE and len(records[0].created_at) == 10  # a day, no time
        with pytest.raises(LedgerReadOnly, match="read-only"):
            reader.record_public_use(USE, "run-c")
    with BudgetLedger.open(db, "other", 8.0, 1e-6) as other:
        assert other.public_uses() == []  # another budget's runs used none


@pytest.mark.unit
def test_declarations_are_append_only(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with _ledger(db) as ledger:
        ledger.record_public_use(USE, "run-a")
    conn = sqlite3.connect(db)
    for statement in ("UPDATE public_data SET declaration = '{}'", "DELETE FROM public_data"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute(statement)
    conn.close()


@pytest.mark.unit
def test_an_edited_declaration_is_reported_as_corruption(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with _ledger(db):
        pass
    conn = sqlite3.connect(db)
    bad = json.dumps({**json.loads(USE.to_json()), "items": 0})
    with conn:
        conn.execute("INSERT INTO public_data VALUES ('fed', 'run-x', ?, '2026-11-26')", (bad,))
    conn.close()
    with BudgetLedger.open_readonly(db, "fed") as reader, pytest.raises(
        LedgerCorrupted, match=r"public-data declaration of run 'run-x'.*items must be"
    ):
        reader.public_uses()


@pytest.mark.unit
def test_a_ledger_older_than_the_table_reads_no_declarations(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with _ledger(db) as ledger:
        ledger.spend(ROUND, "run-a", 0)
    conn = sqlite3.connect(db)
    with conn:
        for op in ("update", "delete"):
            conn.execute(f"DROP TRIGGER public_data_append_only_{op}")
        conn.execute("DROP TABLE public_data")
    conn.close()
    with BudgetLedger.open_readonly(db, "fed") as reader:
        assert reader.public_uses() == [] and reader.position() == 1
    with _ledger(db) as ledger:  # a writable open adds the table; the spend is kept
        ledger.record_public_use(USE, "run-b")
        assert ledger.position() == 1 and len(ledger.public_uses()) == 1


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"description": " "}, "description must be a non-empty string"),
        ({"use": ""}, "use must be a non-empty string"),
        ({"digest": "XYZ" * 8}, "digest must be 16-128 lowercase hex digits"),
        ({"digest": "ab"}, "digest must be 16-128 lowercase hex digits"),
        ({"items": 0}, "items must be an int >= 1"),
        ({"items": True}, "items must be an int >= 1"),
        ({"disjoint_from_private": "yes"}, "disjoint_from_private must be a bool"),
    ],
)
def test_a_malformed_declaration_is_refused(change: dict[str, object], message: str) -> None:
    fields = {**json.loads(USE.to_json()), **change}
    with pytest.raises(ValueError, match=message):
        PublicDataUse(**fields)  # type: ignore[arg-type]


@pytest.mark.unit
def test_ledger_show_names_the_public_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "ledger.sqlite"
    with _ledger(db) as ledger:
        ledger.spend(ROUND, "run-a", 0)
    assert main(["ledger", "show", "--db", str(db)]) == 0
    assert "public data: none declared" in capsys.readouterr().out
    with _ledger(db) as ledger:
        ledger.record_public_use(USE, "run-b")
    assert main(["ledger", "show", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "public data of run run-b" in out and "Omniglot background alphabets, 964 items" in out
    assert "disjoint from the private data: checked" in out
    assert main(["ledger", "show", "--db", str(db), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["federations"][0]["public_data"]
    assert entry["digest"] == "ab" * 32 and entry["run_id"] == "run-b"


@pytest.mark.unit
@given(
    description=st.text(min_size=1).filter(str.strip),
    digest=st.text(alphabet="0123456789abcdef", min_size=16, max_size=128),
    items=st.integers(min_value=1, max_value=10**9),
    use=st.text(min_size=1).filter(str.strip),
    disjoint=st.booleans(),
)
def test_a_declaration_survives_its_stored_form(
    description: str, digest: str, items: int, use: str, disjoint: bool
) -> None:
    declared = PublicDataUse(description, digest, items, use, disjoint)
    assert PublicDataUse.from_dict(json.loads(declared.to_json())) == declared
