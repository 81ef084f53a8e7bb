"""Sample-level rounds in the ledger (issue 53): recorded with their kind, composed, one level.

A ``SampleLevelRound`` is one spend in the same hash-chained ``spends`` table as task-level
rounds, its event JSON carrying ``"kind": "sample_level_round"``; it is read back as itself and
composed per participant group through its dominating pair (accounting/levels.py), so every
epsilon the ledger reports equals the accountant's (sample_level_bound.py). A federation holds
one level: a spend of the other level is refused in one line naming the recorded level and
``fedmeta ledger new-budget``, with nothing written, checked again under the write lock.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

import pytest

from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    LedgerError,
    LevelMismatch,
    Participant,
    epsilon,
    resolve_federation,
    start_new_budget,
)
from fedmeta.accounting.calibration import affordable_rounds
from fedmeta.accounting.sample_level import ExampleSampling, SampleLevelRound
from fedmeta.accounting.sample_level_bound import (
    dominating_round,
    sample_level_epsilon,
    sample_level_max_rounds,
)
from fedmeta.accounting.tuning import Candidate, PoissonTrials, TuningRun, describe, release_of
from fedmeta.accounting.tuning_release import recorded_from_dict
from fedmeta.cli import ledger as ledger_cli

pytestmark = pytest.mark.unit
DELTA = 1e-5
SAMPLE = SampleLevelRound(ExampleSampling(20, 5, 0.01), 3.0, 4.0, 2, 2)
SINGLE = SampleLevelRound(ExampleSampling(1, 1, 0.005), 2.0, 2.0, 1, 1)
TASK = GaussianRound(FlatPoissonScheme(0.01), 1.1)
RUN = TuningRun((Candidate("a", TASK, 10),), PoissonTrials(2.0))
RELEASE = release_of(RUN, describe(RUN))


def _open(path: Path, fid: str = "fed", budget: float = 8.0) -> BudgetLedger:
    return BudgetLedger.open(path, fid, budget, DELTA)


def _rows(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [r[0] for r in conn.execute("SELECT event FROM spends ORDER BY position")]


@pytest.mark.parametrize("event", [SAMPLE, SINGLE])
def test_a_sample_level_round_is_recorded_with_its_kind_and_read_back(
    tmp_path: Path, event: SampleLevelRound
) -> None:
    db = tmp_path / "ledger.sqlite"
    with _open(db) as ledger:
        for i in range(3):
            ledger.spend(event, "run-1", i)
    stored = json.loads(_rows(db)[0])
    assert stored["kind"] == "sample_level_round"
    assert recorded_from_dict(stored) == event
    with BudgetLedger.open_readonly(db, "fed") as reader:  # verifies the hash chain
        assert [r.event for r in reader.records()] == [event] * 3
        assert reader.recorded_level() == "sample"
        assert dict(reader.rounds()) == {event: 3}
        # Composed through the dominating pair: the accountant's own example-level epsilon.
        assert reader.epsilon() == pytest.approx(sample_level_epsilon(event, 3, DELTA), rel=1e-12)
        assert reader.epsilon(method="rdp") == pytest.approx(
            sample_level_epsilon(event, 3, DELTA, "rdp"), rel=1e-12
        )


def test_rounds_affordable_and_refusal_follow_the_accountant(tmp_path: Path) -> None:
    budget, busy = 2.0, SampleLevelRound(ExampleSampling(1, 1, 0.5), 2.0, 2.0, 1, 1)
    fit = sample_level_max_rounds(busy, budget, DELTA)
    assert 1 < fit < 50  # the test needs a budget that runs out within a few rounds
    with _open(tmp_path / "ledger.sqlite", budget=budget) as ledger:
        assert ledger.rounds_affordable(busy) == fit
        for i in range(fit):
            ledger.spend(busy, "run-1", i)
        assert ledger.would_exceed(busy)
        with pytest.raises(BudgetExhausted, match="nothing was recorded"):
            ledger.spend(busy, "run-1", fit)
        assert ledger.position() == fit
        assert ledger.epsilon() <= budget


def test_each_participant_group_composes_its_own_sample_level_rounds(tmp_path: Path) -> None:
    alice, bob = Participant("p0", "alice"), Participant("p1", "bob")
    with _open(tmp_path / "ledger.sqlite") as ledger:
        ledger.use_cohort([alice, bob])
        ledger.spend(SAMPLE, "both", 0)
        ledger.use_cohort([bob])
        ledger.spend(SAMPLE, "bob", 0)
        ledger.spend(SINGLE, "bob", 1)
        once, more = sorted(p.epsilon for p in ledger.participants())
        assert ledger.epsilon() == pytest.approx(more, rel=1e-12)
    assert once == pytest.approx(sample_level_epsilon(SAMPLE, 1, DELTA), rel=1e-12)
    assert more == pytest.approx(
        epsilon([(dominating_round(SAMPLE), 2), (dominating_round(SINGLE), 1)], DELTA), rel=1e-12
    )
    assert affordable_rounds([(SAMPLE, 2)], SINGLE, 8.0, DELTA) == affordable_rounds(
        [(dominating_round(SAMPLE), 2)], dominating_round(SINGLE), 8.0, DELTA
    )


@pytest.mark.parametrize(
    ("first", "then", "recorded"),
    [(TASK, SAMPLE, "task"), (SAMPLE, TASK, "sample"), (RELEASE, SAMPLE, "task")],
)
def test_a_spend_of_the_other_level_is_refused_in_one_line_and_writes_nothing(
    tmp_path: Path, first: object, then: object, recorded: str
) -> None:
    db = tmp_path / "ledger.sqlite"
    with _open(db) as ledger:
        if isinstance(first, GaussianRound | SampleLevelRound):
            ledger.spend(first, "run-1", 0)
        else:
            ledger.spend_release(RELEASE, "tune-1")
        rows = _rows(db)
        assert isinstance(then, GaussianRound | SampleLevelRound)
        for attempt in (lambda: ledger.spend(then, "run-2", 0),
                        lambda: ledger.would_exceed(then)):  # fmt: skip
            with pytest.raises(LevelMismatch) as caught:
                attempt()
            line = str(caught.value)
            assert "\n" not in line and f"records {recorded}-level spends" in line
            assert "fedmeta ledger new-budget --db" in line and "--federation fed" in line
            assert caught.value.recorded == recorded
        assert _rows(db) == rows and ledger.position() == 1


def test_a_tuning_release_is_refused_on_sample_level_data(tmp_path: Path) -> None:
    with _open(tmp_path / "ledger.sqlite") as ledger:
        ledger.spend(SAMPLE, "run-1", 0)
        with pytest.raises(LevelMismatch, match="records sample-level spends"):
            ledger.spend_release(RELEASE, "tune-1")
        assert ledger.position() == 1


def test_the_level_is_rechecked_when_spending(tmp_path: Path) -> None:
    """Another process records the first task-level spend after this one last looked."""
    db = tmp_path / "ledger.sqlite"
    with _open(db) as mine, _open(db) as other:
        assert mine.rounds_affordable(SAMPLE) > 0  # saw an empty federation
        other.spend(TASK, "other", 0)
        with pytest.raises(LevelMismatch, match="records task-level spends"):
            mine.spend(SAMPLE, "mine", 0)
    assert len(_rows(db)) == 1


def test_the_level_is_rechecked_under_the_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other level lands during the search, charged to a cohort this spend does not reach.

    Nothing this spend composes changed, so only the level check under the lock can see it.
    """
    db = tmp_path / "ledger.sqlite"
    with _open(db) as mine, _open(db) as other:
        mine.use_cohort([Participant("p0", "alice")])
        other.use_cohort([Participant("p1", "carol")])
        search = mine._max_total

        def search_while_another_spends(base: tuple[object, ...], event: SampleLevelRound) -> int:
            if other.position() == 0:
                other.spend(TASK, "other", 0)
            return search(base, event)

        monkeypatch.setattr(mine, "_max_total", search_while_another_spends)
        with pytest.raises(LevelMismatch, match="records task-level spends"):
            mine.spend(SAMPLE, "mine", 0)
    assert len(_rows(db)) == 1


