"""Sample-level DP-MAML in real runs (issue 53): configuration, the run, the ledger, hostile rows.

``privacy.level = "sample"`` runs the seed paper's Algorithm 2 through ``fedmeta simulate`` on a
small generated Omniglot (the format of tests/federation/test_seen_in_run.py): the ledger records
``SampleLevelRound`` events, the reported epsilon is the accountant's ``sample_level_epsilon`` of
the recorded rounds, a run over spent data runs with its participants excluded (the individual
filter), a budget whose data holds task-level spends refuses a sample-level run (exit 2, one line
naming the fix), and the server re-checks each query example's row as it re-checks a task's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedmeta.accounting import BudgetLedger
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.accounting.sample_level_bound import sample_level_epsilon
from fedmeta.cli import main
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.protocol import GradientReply
from fedmeta.server.plan import build_plan
from fedmeta.server.validation import (
    REASON_BAD_SHAPE,
    REASON_UNREQUESTED_TASK,
    Accepted,
    Expectation,
    Rejected,
    validate_reply,
)

DIM = 6
C_OUT = 1.5


def _omniglot(root: Path) -> None:
    """6 background and 104 evaluation characters of 20 drawings, 28 x 28."""
    rng = np.random.default_rng(0)
    for part, n_chars in (("images_background", 6), ("images_evaluation", 104)):
        strokes = rng.random((n_chars, 1, 28, 28)) < 0.15
        images = ~(strokes ^ (rng.random((n_chars, 20, 28, 28)) < 0.03))
        np.savez_compressed(root / f"{part}.npz", images=images)


#: A sample-level run on the generated data: group norm, first order, no adaptive clipping.
SAMPLE = [
    "privacy.level=sample", "privacy.adaptive_clipping.enabled=false",
    "training.first_order=true", "dataset.norm=group", "dataset.filters=32",
    "privacy.sample.example_rate=0.2", "privacy.sample.max_appearances=2",
    "privacy.sample.tasks_per_pass=2", "privacy.sample.inner_clip=2",
]  # fmt: skip


def _sets(data: Path) -> list[str]:
    return [
        "dataset.name=omniglot", f"dataset.path={data}", "dataset.split=evaluation",
        "dataset.ways=3", "dataset.shots=1", "dataset.query=2", "dataset.tasks_per_participant=20",
        "dataset.test_tasks=4", "dataset.validation_tasks=4", "dataset.probe_tasks=0",
        "federation.participants=2", "federation.backend=inprocess", "rounds=2",
        "training.eval_every=2", "training.eval_inner_steps=1", "output.progress=false",
        "output.plots=false", "privacy.epsilon_budget=40", f"privacy.clip={C_OUT}",
    ]  # fmt: skip


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "omniglot"
    root.mkdir()
    _omniglot(root)
    return root


def _simulate(data: Path, out: Path, *sets: str) -> int:
    words = [w for s in [*_sets(data), *sets] for w in ("--set", s)]
    return main(["simulate", "--out", str(out), *words])


def _summary(out: Path) -> dict[str, object]:
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ configuration


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("dataset.name=sinusoid", "dataset.name = 'sinusoid'"),
        ("training.first_order=false", "training.first_order = true"),
        ("training.meta_sgd=true", "training.meta_sgd = false"),
        ("dataset.norm=batch", "dataset.norm = 'group'"),
        ("privacy.adaptive_clipping.enabled=true", "privacy.adaptive_clipping.enabled = false"),
        ("privacy.enabled=false", "privacy.enabled = true"),
        ("dataset.rotations=true", "dataset.rotations = false"),
        ("training.inner_steps=0", "training.inner_steps must be >= 1"),
        ("privacy.neighbouring=replace_one", "privacy.neighbouring must be 'add_remove'"),
        ("federation.reply_format=sum_and_norms", "federation.reply_format must be 'per_task'"),
        ("training.trained_parameters=head", "training.trained_parameters must be 'all'"),
        ("privacy.noise_multiplier=2", "privacy.sample.inner_noise_multiplier (z_in)"),
        ("privacy.sample.example_rate=0", "privacy.sample.example_rate"),
        ("privacy.sample.max_appearances=0", "privacy.sample.max_appearances"),
        ("privacy.sample.inner_clip=-1", "privacy.sample.inner_clip"),
        ("privacy.level=example", "privacy.level"),
    ],
)
def test_every_unsupported_sample_level_setting_is_one_line_naming_the_fix(
    tmp_path: Path, change: str, named: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, [*_sets(tmp_path), *SAMPLE, change])
    text = str(error.value)
    assert named in text and "\n" not in text


@pytest.mark.unit
def test_task_level_is_the_default_and_a_valid_sample_config_loads(tmp_path: Path) -> None:
    assert load_config(None, _sets(tmp_path)).privacy.level == "task"
    cfg = load_config(None, [*_sets(tmp_path), *SAMPLE])
    assert cfg.privacy.level == "sample" and cfg.privacy.sample.max_appearances == 2


@pytest.mark.unit
def test_the_plan_holds_the_sample_level_round_and_a_resume_keeps_its_noise(tmp_path: Path) -> None:
    cfg = load_config(None, [*_sets(tmp_path), *SAMPLE])
    counts = {"0": 20, "1": 20}
    plan = build_plan(cfg, counts)
    assert plan.level == "sample" and plan.privacy is not None and plan.privacy.noise_calibrated
    first = plan.privacy.event
    assert isinstance(first, SampleLevelRound)
    assert (first.sampling.participants, first.sampling.example_rate) == (2, 0.2)
    # Calibrated first order: z_out = m z_eff, z_in = sqrt(m K) z_eff (m = 2, K = 1).
    ratio = first.outer_noise_multiplier / first.inner_noise_multiplier
    assert ratio == pytest.approx(math.sqrt(2), rel=1e-12)
    assert sample_level_epsilon(first, 2, 1e-5) <= 40.0 * (1 + 1e-3)
    assert plan.normaliser == 2 * 2 * 2 * 3 * 2  # n1 x m x tasks_per_pass x ways x query
    resumed = build_plan(cfg, counts, noise_multiplier=plan.privacy.noise_multiplier)
    assert resumed.privacy is not None and resumed.privacy.event == first
    # A round's population: the event's sampling follows it, the noise does not change.
    fewer = plan.for_population(cfg, {"0": 20})
    assert fewer.privacy is not None
    assert fewer.privacy.noise_multiplier == plan.privacy.noise_multiplier
    assert isinstance(fewer.privacy.event, SampleLevelRound)
    assert fewer.privacy.event.sampling.participants == 1


@pytest.mark.integration
def test_the_command_line_refuses_a_bad_sample_setting_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _simulate(tmp_path, tmp_path / "run", *SAMPLE, "training.first_order=false") == 2
    err = capsys.readouterr().err.strip()
    assert "training.first_order = true" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------- runs


@pytest.mark.e2e
def test_a_sample_level_run_spends_sample_level_rounds_and_reports_their_epsilon(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _simulate(data, tmp_path / "a", *SAMPLE) == 0
    s = _summary(tmp_path / "a")
    assert s["level"] == "sample" and s["private"] and s["noise_secure"]
    assert s["rounds_completed"] == 2 and s["noise_calibrated"]
    db = tmp_path / "state" / "ledger.sqlite"
    with BudgetLedger.open_readonly(db, str(s["federation_id"])) as ledger:
        assert ledger.recorded_level() == "sample"
        ((event, count),) = ledger.rounds()
    assert isinstance(event, SampleLevelRound) and count == 2
    assert (event.max_appearances, event.inner_steps, event.order) == (2, 1, "first")
    assert event.sampling.example_rate == 0.2 and event.sampling.participants == 2
    assert event.outer_noise_multiplier == s["noise_multiplier"]
    constants = s["sample_level"]
    assert isinstance(constants, dict)
    assert constants["inner_noise_multiplier"] == event.inner_noise_multiplier
    assert (constants["inner_clip"], constants["support_normaliser"]) == (2.0, 3)
    # The reported epsilon is the accountant's for the recorded rounds (one PLD of one pair).
    expected = sample_level_epsilon(event, count, float(s["delta"]))  # type: ignore[arg-type]
    assert math.isclose(float(s["epsilon_spent"]), expected, rel_tol=1e-9)  # type: ignore[arg-type]
    assert expected <= 40.0
    printed = capsys.readouterr().out
    assert "example-level DP" in printed and "epsilon spent (example level" in printed
    # The whole budget is spent: another run is not refused for it (the individual filter, issue
    # 52 item 6): it runs its rounds with every participant excluded, charged to nobody, and
    # publishes its own epsilon, the same as the first run's.
    assert _simulate(data, tmp_path / "b", *SAMPLE) == 0
    b = _summary(tmp_path / "b")
    assert b["rounds_completed"] == 2 and b["level"] == "sample"
    assert math.isclose(float(b["epsilon_spent"]), expected, rel_tol=1e-9)  # type: ignore[arg-type]
    with BudgetLedger.open_readonly(db, str(s["federation_id"])) as ledger:
        assert ledger.position() == 4
        assert math.isclose(ledger.epsilon(), expected, rel_tol=1e-9)  # nobody charged twice
    # A resume of the finished run keeps its level and noise, and spends nothing again.
    assert main(["simulate", "--resume", "--out", str(tmp_path / "a")]) == 0
    again = _summary(tmp_path / "a")
    assert (again["level"], again["noise_multiplier"]) == ("sample", s["noise_multiplier"])
    assert again["sample_level"] == s["sample_level"]
    with BudgetLedger.open_readonly(db, str(s["federation_id"])) as ledger:
        assert ledger.position() == 4


@pytest.mark.e2e
def test_data_with_task_level_spends_refuses_a_sample_level_run(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = ["privacy.adaptive_clipping.enabled=false", "rounds=1"]
    assert _simulate(data, tmp_path / "task", *task) == 0
    assert _summary(tmp_path / "task")["level"] == "task"
    capsys.readouterr()
    assert _simulate(data, tmp_path / "sample", *SAMPLE) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "task-level spends" in err and "fedmeta ledger new-budget" in err
    assert not (tmp_path / "sample" / "summary.json").exists()


@pytest.mark.integration
def test_the_dry_run_forecasts_the_sample_level(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    words = [w for s in [*_sets(data), *SAMPLE] for w in ("--set", s)]
    assert main(["simulate", "--dry-run", *words]) == 0
    out = capsys.readouterr().out
    assert "example-level DP" in out and "sample level (DP-MAML Algorithm 2" in out
    assert "at the planned end: example-level epsilon" in out
    assert not (tmp_path / "state" / "ledger.sqlite").exists()  # a dry run records nothing


# ----------------------------------------------------------------------------- hostile rows


def _expect(**change: object) -> Expectation:
    fields: dict[str, object] = dict(run_id="r", round_id=0, participant_id="p", task_ids=(),
                                     dim=DIM, clip=C_OUT, reply_format="per_task",
                                     example_rows=True)  # fmt: skip
    fields.update(change)
    return Expectation(**fields)  # type: ignore[arg-type]


def _reply(rows: np.ndarray, ids: tuple[int, ...] | None = None) -> GradientReply:
    ids = tuple(range(len(rows))) if ids is None else ids
    return GradientReply("r", 0, "p", ids, rows.astype(np.float32), None, None)


@pytest.mark.unit
def test_an_over_norm_example_row_is_reclipped_to_c_out_and_a_nan_row_contributes_zero() -> None:
    rows = np.zeros((3, DIM))
    rows[0, 0] = 100.0  # over C_out: re-clipped
    rows[1, 1] = math.nan  # non-finite: zero
    rows[2, 2] = 0.5  # within: kept
    result = validate_reply(_reply(rows), _expect())
    assert isinstance(result, Accepted)
    assert result.n_tasks == 3 and result.norm_violations == 1 and result.nonfinite == 1
    assert result.grad_sum[0] == pytest.approx(C_OUT) and result.grad_sum[1] == 0
    assert result.grad_sum[2] == pytest.approx(0.5)
    assert max(result.post_clip_norms) <= C_OUT * (1 + 1e-9)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (_reply(np.zeros((2, DIM + 1))), REASON_BAD_SHAPE),
        (_reply(np.zeros((2, DIM)), (0, 2)), REASON_UNREQUESTED_TASK),
        (_reply(np.zeros((2, DIM)), (1, 0)), REASON_UNREQUESTED_TASK),
        (_reply(np.zeros((2, DIM)), (0,)), REASON_BAD_SHAPE),
    ],
)
def test_a_malformed_example_level_reply_is_dropped(reply: GradientReply, reason: str) -> None:
    result = validate_reply(reply, _expect())
    assert isinstance(result, Rejected) and result.reason == reason


@pytest.mark.unit
def test_rows_without_requested_tasks_are_refused_at_task_level() -> None:
    result = validate_reply(_reply(np.zeros((2, DIM))), _expect(example_rows=False))
    assert isinstance(result, Rejected) and result.reason == REASON_UNREQUESTED_TASK
    empty = validate_reply(_reply(np.zeros((0, DIM))), _expect())
    assert isinstance(empty, Accepted) and empty.n_tasks == 0
