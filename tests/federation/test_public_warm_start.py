"""A run with a public warm start: refused unless the public data is kept out, and labelled."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tests.bench_scripts import bench_script

from fedmeta.accounting import BudgetLedger
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.server.outputs import format_summary
from fedmeta.simulation.simulate import main


def test_a_warm_start_needs_the_split_that_keeps_the_public_alphabets_out() -> None:
    base = ["dataset.name=omniglot", "dataset.path=/data", "public.warm_start=true"]
    with pytest.raises(ConfigError, match=r"dataset.split = 'evaluation'.*got dataset.name"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="public.warm_start needs"):
        load_config(None, ["public.warm_start=true"])  # the sinusoid has no public classes
    assert load_config(None, [*base, "dataset.split=evaluation"]).public.warm_start


def _tiny_omniglot(root: Path) -> None:
    """Omniglot's two npz files, small: 6 background and 104 evaluation characters, 28 x 28."""
    rng = np.random.default_rng(0)
    for part, n_chars in (("images_background", 6), ("images_evaluation", 104)):
        strokes = rng.random((n_chars, 1, 28, 28)) < 0.15
        jitter = rng.random((n_chars, 20, 28, 28)) < 0.03
        np.savez_compressed(root / f"{part}.npz", images=~(strokes ^ jitter))


@pytest.mark.integration
def test_a_warm_started_run_says_what_was_public(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    # Random strokes are no public release, so no experiment ledger (issue 39): the runs spend a
    # budget of their own in a state directory of this test's.
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    _tiny_omniglot(tmp_path)
    sets = [
        "dataset.name=omniglot", f"dataset.path={tmp_path}", "dataset.split=evaluation",
        "dataset.ways=3", "dataset.shots=1", "dataset.query=2", "dataset.tasks_per_participant=20",
        "dataset.test_tasks=10", "dataset.validation_tasks=5", "dataset.probe_tasks=0",
        "federation.participants=2", "rounds=2", "privacy.epsilon_budget=8",
        "privacy.delta=1e-5", "privacy.target_epsilon=2", "training.inner_lr=0.4",
        "public.warm_start=true", "public.steps=2", "public.tasks_per_step=2",
    ]  # fmt: skip
    summary = main(load_config(None, sets), out_dir=tmp_path / "run").summary
    public = summary["public_warm_start"]
    assert public["classes"] == 6 and public["disjoint_from_private"] is True
    assert public["non_private_pretraining"]["steps"] == 2
    assert summary["rounds_completed"] == 2
    text = format_summary(summary)
    assert "PUBLIC WARM START" in text and "PUBLIC warm start before private training" in text
    # The starting model is named for what it is (issue 42), and every output carries the mark.
    assert summary["starting_model"]["source"] == "public warm start"
    assert summary["starting_metric"] == summary["starting_model"]["test_metric"]
    assert summary["marks"] == ["PUBLIC WARM START"]
    # The ledger records it too, beside the budget the private rounds spent, before the first.
    with BudgetLedger.open_readonly(summary["ledger"]["path"], summary["federation_id"]) as led:
        (declared,) = led.public_uses()
        spends_of_run = [r for r in led.records() if r.run_id == summary["run_id"]]
    assert declared.run_id == summary["run_id"] and len(spends_of_run) == 2
    assert declared.use.digest == public["digest"] and declared.use.items == 6
    assert declared.use.disjoint_from_private and "2 steps" in declared.use.use
    unlabelled = main(load_config(None, sets[:-3]),
                      out_dir=tmp_path / "cold").summary  # fmt: skip
    assert unlabelled["public_warm_start"] is None
    cold = unlabelled
    with BudgetLedger.open_readonly(cold["ledger"]["path"], cold["federation_id"]) as led:
        assert cold["run_id"] not in {r.run_id for r in led.public_uses()}
    assert "PUBLIC" not in format_summary(unlabelled)


@pytest.mark.integration
def test_the_signal_is_measured_on_public_tasks_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/signal_norm.py on image data: public classes, the warm start, the trained subset."""
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_omniglot(tmp_path)
    script = bench_script("signal_norm")
    base = ["dataset.name=omniglot", f"dataset.path={tmp_path}", "dataset.split=evaluation",
            "dataset.ways=3", "dataset.shots=1", "dataset.query=2",
            "dataset.tasks_per_participant=20", "federation.participants=2"]  # fmt: skip
    public = ["public.warm_start=true", "public.steps=2", "public.tasks_per_step=2"]
    cfg = load_config(None, [*base, *public, "training.trained_parameters=head"])
    result = script.measure(cfg, [0.5, 1.0], 12)
    assert result["tasks_from"] == "public classes" and result["public_warm_start"]["classes"] == 6
    assert result["dimension"] == 3 * 64 + 3  # the head of a 3-way ConvNet4
    low, high = (row["signal_norm"] for row in result["clips"])
    assert 0 < low <= 0.5 and low <= high <= 1.0
    # Without declared public classes: one line, before any data is read.
    assert script.main(["--set", f"dataset.path={tmp_path / 'absent'}",
                        *(a for s in base[:1] for a in ("--set", s))]) == 2  # fmt: skip
    assert "image tasks must come from data declared public" in capsys.readouterr().err
