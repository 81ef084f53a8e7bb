"""A data budget apart from a run's target, and experiment ledgers (issue 22).

The data's (epsilon, delta) are recorded by the first run that spends on it and change only by
``fedmeta ledger new-budget``; a run's ``privacy.target_epsilon`` is allowed when it fits the
budget (a run is never refused for what its data spent before: its participants take part as far
as their data's budget allows, issue 52 item 6, tests/federation/test_individual_filter.py); an
experiment (``--experiment NAME``) spends from a ledger of its own and says so everywhere.
The runs go through ``fedmeta simulate`` in this process (the CLI's exit codes and one-line errors).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmeta.accounting import BudgetLedger
from fedmeta.cli import main
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config

from .test_round import SMALL


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _simulate(out: Path, *args: str) -> int:
    # z calibrated to the run's target (SMALL fixes it for speed elsewhere).
    extra = ["rounds=3", "output.plots=false", "output.progress=false",
             "privacy.noise_multiplier=none"]  # fmt: skip
    sets = [w for s in [*SMALL, *extra] for w in ("--set", s)]
    return main(["simulate", "--out", str(out), *sets, *args])


def _summary(out: Path) -> dict[str, object]:
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


def _spends(db: Path) -> int:
    return sum(
        len(BudgetLedger.open_readonly(db, f).records()) for f in BudgetLedger.federations(db)
    )


@pytest.mark.integration
def test_a_target_runs_within_the_data_budget_and_a_budget_is_not_a_runs_to_set(
    tmp_path: Path, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = state / "ledger.sqlite"
    assert _simulate(tmp_path / "a", "--set", "privacy.target_epsilon=1") == 0
    first = _summary(tmp_path / "a")
    assert first["epsilon_budget"] == 8.0 and first["target_epsilon"] == 1.0
    assert 0.9 < float(first["epsilon_spent"]) <= 1.0  # type: ignore[arg-type]
    spent = _spends(db)
    # Another budget in a run's configuration is refused, naming the recorded one and the fixes.
    capsys.readouterr()
    assert _simulate(tmp_path / "b", "--set", "privacy.epsilon_budget=4") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "privacy.epsilon_budget=4 is not the budget of this data (epsilon 8" in err
    assert "privacy.target_epsilon" in err and "--experiment NAME" in err
    assert "fedmeta ledger new-budget --db" in err and "--epsilon 4 --delta 1e-05" in err
    # So is another delta: delta is fixed per budget.
    assert _simulate(tmp_path / "c", "--set", "privacy.delta=1e-6") == 2
    assert "delta is fixed per budget" in capsys.readouterr().err
    # A target above the budget is a configuration error, before anything is written (exit 2).
    assert _simulate(tmp_path / "d", "--set", "privacy.target_epsilon=9") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "above the data's budget" in err, err
    assert _spends(db) == spent, "a refused run recorded a spend"
    assert not (tmp_path / "d" / "summary.json").exists()
    # The whole budget after a first run is not refused for what the data spent before (issue 52,
    # item 6): the run runs its rounds and publishes its own epsilon; its participants take part
    # only as far as their data's budget allows, so none goes over it.
    assert _simulate(tmp_path / "e", "--set", "privacy.target_epsilon=8") == 0
    second = _summary(tmp_path / "e")
    assert second["rounds_completed"] == 3 and second["stopped_reason"] == "planned_rounds"
    assert 7.9 < float(second["epsilon_spent"]) <= 8.0  # type: ignore[arg-type]
    assert _spends(db) == spent + 3 and len(BudgetLedger.federations(db)) == 1
    with BudgetLedger.open_readonly(db, str(second["federation_id"])) as ledger:
        assert ledger.epsilon() <= 8.0 * (1 + 1e-9)


@pytest.mark.integration
def test_an_operators_new_budget_sets_the_terms_the_next_run_adopts(
    tmp_path: Path, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = state / "ledger.sqlite"
    assert _simulate(tmp_path / "a") == 0  # the whole default budget
    (old,) = BudgetLedger.federations(db)
    with BudgetLedger.open_readonly(db, old) as ledger:
        spent = ledger.epsilon()
    # Runs on, its rounds charged to nobody: every participant's data is spent (issue 52, item 6).
    assert _simulate(tmp_path / "b") == 0
    with BudgetLedger.open_readonly(db, old) as ledger:
        assert ledger.epsilon() == spent and ledger.position() == 6
    capsys.readouterr()
    assert main(["ledger", "new-budget", "--db", str(db), "--federation", old, "--epsilon", "3",
                 "--reason", "test: the data was refreshed"]) == 0  # fmt: skip
    assert "epsilon 3" in capsys.readouterr().out
    # Unset in the configuration: the recorded budget (3, the old delta) is the run's.
    assert _simulate(tmp_path / "c") == 0
    summary = _summary(tmp_path / "c")
    assert summary["epsilon_budget"] == 3.0 and summary["delta"] == 1e-5
    assert summary["federation_id"] != old
    with BudgetLedger.open_readonly(db, str(summary["federation_id"])) as ledger:
        assert (ledger.epsilon_budget, ledger.delta) == (3.0, 1e-5)


@pytest.mark.integration
def test_an_experiment_has_its_own_ledger_and_every_output_says_so(
    tmp_path: Path, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _simulate(tmp_path / "main") == 0  # spends the production budget
    production = _spends(state / "ledger.sqlite")
    for eps in ("1", "2"):  # a sweep: one experiment per value
        out = tmp_path / f"eps-{eps}"
        capsys.readouterr()
        assert _simulate(out, "--experiment", f"eps-{eps}", "--set",
                         f"privacy.epsilon_budget={eps}") == 0  # fmt: skip
        printed = capsys.readouterr().out
        assert f"EXPERIMENT eps-{eps}" in printed  # the plan and the summary
        summary = _summary(out)
        assert summary["experiment"] == f"eps-{eps}" and summary["epsilon_budget"] == float(eps)
        assert _spends(state / "experiments" / f"eps-{eps}.sqlite") == 3
    assert _spends(state / "ledger.sqlite") == production, "an experiment spent production budget"
    # Resumed (nothing left to run), its checkpoint still names the experiment and no path.
    assert _simulate(tmp_path / "eps-1", "--experiment", "eps-1", "--resume") == 0
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(tmp_path / "eps-1" / "checkpoint.pt"),
                 "--tasks", "8", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["experiment"] == "eps-1"
    # A second run of the same experiment composes within it: budget 1 is spent, so its rounds
    # are charged to nobody (issue 52, item 6) and the experiment's epsilon stays where it was.
    experiment = state / "experiments" / "eps-1.sqlite"
    (fid,) = BudgetLedger.federations(experiment)
    with BudgetLedger.open_readonly(experiment, fid) as ledger:
        spent = ledger.epsilon()
    assert _simulate(tmp_path / "again", "--experiment", "eps-1") == 0
    with BudgetLedger.open_readonly(experiment, fid) as ledger:
        assert ledger.epsilon() == spent and ledger.position() == 6


@pytest.mark.unit
def test_experiments_are_for_public_benchmark_data_and_name_one_ledger(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="privacy.experiment is for public benchmark data"):
        load_config(None, ["dataset.name=image_folder", f"dataset.path={tmp_path}",
                           "privacy.experiment=x"])  # fmt: skip
    with pytest.raises(ConfigError, match="both name a ledger"):
        load_config(None, ["privacy.experiment=x", "privacy.ledger_path=l.sqlite"])
    with pytest.raises(ConfigError, match="privacy.experiment"):
        load_config(None, ["privacy.experiment=../escape"])
    cfg = load_config(None, ["privacy.experiment=sweep.1"])
    assert cfg.output.dir == "runs/sweep.1"
    assert load_config(None, ["privacy.experiment=s", "output.dir=o"]).output.dir == "o"


PLAN = ["privacy", "plan", "--epsilon", "2", "--participants", "6", "--tasks-per-participant",
        "20", "--max-tasks-per-round", "6", "--rounds", "6", "--designs", "flat_poisson",
        "--jobs", "1"]  # fmt: skip


@pytest.mark.integration
def test_a_written_plan_takes_the_delta_of_the_datas_budget(
    tmp_path: Path, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Data with no budget yet: the default delta.
    assert main([*PLAN, "--write-config", str(tmp_path / "p0.toml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"]["delta"] == 1e-5
    # The first run records this data's budget with delta 1e-6: plans for it use that delta.
    assert _simulate(tmp_path / "a", "--set", "privacy.delta=1e-6",
                     "--set", "privacy.target_epsilon=1") == 0  # fmt: skip
    capsys.readouterr()
    written = tmp_path / "p1.toml"
    assert main([*PLAN, "--write-config", str(written), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"]["delta"] == 1e-6
    assert load_config(written).privacy.delta == 1e-6
    # Another delta is refused before planning, in one line naming the budget's.
    assert main([*PLAN, "--delta", "1e-5", "--write-config", str(tmp_path / "p2.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not the delta of the budget recorded" in err, err
    assert not (tmp_path / "p2.toml").exists()
