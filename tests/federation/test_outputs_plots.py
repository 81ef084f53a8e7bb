"""A finished run's files: the PNG plots need the optional ``plots`` extra (matplotlib), which the
deployment images leave out; without it every other output is written and the run says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedmeta.server.outputs import write_all
from fedmeta.server.plots import PLOT_FILES
from fedmeta.server.report import RoundOutcome

SUMMARY = {"private": True, "epsilon_budget": 8.0, "metric": "mse", "experiment": None}


def _outcomes() -> list[RoundOutcome]:
    return [
        RoundOutcome(run_id="r", federation_id="f", round=i, train_loss=1.0 / i,
                     validation_metric=2.0 / i, epsilon_task=0.5 * i)
        for i in (1, 2, 3)
    ]  # fmt: skip


def test_plots_are_written_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = write_all(tmp_path, SUMMARY, _outcomes(), diagnostics=False)
    assert written == ["summary.json", "rounds.csv", *PLOT_FILES]
    assert all((tmp_path / name).stat().st_size > 0 for name in written)


def test_without_matplotlib_the_other_outputs_are_written_and_no_plot_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    written = write_all(tmp_path, SUMMARY, _outcomes(), diagnostics=False)
    assert written == ["summary.json", "rounds.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rounds.csv", "summary.json"]


def test_plots_off_writes_none(tmp_path: Path) -> None:
    written = write_all(tmp_path, SUMMARY, _outcomes(), diagnostics=False, plots=False)
    assert written == ["summary.json", "rounds.csv"] and not list(tmp_path.glob("*.png"))
