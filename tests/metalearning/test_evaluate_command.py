"""``fedmeta evaluate``: a checkpoint scored on held-out tasks and on the official one-shot runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_metalearning_oneshot_runs import _write_runs, _zip

from fedmeta.checkpoint import Checkpoint, save_checkpoint
from fedmeta.cli.evaluate import main
from fedmeta.config_io import load_config
from fedmeta.workload import build_model, initial_params

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _omniglot(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for name, chars in (("images_background", 24), ("images_evaluation", 24)):
        images = rng.random((chars, 20, 105, 105)) > 0.1
        labels = np.repeat(np.arange(chars)[:, None], 20, axis=1)
        np.savez(root / f"{name}.npz", images=images, labels=labels)
    return root


def _checkpoint(tmp_path: Path, ways: int, name: str = "omniglot") -> Path:
    sets = [f"dataset.name={name}", f"dataset.ways={ways}", "dataset.shots=1", "dataset.query=1",
            "dataset.split=background", "dataset.partition=even", "dataset.tasks_per_participant=2",
            "federation.participants=1", "sampling.participants_per_round=1",
            "training.eval_inner_steps=1"]  # fmt: skip
    if name == "omniglot":
        sets.append(f"dataset.path={_omniglot(tmp_path)}")
    cfg = load_config(None, sets)
    run = tmp_path / f"run-{name}-{ways}"
    params = initial_params(cfg, build_model(cfg))
    save_checkpoint(run, Checkpoint("r", "f", params, {}, 7, cfg, True))
    return run


def _args(checkpoint: Path, **kw: object) -> argparse.Namespace:
    base = {"checkpoint": checkpoint, "tasks": 6, "omniglot_runs": None, "inner_steps": None,
            "json": True}  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_held_out_tasks_and_the_official_runs(tmp_path: Path) -> None:
    run = _checkpoint(tmp_path, ways=20)
    runs = tmp_path / "all_runs"
    _write_runs(runs)
    archive = _zip(runs, tmp_path / "all_runs.zip", "all_runs/")
    out = main(_args(run, omniglot_runs=archive))
    assert out["metric"] == "accuracy" and out["tasks"] == 6 and out["rounds"] == 7
    assert out["ci95"][0] <= out["mean"] <= out["ci95"][1]
    assert len(out["run_errors"]) == 20 and all(0 <= e <= 1 for e in out["run_errors"])
    assert out["mean_error"] == pytest.approx(sum(out["run_errors"]) / 20)
    assert out["human_mean_error"] == 0.045
    folder = main(_args(run, omniglot_runs=runs))
    assert folder["run_errors"] == out["run_errors"]


def test_a_model_of_another_way_count_or_dataset_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "all_runs"
    _write_runs(runs)
    with pytest.raises(ValueError, match="20-way; this model is 5-way"):
        main(_args(_checkpoint(tmp_path, ways=5), omniglot_runs=runs))
    with pytest.raises(ValueError, match="needs an Omniglot model"):
        main(_args(_checkpoint(tmp_path, ways=5, name="sinusoid"), omniglot_runs=runs))


def test_the_command_line(tmp_path: Path) -> None:
    run = _checkpoint(tmp_path, ways=5, name="sinusoid")
    cli = [sys.executable, "-m", "fedmeta.cli", "evaluate", "--checkpoint"]
    ok = subprocess.run([*cli, str(run), "--tasks", "5", "--json"], cwd=REPO, capture_output=True,
                        text=True)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["metric"] == "mse"
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    bad = subprocess.run([*cli, str(tmp_path / "bad.pt")], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def _tiny_omniglot(root: Path) -> None:
    """6 background (public) and 104 evaluation characters, 28 x 28: an evaluation split."""
    rng = np.random.default_rng(0)
    for part, n_chars in (("images_background", 6), ("images_evaluation", 104)):
        strokes = rng.random((n_chars, 1, 28, 28)) < 0.15
        jitter = rng.random((n_chars, 20, 28, 28)) < 0.03
        np.savez_compressed(root / f"{part}.npz", images=~(strokes ^ jitter))


def test_the_output_carries_the_summarys_marks(tmp_path: Path) -> None:
    """PUBLIC / EXPERIMENT / NON-PRIVATE, as the run's summary and plots say (issue 42, item 1)."""
    from fedmeta.cli.evaluate import _table

    _tiny_omniglot(tmp_path)  # 6 background (public) and 104 evaluation characters
    sets = ["dataset.name=omniglot", f"dataset.path={tmp_path}", "dataset.ways=3",
            "dataset.shots=1", "dataset.query=1", "dataset.split=evaluation",
            "dataset.tasks_per_participant=20", "federation.participants=2",
            "training.eval_inner_steps=1", "public.warm_start=true",
            "privacy.experiment=demo"]  # fmt: skip
    cfg = load_config(None, sets)
    run = tmp_path / "run-public"
    params = initial_params(cfg, build_model(cfg))
    save_checkpoint(run, Checkpoint("r", "non-private", params, {}, 3, cfg, False))
    out = main(_args(run, tasks=2))
    assert out["marks"] == ["PUBLIC WARM START", "EXPERIMENT demo", "NON-PRIVATE"]
    assert out["public_warm_start"]["classes"] == 6
    assert _table(out).splitlines()[0] == "[PUBLIC WARM START] [EXPERIMENT demo] [NON-PRIVATE]"
    private = main(_args(_checkpoint(tmp_path, ways=5, name="sinusoid"), tasks=2))
    assert private["marks"] == [] and private["public_warm_start"] is None
    assert not _table(private).startswith("[")
