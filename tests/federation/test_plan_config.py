"""`fedmeta privacy plan --write-config`: the file loads, the server records the planned event, and
`fedmeta simulate --config` runs it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from fedmeta.accounting.planner import (
    ComputeBudget,
    Federation,
    PlanBudget,
    PlanRequest,
    plan,
)
from fedmeta.cli.plan_config import write_config
from fedmeta.server.plan import build_plan

from fedmeta.config import load_config, to_toml
from tests.federation.test_e2e import fedmeta, sets

GRID = 1e-3


def request(**kw: object) -> PlanRequest:
    args: dict[str, object] = {
        "budget": PlanBudget(8.0, 1e-5),
        "federation": Federation(6, (20,)),
        "compute": ComputeBudget(max_tasks_per_round=6),
        "rounds": (6,),
        **kw,
    }
    return PlanRequest(**args)  # type: ignore[arg-type]


@pytest.mark.unit
def test_toml_writer_round_trips() -> None:
    data = {"rounds": 3, "a": {"x": 1.5e-06, "s": 'q"\\\n', "b": True, "l": [1, 2]},
            "f": {"node_keys": {"p 1": "SHA256:x"}, "y": 2}}  # fmt: skip
    assert tomllib.loads(to_toml(data)) == data


@pytest.mark.integration
@pytest.mark.parametrize("design", ["two_stage_poisson", "two_stage_fixed"])
def test_written_config_loads_and_the_server_records_the_planned_event(
    tmp_path: Path, design: str
) -> None:
    req = request(designs=(design,), participants_per_round=(3,))
    row = plan(req, discretization=GRID).rows[0]
    base = tmp_path / "base.toml"
    base.write_text("seed = 7\n[privacy]\ntarget_epsilon = 3.0\n[training]\nmeta_lr = 0.002\n")
    path = write_config(str(tmp_path / "plan.toml"), row, req, str(base))
    cfg = load_config(path)
    assert cfg.seed == 7 and cfg.training.meta_lr == 0.002  # the base's other keys are kept
    # The plan's epsilon is the run's target (its rounds must fit what the data has left); the
    # noise is the plan's, and the data's budget is not the plan's to set (issue 22).
    assert cfg.privacy.target_epsilon == 8.0
    assert "epsilon_budget" not in cfg.privacy.model_fields_set
    assert cfg.rounds == 6 and cfg.federation.participants == 6
    assert cfg.sampling.stage2 == ("fixed" if design == "two_stage_fixed" else "poisson")
    server = build_plan(cfg, {str(i): 20 for i in range(6)})
    assert server.event == row.event  # the event the ledger will record is the planned one
    assert server.normaliser == pytest.approx(row.expected_lot)


@pytest.mark.integration
def test_write_config_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    req = request(designs=("flat_poisson",), adaptive_count_noise=50.0)
    row = plan(req, discretization=GRID).rows[0]
    with pytest.raises(ValueError, match="adaptive_count_noise must be left out"):
        write_config(str(tmp_path / "p.toml"), row, req, None)
    bad = tmp_path / "bad.toml"
    bad.write_text("[privacy]\ndelta = 2.0\n")
    with pytest.raises(ValueError, match="privacy.delta"):
        write_config(str(tmp_path / "p.toml"), row, request(), str(bad))
    assert not (tmp_path / "p.toml").exists()


@pytest.mark.e2e
def test_plan_cli_writes_a_config_that_simulate_runs(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    res = fedmeta(
        "privacy", "plan", "--epsilon", "8", "--participants", "6", "--tasks-per-participant",
        "20", "--max-tasks-per-round", "6", "--rounds", "6", "--participants-per-round", "6,3",
        "--designs", "flat_poisson,two_stage_poisson", "--json", "--write-config", str(path),
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["config_written"] == str(path) and data["rows"][0]["design"] == "flat_poisson"
    out = tmp_path / "run"
    res = fedmeta(
        "simulate", "--config", str(path), "--out", str(out),
        *sets("federation.backend=inprocess", "dataset.validation_tasks=8", "dataset.test_tasks=8",
              "dataset.probe_tasks=2", "output.plots=false", "output.progress=false"),
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 6 and summary["stopped_reason"] == "planned_rounds"
    assert summary["epsilon_spent"] == pytest.approx(data["rows"][0]["epsilon"], abs=1e-6)
