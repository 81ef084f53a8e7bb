"""``fedmeta tune --trials random``: K trials, the best released, one tuning release in the ledger.

The release is recorded before the first trial; the trials' rounds are not spent as ordinary
rounds; a later ordinary run on the same data composes with it; a tuning that cannot fit is
refused before any trial; the default mode is the cheaper one (cli/fedmeta/cli/tune_random.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedmeta.accounting import BudgetLedger, InsecureSeededSource, current_budget, epsilon
from fedmeta.accounting.tuning import tuning_epsilon
from fedmeta.accounting.tuning_release import TuningRelease, release_epsilon
from fedmeta.cli.tune import TuneRefused, _planned_rounds, main, random_run
from fedmeta.cli.tune_random import TrialOffPlan
from fedmeta.config_io import load_config
from fedmeta.simulation.simulate import main as simulate
from fedmeta.workload import declared_identity

from .test_round import SMALL

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CANDIDATES = ["training.meta_lr=0.01", "training.meta_lr=0.001 training.inner_lr=0.02"]
SEED = 7


def _sets(tmp: Path, budget: float = 60.0) -> list[str]:
    return [*SMALL, f"privacy.ledger_path={tmp / 'ledger.sqlite'}", "privacy.insecure_test_seed=3",
            f"privacy.epsilon_budget={budget}", "privacy.delta=1e-5"]  # fmt: skip


def _args(tmp: Path, sets: list[str], **kw: object) -> argparse.Namespace:
    base = {"config": None, "overrides": sets, "candidates": CANDIDATES, "out": tmp / "tune",
            "dry_run": False, "trials": "random", "mean_trials": 1.5, "distribution": "negbin",
            "eta": 1.0}  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def _ledger(tmp: Path, sets: list[str]) -> BudgetLedger:
    cfg = load_config(None, sets)
    terms = current_budget(tmp / "ledger.sqlite", declared_identity(cfg.dataset.name, cfg.seed),
                           label="sinusoid")  # fmt: skip
    assert terms is not None
    return BudgetLedger.open_readonly(tmp / "ledger.sqlite", terms.federation_id)


def test_random_mode_records_one_release_and_a_later_run_composes_with_it(tmp_path: Path) -> None:
    sets = _sets(tmp_path)
    simulate(load_config(None, sets), out_dir=tmp_path / "earlier")
    with _ledger(tmp_path, sets) as ledger:
        before, rounds_before = ledger.epsilon(), ledger.rounds()
    out = main(_args(tmp_path, sets), source=InsecureSeededSource(SEED))
    assert out["mode"] == "random" and out["epsilon_before"] == pytest.approx(before, rel=1e-9)
    with _ledger(tmp_path, sets) as ledger:
        records = ledger.records()
        release = records[-1].event
        # One record for the whole tuning: no trial's round was spent as an ordinary round.
        assert isinstance(release, TuningRelease) and len(records) == 6 + 1
        assert ledger.epsilon() == pytest.approx(out["epsilon_after"], rel=1e-12)
        priced = out["prices"]["epsilon_after_random"]
        assert out["epsilon_after"] == pytest.approx(priced, rel=1e-9)
    # Only the best trial is released, and nothing says how many trials ran.
    tune = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert tune["prices"]["epsilon_after_random"] == pytest.approx(tune["epsilon_after"], rel=1e-9)
    assert sorted(p.name for p in (tmp_path / "tune").iterdir()) == ["chosen", "tune.json"]
    assert tune["chosen"]["candidate"] in CANDIDATES and "trials_run" not in json.dumps(tune)
    chosen = json.loads((tmp_path / "tune" / "chosen" / "summary.json").read_text())
    assert chosen["rounds_completed"] == 6  # its scratch ledger let it run its whole plan
    # A later ordinary run on the same data: the ledger's epsilon includes the tuning release; the
    # run publishes its own (issue 52, item 6: never what its data spent before).
    simulate(load_config(None, sets), out_dir=tmp_path / "later")
    with _ledger(tmp_path, sets) as ledger:
        assert ledger.position() == 6 + 1 + 6
        (event, count), = rounds_before  # the earlier run: 6 rounds of one event
        expected = release_epsilon([(event, 2 * count), (release, 1)], 1e-5, "task")
        assert ledger.epsilon() == pytest.approx(expected, rel=1e-12)
        summary = json.loads((tmp_path / "later" / "summary.json").read_text())
        own = epsilon([(event, count)], 1e-5, "task")
        assert summary["epsilon_spent"] == pytest.approx(own, rel=1e-6)


def test_random_mode_over_the_budget_is_refused_before_any_trial(tmp_path: Path) -> None:
    # A budget between the earlier run's epsilon and that run plus the tuning's, recorded by it.
    cands = [(c, load_config(None, [*_sets(tmp_path), *c.split()])) for c in CANDIDATES]
    earlier = _planned_rounds(load_config(None, _sets(tmp_path)))
    spent = epsilon([earlier], 1e-5)
    price = tuning_epsilon(random_run(_args(tmp_path, []), cands), 1e-5, [[earlier]])
    sets = _sets(tmp_path, budget=0.5 * (spent + price))
    simulate(load_config(None, sets), out_dir=tmp_path / "earlier")
    with _ledger(tmp_path, sets) as ledger:
        assert ledger.position() == 6 and ledger.epsilon() == pytest.approx(spent, rel=1e-9)
    with pytest.raises(TuneRefused) as refused:
        main(_args(tmp_path, sets), source=InsecureSeededSource(SEED))
    line = str(refused.value)
    assert line.startswith("tuning refused before any trial") and "\n" not in line
    assert "what fits" in line and "the each mode would reach epsilon" in line
    assert not (tmp_path / "tune").exists()
    with _ledger(tmp_path, sets) as ledger:
        assert ledger.position() == 6


MANY = [f"training.meta_lr={lr}" for lr in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)]


@pytest.mark.parametrize(("candidates", "mean", "cheaper"), [
    (CANDIDATES, 8.0, "each"),  # 2 runs composed by PLD beat 8 expected trials
    (MANY, 1.5, "random"),  # 6 runs composed cost more than 1.5 expected trials
])  # fmt: skip
def test_the_default_mode_is_the_cheaper_one_priced_before_any_trial(
    tmp_path: Path, candidates: list[str], mean: float, cheaper: str
) -> None:
    args = _args(tmp_path, _sets(tmp_path), candidates=candidates, trials="cheaper",
                 dry_run=True, mean_trials=mean)  # fmt: skip
    out = main(args)
    assert out["dry_run"] and out["mode"] == cheaper
    assert min(out["epsilon_after_each"], out["epsilon_after_random"]) == (
        out[f"epsilon_after_{cheaper}"])
    assert not (tmp_path / "ledger.sqlite").exists()  # priced from the plans alone


def test_the_command_line_prices_the_random_mode_and_names_a_bad_law(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "fedmeta.cli", "tune", "--out", str(tmp_path / "t"), "--dry-run",
           "--trials", "random", "--mean-trials", "3", "--distribution", "negbin"]  # fmt: skip
    for s in _sets(tmp_path):
        cli += ["--set", s]
    cli += [a for c in CANDIDATES for a in ("--candidate", c)]
    done = subprocess.run([*cli, "--eta", "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    priced = json.loads(done.stdout)
    assert priced["mode"] == "random" and priced["epsilon_after_random"] > 0
    bad = subprocess.run([*cli, "--eta", "-1"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--mean-trials/--eta" in bad.stderr


@pytest.mark.parametrize(("factor", "why"), [
    (2.0, "does not fit the price of its plan"),  # refused at its first round
    (0.9, "recorded rounds outside its plan"),  # fits the price, but is not the planned round
])  # fmt: skip
def test_a_trial_off_its_plan_stops_the_tuning_with_nothing_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, factor: float, why: str
) -> None:
    import fedmeta.cli.tune as tune

    planned = tune._planned_rounds

    def other(cfg: object) -> tuple[object, int]:  # the plan priced is not the round that runs
        event, rounds = planned(cfg)
        return dataclasses.replace(event, noise_multiplier=factor * event.noise_multiplier), rounds

    monkeypatch.setattr(tune, "_planned_rounds", other)
    sets = _sets(tmp_path)
    with pytest.raises(TrialOffPlan, match=f"{why}.*; nothing was released"):
        main(_args(tmp_path, sets), source=InsecureSeededSource(SEED))
    assert sorted(p.name for p in (tmp_path / "tune").iterdir()) == []
    with _ledger(tmp_path, sets) as ledger:  # the release stays: the price of what ran
        assert [type(r.event) for r in ledger.records()] == [TuningRelease]


def _released(out: Path) -> tuple[list[str], set[str], set[float]]:
    """A tuning's released files: their names, every path string they hold (the --out folder
    written as OUT), and their modification times."""
    import torch

    def strings(value: object) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
        if isinstance(value, list | tuple):
            return [s for v in value for s in strings(v)]
        return []

    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    held = strings(json.loads((out / "tune.json").read_text()))
    held += strings(json.loads((out / "chosen" / "summary.json").read_text()))
    held += strings(torch.load(out / "chosen" / "checkpoint.pt", weights_only=False))
    held += (out / "chosen" / "rounds.csv").read_text().split(",")
    paths = {s.replace(str(out), "OUT") for s in held if str(out) in s}
    times = {p.stat().st_mtime for p in [out, *out.rglob("*")]}
    return files, paths, times


def test_no_released_file_path_or_time_reveals_the_number_of_trials_or_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 52, item 7: ``chosen/summary.json`` and ``checkpoint.pt`` named the winner's scratch
    ledger ``.trials/t4.ledger.sqlite`` and the files' times timed the later trials. One trial,
    then four whose last wins: the same files, the same paths, one time, from before the trials."""
    import time

    import fedmeta.accounting.tuning as tuning
    import fedmeta.cli.tune as tune

    seen: list[float] = []  # when each trial ended

    def score(summary: object, outcomes: object) -> float:  # the latest trial scores best
        seen.append(time.time())
        return 10.0 - len(seen)  # the sinusoid's metric (mse): lower is better

    monkeypatch.setattr(tune, "validation_score", score)
    released = []
    for count in (1, 4):
        monkeypatch.setattr(tuning, "draw_trials", lambda law, source, k=count: k)
        seen.clear()
        before = time.time()
        out = main(_args(tmp_path / f"k{count}", _sets(tmp_path / f"k{count}")),
                   source=InsecureSeededSource(SEED))  # fmt: skip
        assert len(seen) == count and out["chosen"]["validation_metric"] == 10.0 - count
        files, paths, times = _released(tmp_path / f"k{count}" / "tune")
        assert len(times) == 1 and before <= times.pop() <= seen[0], "times reveal the trials"
        released.append((files, paths))
    assert released[0] == released[1], "the released files differ with the number of trials"
    assert not any("/t0" in p or "/t3" in p for p in released[1][1])
