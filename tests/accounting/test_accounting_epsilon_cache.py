"""``fedmeta ledger show`` keeps composed epsilons only under the hash of what they were composed
from (accounting/fedmeta/accounting/ledger/epsilon_cache.py): what it shows is what the records
give, with the cache cold, warm, stale, damaged or bypassed (``--recompute``)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fedmeta.accounting.ledger.budget as budget_module
from fedmeta.accounting import (
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
)
from fedmeta.accounting.ledger import EpsilonCache
from fedmeta.accounting.ledger.epsilon_cache import composition_key
from fedmeta.paths import epsilon_cache_path

FIXED = GaussianRound(TwoStageFixedScheme(20, 4, 3, 30), 1.5)  # a participant-level bound too
CHEAP = GaussianRound(FlatPoissonScheme(0.01), 1.0)


def _ledger(db: Path, spends: int, start: int = 0) -> None:
    with BudgetLedger.open(db, "fed", 50.0, 1e-5) as ledger:
        for i in range(start, start + spends):
            ledger.spend(FIXED, "run-1", i)


def _truth(db: Path) -> dict[str, float]:
    """The epsilons composed here, with no cache: what the records give."""
    with BudgetLedger.open_readonly(db, "fed") as ledger:
        return {
            "epsilon": ledger.epsilon(),
            "epsilon_rdp": ledger.epsilon(method="rdp"),
            "epsilon_participant": ledger.epsilon(unit="participant", method="rdp"),
        }


def _shown(db: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, float]:
    from fedmeta.cli import main

    assert main(["ledger", "show", "--db", str(db), "--json", *flags]) == 0
    [fed] = json.loads(capsys.readouterr().out)["federations"]
    return {k: fed[k] for k in ("epsilon", "epsilon_rdp", "epsilon_participant")}


def _kept() -> dict[str, float]:
    with sqlite3.connect(epsilon_cache_path()) as conn:
        return dict(conn.execute("SELECT key, epsilon FROM epsilons").fetchall())


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    return epsilon_cache_path()


@pytest.mark.integration
def test_show_is_what_the_records_give_cold_warm_and_after_a_spend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "ledger.sqlite"
    _ledger(db, 3)
    cold = _shown(db, capsys)
    assert cold == _truth(db) and len(_kept()) == 3  # PLD, RDP, participant-level RDP

    def not_composed(*args: object, **kwargs: object) -> float:
        raise AssertionError("a kept epsilon was composed again")

    with monkeypatch.context() as patched:
        patched.setattr(budget_module, "epsilon", not_composed)
        assert _shown(db, capsys) == cold  # warm: found, not composed
        with pytest.raises(AssertionError, match="composed again"):  # and --recompute composes
            _shown(db, capsys, "--recompute")
    _ledger(db, 2, start=3)  # new records: another key, composed afresh
    after = _shown(db, capsys)
    assert after == _truth(db) and after["epsilon"] > cold["epsilon"]
    assert len(_kept()) == 6


@pytest.mark.integration
def test_a_kept_number_is_read_only_under_its_inputs_hash_and_recompute_reads_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A number planted under the key of what the ledger holds is shown (who can write the cache
    can do that, as who recomputes every hash can rewrite the chain); ``--recompute`` is not
    fooled, and then keeps the true number in its place. Planted under any other key, it is
    never read."""
    db = tmp_path / "ledger.sqlite"
    _ledger(db, 3)
    truth = _shown(db, capsys)
    with BudgetLedger.open_readonly(db, "fed") as ledger:
        counts = tuple(ledger.rounds())  # one kind of round: already the canonical multiset
    planted = composition_key(counts, 1e-5, "task", "pld")
    other = composition_key(counts, 2e-5, "task", "pld")  # another delta: another key
    assert planted in _kept() and other not in _kept()
    cache = EpsilonCache(epsilon_cache_path())
    cache.put(planted, 0.001)
    cache.put(other, 0.002)
    assert _shown(db, capsys)["epsilon"] == 0.001
    assert _shown(db, capsys, "--recompute") == truth
    assert _kept()[planted] == truth["epsilon"]


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["garbage", "negative", "nan"])
def test_a_damaged_cache_is_a_miss_never_an_error(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], own_cache: Path
) -> None:
    db = tmp_path / "ledger.sqlite"
    _ledger(db, 2)
    truth = _shown(db, capsys)
    if damage == "garbage":
        own_cache.write_bytes(b"not a database" * 100)
    else:
        value = -1.0 if damage == "negative" else "nan"
        with sqlite3.connect(own_cache) as conn:
            conn.execute("UPDATE epsilons SET epsilon = ?", (value,))
    assert _shown(db, capsys) == truth


@pytest.mark.unit
@settings(max_examples=30, deadline=None)
@given(
    counts=st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)),
    delta=st.sampled_from([1e-5, 1e-6]),
    unit=st.sampled_from(["task", "participant"]),
    method=st.sampled_from(["pld", "rdp"]),
)
def test_the_key_is_the_whole_input(
    counts: tuple[int, int], delta: float, unit: str, method: str
) -> None:
    """Equal inputs give one key; a change to any part of the input gives another."""
    rounds = ((FIXED, counts[0]), (CHEAP, counts[1]))
    key = composition_key(rounds, delta, unit, method)  # type: ignore[arg-type]
    assert key == composition_key(rounds, delta, unit, method)  # type: ignore[arg-type]
    changed = [
        (((FIXED, counts[0] + 1), (CHEAP, counts[1])), delta, unit, method),
        (((FIXED, counts[0]),), delta, unit, method),
        (rounds, delta * 2, unit, method),
        (rounds, delta, "task" if unit == "participant" else "participant", method),
        (rounds, delta, unit, "pld" if method == "rdp" else "rdp"),
    ]
    assert len({key, *(composition_key(*c) for c in changed)}) == 6  # type: ignore[arg-type]
