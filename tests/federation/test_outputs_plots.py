"""A finished run's files: the PNG plots need the optional ``plots`` extra (matplotlib), which the
deployment images leave out; without it every other output is written and the run says so."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from fedmeta.server.marks import marks, summary_marks
from fedmeta.server.outputs import write_all
from fedmeta.server.plots import PLOT_FILES, write_plots
from fedmeta.server.report import RoundOutcome
from fedmeta.server.starting import StartingModel, starting_metric_of

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


# ------------------------------------------------------- round 0 and the marks (issue 42, item 1)


def _figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The figures ``write_plots`` would save, by file name (kept open for inspection)."""
    pytest.importorskip("matplotlib")
    from fedmeta.server import plots

    saved: dict[str, Any] = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.__setitem__(path.name, fig))
    return saved


START = {"source": "public warm start", "test_metric": 0.7, "validation_metric": 0.6,
         "epsilon_before": 0.25}  # fmt: skip


@pytest.mark.unit
def test_plots_start_at_round_zero_and_carry_the_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _figures(monkeypatch)
    summary = {**SUMMARY, "experiment": "demo", "public_warm_start": {"data": "x"},
               "starting_model": START}  # fmt: skip
    assert write_plots(tmp_path, _outcomes(), summary)
    eps_ax = saved["epsilon_vs_round.png"].axes[0]
    first = eps_ax.lines[0]
    assert list(first.get_xdata())[:2] == [0, 1] and list(first.get_ydata())[:2] == [0.25, 0.5]
    val_ax = saved["validation_vs_epsilon.png"].axes[0]
    curve = [line for line in val_ax.lines if line.get_label() == "validated rounds"][0]
    assert list(curve.get_xdata()) == [0.25, 0.5, 1.0, 1.5]  # round 0 at the epsilon before
    assert list(curve.get_ydata()) == [0.6, 2.0, 1.0, 2.0 / 3]
    assert any("round 0: public warm start" in str(t.get_text())
               for t in val_ax.get_legend().get_texts())  # fmt: skip
    for ax in (eps_ax, val_ax):
        assert "[PUBLIC WARM START]" in ax.get_title() and "[EXPERIMENT demo]" in ax.get_title()
        assert "NON-PRIVATE" not in ax.get_title()


@pytest.mark.unit
def test_a_non_private_plot_starts_at_round_zero_and_says_non_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _figures(monkeypatch)
    start = {**START, "source": "untrained", "epsilon_before": None}
    assert write_plots(tmp_path, _outcomes(), {**SUMMARY, "private": False,
                                               "starting_model": start})  # fmt: skip
    ax = saved["validation_vs_epsilon.png"].axes[0]
    curve = [line for line in ax.lines if line.get_label() == "validated rounds"][0]
    assert list(curve.get_xdata()) == [0.0, 1.0, 2.0, 3.0]
    assert "[NON-PRIVATE]" in ax.get_title() and "PUBLIC" not in ax.get_title()
    # A summary written before round 0 was recorded: the curve starts at round 1, as it did.
    assert write_plots(tmp_path, _outcomes(), {**SUMMARY, "private": False})
    ax = saved["validation_vs_epsilon.png"].axes[0]
    assert list(ax.lines[0].get_xdata()) == [1.0, 2.0, 3.0]


@pytest.mark.unit
def test_the_starting_metric_is_read_from_new_and_old_summaries() -> None:
    assert starting_metric_of({"starting_metric": 0.5}) == 0.5
    assert starting_metric_of({"untrained_metric": 0.4}) == 0.4  # written before the rename
    assert starting_metric_of({}) is None
    assert marks(private=False, experiment="e", public=True) == [
        "PUBLIC WARM START", "EXPERIMENT e", "NON-PRIVATE"
    ]  # fmt: skip
    assert marks(private=True, experiment=None, public=False) == []
    assert summary_marks({"private": True, "public_warm_start": {"data": "x"}}) == [
        "PUBLIC WARM START"
    ]
    with pytest.raises(ValueError, match="source must be one of"):
        StartingModel("pretrained", 0.5, None)  # type: ignore[arg-type]
    record = StartingModel("untrained", 0.5, 0.0)
    assert StartingModel.from_dict(record.to_dict()) == record
    assert StartingModel.from_dict(None) is None
