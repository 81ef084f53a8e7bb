"""A finished run's two PNG plots: epsilon against round, the validation metric against epsilon.

Drawn from the run's records only (the noisy model's outcomes and the plan), as every output is;
matplotlib is the optional ``plots`` extra, and a run without it writes the other files.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedmeta.checkpoint import atomic_write_bytes
from fedmeta.server.marks import summary_marks
from fedmeta.server.report import RoundOutcome

PLOTS_MISSING = (
    "plots: not written: matplotlib is not installed (pip install 'fedmeta[plots]', or set "
    "output.plots = false)"
)
PLOT_FILES = ("epsilon_vs_round.png", "validation_vs_epsilon.png")


def write_plots(
    out_dir: Path, outcomes: Sequence[RoundOutcome], summary: Mapping[str, Any]
) -> bool:
    """Two PNG plots: epsilon against round, validation metric against epsilon (or round).

    Both start at round 0, the starting model (``summary["starting_model"]``: untrained or a
    public warm start), and carry the summary's marks (:func:`summary_marks`), so a private curve
    that stays under its public start is seen to. False, writing nothing, where matplotlib is not
    installed: it is the optional ``plots`` extra, left out of the deployment images (a service's
    outputs are read elsewhere; rounds.csv holds every plotted value but round 0's, which is in
    summary.json).
    """
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    done = [o for o in outcomes if o.status == "completed"]
    tag = "".join(f"\n[{mark}]" for mark in summary_marks(summary))
    if summary.get("stopped_reason") == "interrupted":
        tag += f"\n[interrupted after round {summary.get('rounds_completed')}]"
    start = summary.get("starting_model") or {}
    _plot_epsilon(Path(out_dir) / PLOT_FILES[0], done, summary, start, tag)
    _plot_validation(Path(out_dir) / PLOT_FILES[1], done, summary, start, tag)
    return True


def _plot_epsilon(path: Path, done: Sequence[RoundOutcome], summary: Mapping[str, Any],
                  start: Mapping[str, Any], tag: str) -> None:  # fmt: skip
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    if summary["private"]:
        first = [] if start.get("epsilon_before") is None else [(0, start["epsilon_before"])]
        pts = first + [(o.round, o.epsilon_task) for o in done if o.epsilon_task is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), label="task-level epsilon (PLD)")
        ax.axhline(summary["epsilon_budget"], color="red", linestyle="--", label="budget")
        ax.set_ylabel("epsilon spent")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "NON-PRIVATE run: no epsilon", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.set_xlabel("round (0: the starting model)")
    ax.set_xlim(left=0)
    ax.set_title("privacy spent vs round" + tag, fontsize=9)
    _save(fig, path)


def _plot_validation(path: Path, done: Sequence[RoundOutcome], summary: Mapping[str, Any],
                     start: Mapping[str, Any], tag: str) -> None:  # fmt: skip
    import matplotlib.pyplot as plt

    private = bool(summary["private"])
    fig, ax = plt.subplots(figsize=(6, 4.5))
    curve = [
        (float(o.epsilon_task if private else o.round), float(o.validation_metric))  # type: ignore[arg-type]
        for o in done
        if o.validation_metric is not None and (not private or o.epsilon_task is not None)
    ]
    x0 = start.get("epsilon_before") if private else 0.0
    y0 = start.get("validation_metric")
    if x0 is not None and y0 is not None:  # round 0: drawn apart, and as a level to beat
        label = f"round 0: {start.get('source', 'starting model')}"
        ax.axhline(float(y0), color="grey", linestyle=":", label=label)
        ax.plot([float(x0)], [float(y0)], marker="*", markersize=12, color="grey")
        curve = [(float(x0), float(y0)), *curve]
    if curve:
        ax.plot(*zip(*curve, strict=True), marker="o", label="validated rounds")
        ax.legend(fontsize=8)
    else:  # stopped before its first validation round: say so rather than leave it blank
        ax.text(0.5, 0.5, "no validation yet: the run stopped before\nits first validation round",
                ha="center", va="center", transform=ax.transAxes)  # fmt: skip
    metric = summary["metric"]
    ax.set_xlabel(
        "task-level epsilon spent (round 0 at the data's epsilon before the run)"
        if private
        else "round (0: the starting model; NON-PRIVATE: no epsilon)"
    )
    ax.set_ylabel(f"validation {metric}")
    ax.set_title(f"validation {metric} vs " + ("epsilon" if private else "round") + tag,
                 fontsize=9)  # fmt: skip
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
