"""Resume follows the ledger the run recorded, from any directory, and creates no stray ledger.

Issue 21: with a relative ``privacy.ledger_path``, resuming from another directory opened (and
created) another, empty ledger, and the error's advice (pass the path) was then refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmeta.config import Config
from fedmeta.server.app import execute
from fedmeta.server.startup import FederationError
from fedmeta.simulation.local_grid import InProcessGrid

from .test_round import small

pytestmark = pytest.mark.integration


def _cfg(*extra: str) -> Config:
    return small("privacy.noise_multiplier=1.0", "privacy.epsilon_budget=1000",
                 "privacy.ledger_path=ledger.sqlite", *extra)  # fmt: skip


def _run(cfg: Config, out: Path, resume: bool = False) -> object:
    grid = InProcessGrid(cfg.federation.participants)
    return execute(cfg, grid, out_dir=out, resume=resume, echo=False)


def _spends(path: Path) -> int:
    from .test_e2e import _spends as spends

    return len(spends(path))


def test_resume_from_another_directory_uses_the_recorded_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    first, elsewhere, out = tmp_path / "first", tmp_path / "elsewhere", tmp_path / "out"
    first.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(first)
    _run(_cfg("rounds=1"), out)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    recorded = Path(ckpt["ledger"]["path"])
    assert recorded.is_absolute() and recorded == (first / "ledger.sqlite").resolve()
    monkeypatch.chdir(elsewhere)  # the relative ledger_path now points elsewhere
    _run(_cfg("rounds=2"), out, resume=True)
    assert _spends(recorded) == 2
    assert not (elsewhere / "ledger.sqlite").exists()  # no stray empty ledger


def test_a_missing_recorded_ledger_is_refused_with_advice_that_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    _run(_cfg("rounds=1"), out)
    ledger = tmp_path / "ledger.sqlite"
    moved = tmp_path / "moved.sqlite"
    ledger.rename(moved)
    with pytest.raises(FederationError, match="restore that file there") as caught:
        _run(_cfg("rounds=2"), out, resume=True)
    assert str(ledger) in str(caught.value) and not ledger.exists()  # nothing created
    moved.rename(ledger)  # the advice, followed
    _run(_cfg("rounds=2"), out, resume=True)
    assert _spends(ledger) == 2
