"""Regression tests from the privacy-correctness review (each failed before its fix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from accounting import TwoStageFixedScheme
from fedmeta.config import load_config
from server import privacy as priv
from server import round as round_mod
from server.app import execute
from server.local_grid import InProcessGrid
from server.outputs import format_plan, format_summary

from .fakes import FakeLedger, install_fake_privacy
from .test_round import small

pytestmark = pytest.mark.unit


def test_server_refuses_task_counts_below_the_accounted_min_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The accounted fixed-size stage-2 rate is n2 / min_tasks. If the scheme claims a larger
    # min_tasks than the smallest registered participant holds, that participant's real rate is
    # above the accounted one: the server must refuse before any spend or release.
    cfg = small("sampling.stage2=fixed", "sampling.tasks_per_round=3")
    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    install_fake_privacy(monkeypatch, ledger)
    real = priv.make_scheme

    def optimistic(cfg: Any, task_counts: Any) -> Any:
        s = real(cfg, task_counts)
        return TwoStageFixedScheme(
            participants=s.participants,
            participants_per_round=s.participants_per_round,
            tasks_per_round=s.tasks_per_round,
            min_tasks=s.min_tasks + 5,
        )

    monkeypatch.setattr(priv, "make_scheme", optimistic)
    grid = InProcessGrid(cfg.federation.participants, None)
    with pytest.raises(round_mod.FederationError, match="min_tasks"):
        execute(cfg, grid, out_dir=tmp_path, observers=[], echo=False)
    assert ledger.spend_calls == 0 and ledger.position() == 0


def _summary(note: str | None) -> dict[str, Any]:
    return {
        "mode": "private", "private": True, "rounds_completed": 3, "rounds_planned": 3,
        "stopped_reason": "planned_rounds", "epsilon_spent": 7.99, "epsilon_budget": 8.0,
        "delta": 1e-5, "epsilon_participant_level": 37423689.762, "participant_level_note": note,
        "noise_secure": True, "metric": "mse", "final_metric": 1.0, "final_metric_ci95": [0.9, 1.1],
        "test_tasks": 16, "untrained_metric": 2.0,
    }  # fmt: skip


def _plan(note: str | None) -> dict[str, Any]:
    return {
        "epsilon_budget": 8.0, "delta": 1e-5, "clip": 1.0, "noise_multiplier": 1.0,
        "noise_calibrated": True, "expected_tasks_per_round": 6.0, "ledger_records_before": 0,
        "epsilon_spent_before": 0.0, "rounds_affordable": 3, "rounds_to_run": 3,
        "epsilon_task_at_end": 7.99, "epsilon_participant_at_end": 37423689.762,
        "participant_level_note": note,
    }  # fmt: skip


def test_participant_level_epsilon_is_explained_for_poisson_stage2() -> None:
    poisson = load_config(None, ["sampling.stage2=poisson"])
    fixed = load_config(None, ["sampling.stage2=fixed", "sampling.tasks_per_round=2"])
    note = priv.participant_level_note(poisson)
    assert note is not None and "not meaningful" in note and "stage2=fixed" in note
    assert priv.participant_level_note(fixed) is None
    cfg_summary = {"dataset": "sinusoid", "participants": 6, "participants_per_round": 3,
                   "stage2": "poisson", "rounds": 3}  # fmt: skip
    for text in (format_summary(_summary(note)), format_plan(_plan(note), True, cfg_summary)):
        assert "not meaningful" in text and "stage2=fixed" in text
        assert "37423689.762" not in text  # never a bare astronomic number
    for text in (format_summary(_summary(None)), format_plan(_plan(None), True, cfg_summary)):
        assert "not meaningful" not in text and "37423689.762" in text


def test_summary_carries_the_participant_level_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    install_fake_privacy(monkeypatch, ledger)
    cfg = small("rounds=1")
    grid = InProcessGrid(cfg.federation.participants, None)
    result = execute(cfg, grid, out_dir=tmp_path, observers=[], echo=False)
    assert result.summary["participant_level_note"] == priv.PARTICIPANT_LEVEL_NOT_MEANINGFUL
    assert result.summary["plan"]["participant_level_note"] == priv.PARTICIPANT_LEVEL_NOT_MEANINGFUL


def test_private_checkpoint_never_holds_the_secret_sampler_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # checkpoint.pt is an output file; numpy's PCG64 state can be stepped backwards, so storing it
    # would reveal every past round's sample (and void the amplification by secret sampling).
    import torch

    from server.checkpoint import load_checkpoint

    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    install_fake_privacy(monkeypatch, ledger)
    cfg = small("rounds=2")
    execute(cfg, InProcessGrid(6, None), out_dir=tmp_path / "p", observers=[], echo=False)
    ckpt = load_checkpoint(tmp_path / "p")
    assert ckpt is not None and ckpt["sampler_state"] is None
    assert "bit_generator" not in repr(torch.load(tmp_path / "p" / "checkpoint.pt",
                                                  weights_only=False))  # fmt: skip
    # A resumed private run reseeds from a fresh secret and still spends once per round.
    cfg4 = small("rounds=4")
    execute(cfg4, InProcessGrid(6, None), out_dir=tmp_path / "p", resume=True, observers=[],
            echo=False)  # fmt: skip
    assert [r.round_index for r in ledger.records()] == [0, 1, 2, 3]
    # Runs labelled insecure (test seed) keep it for reproducible resumes.
    seeded = small("rounds=2", "privacy.insecure_test_seed=3")
    execute(seeded, InProcessGrid(6, None), out_dir=tmp_path / "s", observers=[], echo=False)
    ckpt = load_checkpoint(tmp_path / "s")
    assert ckpt is not None and ckpt["sampler_state"] is not None
