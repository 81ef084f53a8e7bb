"""`fedmeta privacy plan --write-config`: the file loads, the server records the planned event, and
`fedmeta simulate --config` runs it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.federation.test_e2e import fedmeta, sets

from fedmeta.accounting.plan_request import (
    ComputeBudget,
    Federation,
    PlanBudget,
    PlanRequest,
    PlanRow,
)
from fedmeta.accounting.planner import plan
from fedmeta.cli.plan_config import write_config
from fedmeta.cli.privacy_plan import WrittenConfig
from fedmeta.config import Config
from fedmeta.config_io import load_config, to_toml
from fedmeta.server.plan import build_plan
from fedmeta.server.rate_advice import HIGH_SNR, LOW_SNR, SMALLEST_FACTOR, advise_rate

GRID = 1e-3
#: `fedmeta privacy plan` for the federation of :func:`request`: 6 participants of 20 tasks each.
SMALL_PLAN = ("privacy", "plan", "--epsilon", "8", "--participants", "6", "--tasks-per-participant",
              "20", "--max-tasks-per-round", "6", "--rounds", "6")  # fmt: skip


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
    written = write_config(str(tmp_path / "plan.toml"), row, req, str(base))
    assert written.notes == ()  # no signal given: no training advice, the base's rate is kept
    cfg = load_config(written.path)
    assert cfg.seed == 7 and cfg.training.meta_lr == 0.002  # the base's other keys are kept
    # The plan's epsilon is the run's target (its rounds must fit what the data has left); the
    # noise is the plan's, and the data's budget is not the plan's to set (issue 22).
    assert cfg.privacy.target_epsilon == 8.0
    assert "epsilon_budget" not in cfg.privacy.model_fields_set
    assert cfg.rounds == 6 and cfg.federation.participants == 6
    assert cfg.sampling.stage2 == ("fixed" if design == "two_stage_fixed" else "poisson")
    server = build_plan(cfg, {str(i): 20 for i in range(6)})
    assert server.privacy is not None
    assert server.privacy.event == row.event  # the event the ledger will record is the planned one
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
        *SMALL_PLAN, "--participants-per-round", "6,3", "--designs",
        "flat_poisson,two_stage_poisson", "--json", "--write-config", str(path), timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["config_written"] == str(path) and data["rows"][0]["design"] == "flat_poisson"
    assert data["config_notes"] == []  # no --signal-norm: no training advice
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


@pytest.mark.unit
def test_rate_advice_at_the_measured_ends_and_between() -> None:
    # The measured ends (server/fedmeta/server/rate_advice.py): the base rate at high SNR, a tenth
    # at low SNR.
    high = advise_rate(38.0, 0.00123456)
    assert high.rate == 0.00123456 and not high.select_best_validation  # kept is kept, unrounded
    assert advise_rate(0.85, 0.003).rate == pytest.approx(0.0003)
    assert advise_rate(1.41, 0.003).rate == pytest.approx(0.0003)
    assert advise_rate(0.0, 0.003).select_best_validation
    # Log-linear between: the geometric middle of the SNRs gets the geometric middle of the factors.
    middle = (LOW_SNR * HIGH_SNR) ** 0.5
    assert advise_rate(middle, 1.0).factor == pytest.approx(SMALLEST_FACTOR**0.5)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="run_snr"):
            advise_rate(bad, 0.003)
    with pytest.raises(ValueError, match="base_rate"):
        advise_rate(2.0, 0.0)


@pytest.mark.unit
@given(a=st.floats(0, 100), b=st.floats(0, 100), base=st.floats(1e-6, 1.0))
def test_rate_advice_never_raises_the_rate_for_less_signal(a: float, b: float, base: float) -> None:
    low, high = sorted((a, b))
    weak, strong = advise_rate(low, base), advise_rate(high, base)
    assert SMALLEST_FACTOR <= weak.factor <= strong.factor <= 1
    assert weak.select_best_validation or not strong.select_best_validation


def _advised(
    tmp_path: Path, base_text: str, signal_norm: float, dimension: int
) -> tuple[PlanRow, WrittenConfig, Config]:
    """Plan one flat-Poisson row with this signal, write it over ``base_text``, load it back."""
    req = request(designs=("flat_poisson",), signal_norm=signal_norm, dimension=dimension)
    row = plan(req, discretization=GRID).rows[0]
    assert row.run_snr is not None
    base = tmp_path / f"base-{signal_norm}-{dimension}.toml"
    base.write_text(base_text)
    written = write_config(str(tmp_path / f"plan-{signal_norm}-{dimension}.toml"), row, req,
                           str(base))  # fmt: skip
    return row, written, load_config(written.path)


@pytest.mark.integration
def test_written_config_takes_the_rate_and_selection_its_snr_calls_for(tmp_path: Path) -> None:
    row, written, cfg = _advised(tmp_path, "[training]\nmeta_lr = 0.003\n", 0.01, 100_000)
    assert row.run_snr is not None and row.run_snr <= LOW_SNR
    assert cfg.training.meta_lr == pytest.approx(0.0003)
    assert cfg.training.model_selection == "best_validation"
    assert len(written.notes) == 2 and "run SNR" in written.notes[0]
    text = Path(written.path).read_text()
    assert all(f"# {note}" in text for note in written.notes)  # the file says why, too
    row, written, cfg = _advised(tmp_path, "[training]\nmeta_lr = 0.003\n", 0.99, 1)
    assert row.run_snr is not None and row.run_snr >= HIGH_SNR
    assert cfg.training.meta_lr == 0.003 and cfg.training.model_selection == "last"
    assert len(written.notes) == 1 and "kept training.meta_lr = 0.003" in written.notes[0]


@pytest.mark.integration
def test_selection_is_not_written_where_the_configuration_refuses_it(tmp_path: Path) -> None:
    # Omniglot's background split validates on its test classes: best_validation is refused
    # there, so the advice keeps 'last' and says why instead of writing a file that fails.
    base = '[dataset]\nname = "omniglot"\npath = "data"\nsplit = "background"\n'
    _, written, cfg = _advised(tmp_path, base + "[training]\nmeta_lr = 0.003\n", 0.01, 100_000)
    assert cfg.training.model_selection == "last"
    assert cfg.training.meta_lr == pytest.approx(0.0003)
    assert "kept training.model_selection = 'last'" in written.notes[1]
    assert "training.model_selection" in written.notes[1].split(": ", 1)[1]


@pytest.mark.integration
def test_an_interpolated_rate_and_a_selection_already_made(tmp_path: Path) -> None:
    base = '[training]\nmeta_lr = 0.003\nmodel_selection = "best_validation"\n'
    row, written, cfg = _advised(tmp_path, base, 0.5, 1)
    assert row.run_snr is not None and LOW_SNR < row.run_snr < HIGH_SNR
    assert 0.0003 < cfg.training.meta_lr < 0.003
    assert cfg.training.meta_lr == pytest.approx(advise_rate(row.run_snr, 0.003).rate)
    assert cfg.training.model_selection == "best_validation"
    assert len(written.notes) == 1 and "interpolated" in written.notes[0]  # nothing to say twice


@pytest.mark.e2e
def test_plan_cli_prints_what_it_chose_beyond_the_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    res = fedmeta(
        *SMALL_PLAN, "--designs", "flat_poisson", "--dimension", "100000", "--signal-norm", "0.01",
        "--write-config", str(path), timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    wrote = next(i for i, line in enumerate(lines) if line.startswith("wrote row 1 to"))
    assert lines[wrote + 1].strip().startswith("training.meta_lr = ")
    assert lines[wrote + 2].strip().startswith("training.model_selection = 'best_validation'")
    assert load_config(path).training.model_selection == "best_validation"
