"""``training.model_selection``: the run tests the last model, or its best validated one.

The choice is among the starting model (round 0) and the validated rounds, by the server's
validation tasks; it survives a resume, it refuses a split whose validation tasks would be test
tasks, and the tested model is the one the checkpoint names (server/fedmeta/server/selection.py).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedmeta.adaptation import inner_kwargs
from fedmeta.checkpoint import read_checkpoint
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.metalearning import evaluate
from fedmeta.server import run as run_mod
from fedmeta.server.outputs import format_summary
from fedmeta.server.selection import ModelSelection
from fedmeta.server.startup import FederationError, model_selection
from fedmeta.workload import build_workload

from .fakes import fake_ledger, opener
from .test_public_warm_start import _tiny_omniglot
from .test_reliability import StopAfter
from .test_round import run, small

BEST = ("training.model_selection=best_validation", "privacy.insecure_test_seed=7",
        "training.eval_every=2", "training.checkpoint_every=100")  # fmt: skip


@pytest.mark.unit
@given(st.lists(st.one_of(st.floats(-1e6, 1e6), st.just(math.nan)), min_size=1, max_size=12),
       st.booleans())  # fmt: skip
def test_the_kept_model_is_the_first_best_and_nan_never_wins(
    metrics: list[float], higher: bool
) -> None:
    sel = ModelSelection("best_validation", higher)
    for r, m in enumerate(metrics):
        sel.offer(r, m, torch.tensor([float(r)]))
    finite = [(m, r) for r, m in enumerate(metrics) if not math.isnan(m)]
    if not finite:
        assert sel.round is None and torch.equal(sel.released(torch.zeros(1)), torch.zeros(1))
        return
    best = max(m for m, _ in finite) if higher else min(m for m, _ in finite)
    first = min(r for m, r in finite if m == best)  # ties: the earlier, fewer noisy steps
    assert (sel.round, sel.metric) == (first, best)
    assert float(sel.released(torch.zeros(1))) == first
    again = ModelSelection("best_validation", higher)
    again.restore(sel.to_checkpoint())
    assert (again.round, again.metric) == (sel.round, sel.metric)
    start = None if math.isnan(metrics[0]) else metrics[0]
    assert again.start_metric == sel.start_metric == start


@pytest.mark.unit
def test_last_keeps_nothing_and_releases_the_last_model() -> None:
    sel = ModelSelection("last", True)
    sel.offer(0, 0.9, torch.ones(2))
    assert sel.to_checkpoint() is None and torch.equal(sel.released(torch.zeros(2)), torch.zeros(2))
    assert sel.summary(100, 7) == {"rule": "last", "round": 7}


def _scripted_validation(monkeypatch: pytest.MonkeyPatch, values: list[float]) -> None:
    """Validation answers ``values`` in turn (round 0 first): a run whose best round is known."""
    answers = iter(values)
    monkeypatch.setattr(run_mod, "_validate", lambda run: next(answers))


@pytest.mark.integration
def test_the_tested_model_is_the_best_validated_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sinusoid MSE, lower is better: round 0, 2, 4, 6 validate 1.0, 0.4, 0.6, 0.5 -> round 2.
    _scripted_validation(monkeypatch, [1.0, 0.4, 0.6, 0.5])
    best = run(small(*BEST), tmp_path / "best", fake_ledger(100.0, 0.1)).summary
    chosen = best["model_selection"]
    assert (chosen["rule"], chosen["round"], chosen["validation_metric"]) == (
        "best_validation", 2, 0.4
    )
    assert chosen["start_validation_metric"] == 1.0  # round 0's, reported beside the choice
    assert "tested model: round 2" in format_summary(best)
    # The same seed stopped after round 2 trains the same model and tests it on the same tasks.
    monkeypatch.undo()
    upto2 = run(small(*BEST[1:], "rounds=2"), tmp_path / "two", fake_ledger(100.0, 0.1))
    assert upto2.summary["model_selection"] == {"rule": "last", "round": 2}
    assert best["final_metric"] == upto2.summary["final_metric"]
    state, two = read_checkpoint(tmp_path / "best"), read_checkpoint(tmp_path / "two")
    assert torch.equal(state.released_params(), two.released_params())
    assert torch.equal(two.released_params(), two.params)  # "last": its own last model
    assert not torch.equal(state.params, two.params)  # the last model is kept to resume


@pytest.mark.integration
def test_round_zero_is_the_starting_model_and_a_resume_keeps_the_choice(tmp_path: Path) -> None:
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    cfg = small(*BEST)
    straight = run(cfg, tmp_path / "straight", fake_ledger(100.0, 0.1))
    ledger, stop = fake_ledger(100.0, 0.1), threading.Event()
    execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=tmp_path / "resumed",
            observers=[StopAfter(3, stop)], echo=False, open_ledger=opener(ledger),
            stop=stop)  # fmt: skip
    resumed = run(cfg, tmp_path / "resumed", ledger, resume=True)
    assert resumed.summary["model_selection"] == straight.summary["model_selection"]
    assert resumed.summary["final_metric"] == straight.summary["final_metric"]
    # The choice is the minimum over the starting model's validation MSE and the rounds'.
    wl = build_workload(cfg)
    start = evaluate(wl.model, wl.initial_params(), wl.held_out("validation", 8), device="cpu",
                     **inner_kwargs(cfg.training, evaluation=True)).mean  # fmt: skip
    rounds = [o.validation_metric for o in straight.outcomes if o.validation_metric is not None]
    assert len(rounds) == 3
    assert straight.summary["model_selection"]["validation_metric"] == pytest.approx(
        min([start, *rounds]), rel=1e-6
    )


@pytest.mark.integration
def test_a_run_resumed_under_the_rule_counts_its_candidates_from_where_it_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    last = small(*BEST[1:])  # started under "last"
    ledger, stop = fake_ledger(100.0, 0.1), threading.Event()
    execute(last, InProcessGrid(last.federation.participants), out_dir=tmp_path / "run",
            observers=[StopAfter(3, stop)], echo=False, open_ledger=opener(ledger),
            stop=stop)  # fmt: skip
    _scripted_validation(monkeypatch, [0.1, 0.5, 0.6, 0.7])  # the resumed start validates best
    summary = run(small(*BEST), tmp_path / "run", ledger, resume=True).summary
    chosen = summary["model_selection"]
    assert (chosen["round"], chosen["validation_metric"]) == (3, 0.1)  # not "round 0"
    assert chosen["start_validation_metric"] is None  # round 0 was never validated under it


@pytest.mark.integration
def test_a_split_without_validation_classes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_omniglot(tmp_path)
    sets: list[Any] = [
        "dataset.name=omniglot", f"dataset.path={tmp_path}", "dataset.split=background",
        "dataset.ways=3", "dataset.shots=1", "dataset.query=2", "dataset.tasks_per_participant=20",
        "federation.participants=1", "rounds=2", "training.model_selection=best_validation",
        "output.progress=false",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"model_selection = 'best_validation' needs"):
        load_config(None, sets)  # Omniglot's background split: known from the configuration
    # Data whose validation split is missing (an image folder without val/): refused at the start.
    cfg = load_config(None, [*sets[:-2], "output.progress=false"])
    wl = build_workload(cfg)
    assert wl.validation_is_test
    best = cfg.training.model_copy(update={"model_selection": "best_validation"})
    with pytest.raises(FederationError, match=r"model_selection = 'best_validation' needs"):
        model_selection(cfg.model_copy(update={"training": best}), wl, None)
    evaluation = load_config(None, [*sets[:2], "dataset.split=evaluation", *sets[3:]])
    assert not build_workload(evaluation).validation_is_test
