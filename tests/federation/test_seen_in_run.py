"""The run's own test evaluation knows what the model has seen (issue 42, item 1).

Built on a small generated Omniglot whose even evaluation characters share one drawing (the same
ink mask): every participant trained on it, and the test classes that hold it are seen. The
summary reports ``seen_fraction`` and ``held_out`` as ``fedmeta evaluate`` does, flagged, never
refused; a private run releases the participants' overlap with the test items only as a private
diagnostic (or on public data under an experiment), else ``seen_fraction`` is null, never 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedmeta.config_io import load_config
from fedmeta.server.outputs import format_summary
from fedmeta.server.seen_release import PRIVATE_NOTE, declared_items, releasable
from fedmeta.simulation.simulate import main

N_TEST = 104 // 4  # the evaluation split's test characters (metalearning/omniglot.py)


def _omniglot(root: Path, *, shared: bool) -> None:
    """6 background and 104 evaluation characters, 28 x 28; ``shared``: one drawing in many."""
    rng = np.random.default_rng(0)
    for part, n_chars in (("images_background", 6), ("images_evaluation", 104)):
        strokes = rng.random((n_chars, 1, 28, 28)) < 0.15
        images = ~(strokes ^ (rng.random((n_chars, 20, 28, 28)) < 0.03))
        if shared and part == "images_evaluation":
            images[::2, 0] = images[0, 0]  # the same ink mask in every even character
        np.savez_compressed(root / f"{part}.npz", images=images)


def _sets(data: Path, *more: str) -> list[str]:
    return [
        "dataset.name=omniglot", f"dataset.path={data}", "dataset.split=evaluation",
        "dataset.ways=3", "dataset.shots=1", "dataset.query=2", "dataset.tasks_per_participant=20",
        "dataset.test_tasks=10", "dataset.validation_tasks=5", "dataset.probe_tasks=0",
        "federation.participants=2", "rounds=1", "output.progress=false", "output.plots=false",
        *more,
    ]  # fmt: skip


@pytest.fixture
def shared_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "omniglot"
    data.mkdir()
    _omniglot(data, shared=True)
    return data


@pytest.mark.e2e
def test_seen_test_items_are_flagged_and_the_unseen_classes_scored_apart(
    tmp_path: Path, shared_data: Path
) -> None:
    cfg = load_config(None, _sets(shared_data, "privacy.enabled=false"))
    s = main(cfg, out_dir=tmp_path / "run").summary
    frac = s["seen_fraction"]
    # One drawing of 20 in each even test character: about half the test characters, 1/20 each.
    assert 0 < frac <= 1 / 20 and s["seen_fraction_test"] == frac
    held = s["held_out"]
    assert 0 < held["classes"] < N_TEST and held["tasks"] == s["test_tasks"] == 10
    assert 0 <= held["mean"] <= 1 and held["ci95"][0] <= held["mean"] <= held["ci95"][1]
    assert "seen_warning" in s and "seen_note" not in s
    (line,) = [x for x in format_summary(s).splitlines() if "seen in training" in x]
    assert line.startswith("WARNING: seen in training") and "test " in line  # both, one line


@pytest.mark.e2e
def test_a_private_run_releases_the_overlap_only_as_a_private_diagnostic(
    tmp_path: Path, shared_data: Path
) -> None:
    private = ["privacy.epsilon_budget=8", "privacy.delta=1e-5", "privacy.target_epsilon=1"]
    s = main(load_config(None, _sets(shared_data, *private)), out_dir=tmp_path / "a").summary
    assert s["private"] and s["seen_fraction"] is None and s["held_out"] is None
    assert s["seen_note"] == PRIVATE_NOTE and "seen_fraction_test" not in s
    assert "seen in training: unknown (not released by a private run" in format_summary(s)
    diagnostic = load_config(None, _sets(shared_data, *private,
                                         "metrics.private_diagnostics=true"))  # fmt: skip
    d = main(diagnostic, out_dir=tmp_path / "b").summary
    assert d["private"] and 0 < d["seen_fraction"] <= 1 / 20 and "seen_warning" in d


@pytest.mark.e2e
def test_nothing_seen_is_zero_and_held_out_is_the_test_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    _omniglot(tmp_path, shared=False)
    s = main(load_config(None, _sets(tmp_path, "privacy.enabled=false")),
             out_dir=tmp_path / "run").summary  # fmt: skip
    assert s["seen_fraction"] == 0.0 and "seen_warning" not in s
    assert s["held_out"]["mean"] == s["final_metric"] and s["held_out"]["tasks"] == 10


@pytest.mark.unit
def test_what_may_be_released_and_what_the_participants_declared() -> None:
    from fedmeta.accounting import DataItems

    def releasable_by(sets: list[str], private: bool) -> bool:
        cfg = load_config(None, sets)
        return releasable(private, experiment=cfg.privacy.experiment,
                          private_diagnostics=cfg.metrics.private_diagnostics)  # fmt: skip

    assert releasable_by([], private=False)
    assert not releasable_by([], private=True)
    assert releasable_by(["metrics.private_diagnostics=true"], private=True)
    assert releasable_by(["privacy.experiment=x"], private=True)
    a, b = DataItems.of([3, 1]).to_text(), DataItems.of([2, 3]).to_text()
    assert list(declared_items([a, b])) == [1, 2, 3]  # type: ignore[arg-type]
    assert declared_items([a, "sinusoid:abc"]) is None  # one declared no items: unknown
    assert declared_items([]) is None


@pytest.mark.unit
def test_a_resumed_run_says_whose_items_it_compared_and_an_untested_one_is_null() -> None:
    from types import SimpleNamespace

    from fedmeta.accounting import DataItems
    from fedmeta.server.seen_release import NOT_TESTED_NOTE, RESUMED_NOTE, seen_fields

    def split(items: list[int]) -> SimpleNamespace:
        return SimpleNamespace(item_ids=np.asarray(items, np.uint64), n_classes=1,
                               offsets=[0, len(items)])  # fmt: skip

    workload = SimpleNamespace(splits=SimpleNamespace(train=split([1, 2]), val=split([3]),
                                                      test=split([7, 8])),
                               warm_start=None)  # fmt: skip
    final = SimpleNamespace(mean=0.5, ci95_low=0.4, ci95_high=0.6, median=0.5, n_tasks=4)
    cfg = load_config(None, [])
    declared = [DataItems.of([1, 2]).to_text()]
    fields = seen_fields(cfg, workload, private=False, fingerprints=declared,  # type: ignore[arg-type]
                         resumed=True, final=final, evaluate_tasks=lambda t: None)  # fmt: skip
    assert fields["seen_fraction"] == 0.0 and fields["held_out"]["mean"] == 0.5
    assert fields["seen_note"] == RESUMED_NOTE
    untested = seen_fields(cfg, workload, private=False, fingerprints=declared,  # type: ignore[arg-type]
                           final=None, evaluate_tasks=lambda t: None)  # fmt: skip
    assert untested == {"seen_fraction": None, "held_out": None, "seen_note": NOT_TESTED_NOTE}
