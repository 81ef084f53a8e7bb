"""``fedmeta evaluate`` knows what the model has seen (issue 42, item 1).

The official one-shot runs are drawings of Omniglot's evaluation alphabets: a model trained on the
evaluation split has seen some of them. Built here from one synthetic Omniglot set: the runs'
drawings are drawings of its evaluation characters, as 1-bit 105 x 105 PNGs (another format than
the npz the model trained on), so only the content digest can tell.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from test_metalearning_oneshot_runs import _png, _write_run

from fedmeta.checkpoint import Checkpoint, save_checkpoint
from fedmeta.cli.evaluate import _table, main
from fedmeta.config_io import load_config
from fedmeta.workload import build_model, initial_params

pytestmark = pytest.mark.integration


def _omniglot(root: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    data = {
        name: rng.random((chars, 20, 105, 105)) > 0.1
        for name, chars in (("images_background", 24), ("images_evaluation", 100))
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, images in data.items():
        np.savez(root / f"{name}.npz", images=images)
    return data


def _runs(root: Path, evaluation: np.ndarray) -> Path:
    """20 runs over the first 20 evaluation characters: drawing r as support, r + 1 as query."""
    for r in range(1, 21):
        training = [_png(evaluation[c, r % 20]) for c in range(20)]
        test = [_png(evaluation[c, (r + 1) % 20]) for c in range(20)]
        _write_run(root / f"run{r:02d}", training, test, list(range(20)))
    return root


def _checkpoint(tmp_path: Path, data: Path, split: str) -> Path:
    cfg = load_config(None, [
        "dataset.name=omniglot", f"dataset.path={data}", "dataset.ways=20", "dataset.shots=1",
        "dataset.query=1", f"dataset.split={split}", "dataset.partition=even",
        "dataset.tasks_per_participant=2", "federation.participants=1",
        "sampling.participants_per_round=1", "training.eval_inner_steps=1",
    ])  # fmt: skip
    run = tmp_path / f"run-{split}"
    params = initial_params(cfg, build_model(cfg))
    save_checkpoint(run, Checkpoint("r", "non-private", params, {}, 3, cfg, False))
    return run


def _args(checkpoint: Path, runs: Path | None) -> argparse.Namespace:
    return argparse.Namespace(checkpoint=checkpoint, tasks=4, omniglot_runs=runs,
                              inner_steps=None, json=True)  # fmt: skip


def test_the_official_runs_seen_in_training_are_flagged_and_scored_apart(tmp_path: Path) -> None:
    data = tmp_path / "omniglot"
    runs = _runs(tmp_path / "all_runs", _omniglot(data)["images_evaluation"])
    trained_on_evaluation = main(_args(_checkpoint(tmp_path, data, "evaluation"), runs))
    frac = trained_on_evaluation["seen_fraction"]
    assert 0 < frac < 1 and trained_on_evaluation["seen_fraction_test"] == 0
    assert 0 < trained_on_evaluation["seen_fraction_runs"] <= 1
    held = trained_on_evaluation["held_out"]
    assert held["runs"] < 20 and len(held["run_errors"]) == held["runs"]
    assert "seen_warning" in trained_on_evaluation
    assert "WARNING: seen in training" in _table(trained_on_evaluation)
    background = main(_args(_checkpoint(tmp_path, data, "background"), runs))
    assert background["seen_fraction"] == 0 and background["held_out"]["runs"] == 20
    assert background["held_out"]["mean_error"] == pytest.approx(background["mean_error"])
    assert background["held_out"]["mean"] == background["mean"]  # nothing seen: the same tasks
    assert "seen_warning" not in background


def test_an_unknown_training_set_is_null_never_zero(tmp_path: Path) -> None:
    cfg = load_config(None, ["dataset.tasks_per_participant=2"])  # the sinusoid: no items
    run = tmp_path / "run"
    params = initial_params(cfg, build_model(cfg))
    save_checkpoint(run, Checkpoint("r", "non-private", params, {}, 1, cfg, False))
    out = main(_args(run, None))
    assert out["seen_fraction"] is None and out["held_out"] is None
    assert "\n" not in out["seen_note"] and "seen_fraction unknown" in out["seen_note"]
