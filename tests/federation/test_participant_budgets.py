"""Per-participant budgets (issue 18, item 1): a budget follows each participant's data across runs.

One participant fewer, one task more per participant, or one image added to an image folder keep
every participant's key, so the runs compose for the participants they share; the ledger reports
the maximum over participants and refuses a round that would take any of them over the budget.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    LedgerError,
    Participant,
    epsilon,
    resolve_federation,
)
from fedmeta.accounting.ledger.storage import PER_PARTICIPANT
from fedmeta.cli import main
from fedmeta.config import Config
from fedmeta.config_io import load_config
from fedmeta.server.app import execute
from fedmeta.server.budget_keys import budget_key, ledger_participants, participant_identity
from fedmeta.server.startup import open_budget
from fedmeta.server.transport import Registered
from fedmeta.simulation.local_grid import InProcessGrid
from fedmeta.workload import data_fingerprint

from .test_round import SMALL

EVENT = GaussianRound(FlatPoissonScheme(0.05), 1.0)


def _cfg(ledger: Path, *extra: str) -> Config:
    return load_config(None, [*SMALL, f"privacy.ledger_path={ledger}", "rounds=3", *extra])


def _run(cfg: Config, out: Path) -> None:
    execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=out, observers=[],
            echo=False)  # fmt: skip


def _by_name(ledger: BudgetLedger) -> dict[str, float]:
    return {p.name: p.epsilon for p in ledger.participants()}


@pytest.mark.integration
@pytest.mark.parametrize(
    ("second", "shared"),
    [(["federation.participants=5"], 5), (["dataset.tasks_per_participant=21"], 6)],
    ids=["one-participant-fewer", "one-task-more"],
)
def test_two_sinusoid_runs_compose_for_the_participants_they_share(
    tmp_path: Path, second: list[str], shared: int
) -> None:
    db = tmp_path / "ledger.sqlite"
    first = _cfg(db)
    _run(first, tmp_path / "a")
    _run(_cfg(db, *second), tmp_path / "b")
    fids = BudgetLedger.federations(db)
    assert len(fids) == 1, "the second run must spend from the same budget"
    with BudgetLedger.open_readonly(db, fids[0]) as ledger:
        records = ledger.records()
        runs = Counter(r.run_id for r in records)
        assert sorted(runs.values()) == [3, 3]
        both = epsilon(list(Counter(r.event for r in records).items()), ledger.delta, "task")
        one = epsilon(
            list(Counter(r.event for r in records if r.run_id == records[0].run_id).items()),
            ledger.delta, "task",
        )  # fmt: skip
        eps = _by_name(ledger)
        assert ledger.epsilon() == pytest.approx(both, rel=1e-12)
    assert len(eps) == first.federation.participants
    in_both = sorted(eps)[:shared]
    for name in in_both:
        assert eps[name] == pytest.approx(both, rel=1e-12), name
    for name in sorted(eps)[shared:]:  # the participant the second run did not have
        assert eps[name] == pytest.approx(one, rel=1e-12) and one < both


def _image_folder(root: Path, classes: int = 4, per: int = 3) -> None:
    rng = np.random.default_rng(0)
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per):
            Image.fromarray(rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)).save(d / f"{i}.png")


def _registered(cfg: Config, count: int) -> list[Registered]:
    digest = data_fingerprint(cfg)
    return [Registered(str(i), 100 + i, 10, digest) for i in range(count)]


@pytest.mark.unit
def test_an_image_added_to_a_folder_keeps_every_key_and_the_budget_composes(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "images"
    _image_folder(folder)
    db = tmp_path / "ledger.sqlite"
    cfg = load_config(None, ["dataset.name=image_folder", f"dataset.path={folder}",
                             f"privacy.ledger_path={db}"])  # fmt: skip
    before = _registered(cfg, 4)
    with open_budget(cfg, before) as ledger:
        ledger.spend(EVENT, "run-a", 0)
        fid = ledger.federation_id
    Image.fromarray(np.zeros((10, 12, 3), dtype=np.uint8)).save(folder / "class0" / "new.png")
    after = _registered(cfg, 4)
    assert after[0].data_fingerprint != before[0].data_fingerprint  # the content changed
    # The federation's key comes from the dataset's name and seed alone (BudgetKey), so the
    # registered content cannot change it; nor does it change a participant's identity.
    key = budget_key(cfg.dataset.name, cfg.seed)
    assert [participant_identity(key, r) for r in after] == [
        participant_identity(key, r) for r in before
    ]
    with open_budget(cfg, after) as ledger:
        assert ledger.federation_id == fid
        ledger.spend(EVENT, "run-b", 0)
        rows = ledger.participants()
        assert ledger.epsilon() == pytest.approx(epsilon([(EVENT, 2)], ledger.delta, "task"))
    assert [r.data_versions for r in rows] == [2, 2, 2, 2]  # the edit is reported, not a key


@pytest.mark.unit
def test_a_round_is_refused_when_any_participant_it_may_sample_is_over_budget(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ledger.sqlite"
    budget = epsilon([(EVENT, 3)], 1e-5, "task") * 1.0001
    people = [Participant(f"data#participant={i}", str(i)) for i in range(4)]
    with BudgetLedger.open(db, "fed", budget, 1e-5, participants=people[:2]) as ledger:
        for i in range(3):
            ledger.spend(EVENT, "run-a", i)
        assert ledger.would_exceed(EVENT)
    # Participants 2 and 3 have spent nothing: a run that samples only them may go on...
    with BudgetLedger.open(db, "fed", participants=people[2:]) as ledger:
        assert ledger.rounds_affordable(EVENT) == 3
        ledger.spend(EVENT, "run-b", 0)
        # ...but one that may also sample participant 1 may not.
        ledger.use_cohort(people[1:])
        assert ledger.would_exceed(EVENT)
        with pytest.raises(BudgetExhausted, match="a participant it may sample"):
            ledger.spend(EVENT, "run-b", 1)
        eps = {p.name: p.epsilon for p in ledger.participants()}
        assert ledger.position() == 4
    assert eps["0"] == eps["1"] == pytest.approx(epsilon([(EVENT, 3)], 1e-5, "task"))
    assert eps["2"] == eps["3"] == pytest.approx(epsilon([(EVENT, 1)], 1e-5, "task"))


@pytest.mark.unit
def test_records_without_a_cohort_count_against_every_participant(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 5.0, 1e-5) as ledger:  # a caller naming no participants
        ledger.spend(EVENT, "old", 0)
    people = [Participant(f"d#{i}", str(i)) for i in range(3)]
    with BudgetLedger.open(db, "fed", participants=people) as ledger:
        ledger.spend(EVENT, "new", 0)
        two = epsilon([(EVENT, 2)], 1e-5, "task")
        assert [p.epsilon for p in ledger.participants()] == pytest.approx([two] * 3)


@pytest.mark.unit
def test_the_ledger_keys_survive_churn(tmp_path: Path) -> None:
    cfg = load_config(None, ["federation.participants=5"])
    fewer = load_config(None, ["federation.participants=4", "dataset.tasks_per_participant=31"])
    members = {r.participant_id: r for r in _registered(cfg, 5)}
    key = budget_key(cfg.dataset.name, cfg.seed)
    keys = [p.identity for p in ledger_participants(key, members, members)]
    fewer_members = {r.participant_id: r for r in _registered(fewer, 4)}
    fewer_key = budget_key(fewer.dataset.name, fewer.seed)
    assert [p.identity for p in ledger_participants(fewer_key, fewer_members, fewer_members)] == (
        keys[:4]
    )
    # A node key authenticates a node; it names no budget (issue 39): enabling node
    # authentication or replacing a key keeps the participant's identity, and the federation's
    # key is built from the dataset's name and seed alone (BudgetKey: no registration in it).
    bound = Registered("0", 1, 10, "digest", node_key="SHA256:abc")
    assert participant_identity(key, bound) == keys[0]


def _as_schema2(db: Path) -> None:
    """Make a ledger look as schema 2 left it: no per-participant marker (test-only surgery on
    an append-only table; the cohort column and new tables, empty, are what migration adds)."""
    conn = sqlite3.connect(db)
    conn.execute("DROP TRIGGER meta_append_only_delete")
    conn.execute("DELETE FROM meta WHERE key = ?", (PER_PARTICIPANT,))
    conn.commit()
    conn.close()


@pytest.mark.unit
def test_a_schema2_ledger_is_refused_with_the_command_that_migrates_it(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    old = resolve_federation(db, "sinusoid-whole-data-fingerprint-P20-T10", label="sinusoid")
    with BudgetLedger.open(db, old, 5.0, 1e-5) as ledger:
        ledger.spend(EVENT, "old-run", 0)
        ledger.spend(EVENT, "old-run", 1)
    _as_schema2(db)
    with pytest.raises(LedgerError) as refused:
        resolve_federation(db, "sinusoid:sinusoid-v1:seed=0", label="sinusoid")
    message = str(refused.value)
    assert "\n" not in message and f"fedmeta ledger migrate --db {db}" in message and old in message
    assert main(["ledger", "migrate", "--db", str(db)]) == 0
    new = resolve_federation(db, "sinusoid:sinusoid-v1:seed=0", label="sinusoid")
    people = [Participant(f"p{i}", str(i)) for i in range(3)]
    with BudgetLedger.open(db, new, 5.0, 1e-5, participants=people) as ledger:
        ledger.spend(EVENT, "new-run", 0)
        three = epsilon([(EVENT, 3)], 1e-5, "task")
        assert [p.epsilon for p in ledger.participants()] == pytest.approx([three] * 3)
    assert main(["ledger", "migrate", "--db", str(db)]) == 0  # idempotent: nothing left