def test_a_new_budget_takes_the_other_level(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    fid = resolve_federation(db, "sinusoid:sinusoid-v1:seed=0", label="sinusoid")
    with _open(db, fid) as ledger:
        ledger.spend(TASK, "run-1", 0)
    new = start_new_budget(db, fid, "sample-level runs from now on")
    with _open(db, new) as ledger:
        assert ledger.recorded_level() is None
        ledger.spend(SAMPLE, "run-2", 0)
        assert ledger.recorded_level() == "sample"
    with BudgetLedger.open_readonly(db, fid) as old:
        assert old.recorded_level() == "task"


def test_a_composition_never_mixes_levels() -> None:
    with pytest.raises(ValueError, match="level must be the same for all rounds"):
        epsilon([(TASK, 1), (SAMPLE, 1)], DELTA)
    with pytest.raises(ValueError, match="level must be the same for all rounds"):
        epsilon([(RELEASE, 1), (SAMPLE, 1)], DELTA)
    assert epsilon([(TASK, 1), (SAMPLE, 0)], DELTA) == epsilon([(TASK, 1)], DELTA)


def test_a_recorded_round_with_a_wrong_kind_or_keys_is_refused() -> None:
    data = SAMPLE.to_dict()
    with pytest.raises(ValueError, match="must have exactly the keys"):
        SampleLevelRound.from_dict({**data, "kind": "tuning_release"})
    with pytest.raises(ValueError, match="must have exactly the keys"):
        SampleLevelRound.from_dict({k: v for k, v in data.items() if k != "kind"})


def test_a_participant_unit_federation_refuses_sample_level_rounds(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 8.0, DELTA, unit="participant") as ledger:
        with pytest.raises(LedgerError, match="unit must be 'task' for sample-level rounds"):
            ledger.spend(SAMPLE, "run-1", 0)
        assert ledger.position() == 0


def test_ledger_show_reads_a_sample_level_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    db = tmp_path / "ledger.sqlite"
    with _open(db) as ledger:
        ledger.spend(SAMPLE, "run-1", 0)
    parser = argparse.ArgumentParser(prog="fedmeta")
    ledger_cli.register(parser.add_subparsers(dest="command"))
    for extra in ([], ["--json"]):
        args = parser.parse_args(["ledger", "show", "--db", str(db), "--recompute", *extra])
        assert args.func(args) == 0
    text, _, payload = capsys.readouterr().out.partition("\n{")
    assert "example level" in text and '"kind": "sample_level_round"' in text
    (federation,) = json.loads("{" + payload)["federations"]
    assert federation["level"] == "sample"
    assert federation["epsilon"] == pytest.approx(sample_level_epsilon(SAMPLE, 1, DELTA))


def test_a_recorded_sample_level_round_reads_like_other_records() -> None:
    """What callers ask of every recorded event: its relation and participant cap."""
    assert SAMPLE.neighbouring == "add_remove" and SAMPLE.participant_cap is None
