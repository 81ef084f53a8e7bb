"""Round 0 in a run's records: the starting model named for what it is (issue 42, item 1).

The summary's ``starting_metric`` and ``starting_model`` hold the starting model's test and
validation scores and the data's epsilon before round 1; the checkpoint keeps them, so a resumed
run's plots still start at the first invocation's round 0 (server/fedmeta/server/starting.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from fedmeta.adaptation import inner_kwargs
from fedmeta.metalearning import evaluate
from fedmeta.workload import build_workload

from .fakes import fake_ledger, opener
from .test_reliability import StopAfter
from .test_round import run, small

pytestmark = pytest.mark.integration
SEEDED = ("privacy.insecure_test_seed=7", "training.checkpoint_every=100")


def test_the_summary_names_the_starting_model_and_a_resume_keeps_round_zero(
    tmp_path: Path,
) -> None:
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    cfg = small(*SEEDED)
    straight = run(cfg, tmp_path / "straight", fake_ledger(100.0, 0.1)).summary
    assert "untrained_metric" not in straight and straight["marks"] == []
    start = straight["starting_model"]
    assert start["source"] == "untrained" and start["epsilon_before"] == 0.0
    wl = build_workload(cfg)
    kw = {"device": "cpu", **inner_kwargs(cfg.training, evaluation=True)}
    val = evaluate(wl.model, wl.initial_params(), wl.held_out("validation", 8), **kw).mean
    test = evaluate(wl.model, wl.initial_params(),
                    wl.held_out("test", cfg.dataset.test_tasks), **kw).mean  # fmt: skip
    assert start["validation_metric"] == pytest.approx(val, rel=1e-6)
    assert straight["starting_metric"] == start["test_metric"] == pytest.approx(test, rel=1e-6)
    # Stopped after round 3 and resumed: round 0 is the first invocation's, from the checkpoint.
    ledger, stop = fake_ledger(100.0, 0.1), threading.Event()
    execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=tmp_path / "resumed",
            observers=[StopAfter(3, stop)], echo=False, open_ledger=opener(ledger),
            stop=stop)  # fmt: skip
    saved = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert saved["starting_model"] == {k: v for k, v in start.items() if k != "test_metric"}
    resumed = run(cfg, tmp_path / "resumed", ledger, resume=True).summary
    assert resumed["starting_model"] == start
    assert resumed["plan"]["epsilon_spent_before"] > 0.0  # this invocation began after round 3


def test_a_non_private_experiment_is_marked() -> None:
    from fedmeta.server.outputs import format_summary

    cfg = small("privacy.enabled=false", "privacy.experiment=demo")
    summary = run(cfg, Path(_tmp()), fake_ledger(100.0, 0.1)).summary
    assert summary["marks"] == ["EXPERIMENT demo", "NON-PRIVATE"]
    assert summary["starting_model"]["epsilon_before"] is None
    assert "starting model (round 0), untrained" in format_summary(summary)


def _tmp() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="fedmeta-start-")
