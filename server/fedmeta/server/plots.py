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

    False, writing nothing, where matplotlib is not installed: it is the optional ``plots`` extra,
    left out of the deployment images (a service's outputs are read elsewhere; rounds.csv holds
    every plotted value).
    """
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    private = bool(summary["private"])
    tag = "" if private else " [NON-PRIVATE]"
    if summary.get("experiment"):
        tag += f" [EXPERIMENT {summary['experiment']}]"
    done = [o for o in outcomes if o.status == "completed"]
    fig, ax = plt.subplots(figsize=(6, 4))
    if private:
        pts = [(o.round, o.epsilon_task) for o in done if o.epsilon_task is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), label="task-level epsilon (PLD)")
        ax.axhline(summary["epsilon_budget"], color="red", linestyle="--", label="budget")
        ax.set_ylabel("epsilon spent")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "NON-PRIVATE run: no epsilon", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.set_xlabel("round")
    ax.set_title("privacy spent vs round" + tag)
    _save(fig, Path(out_dir) / PLOT_FILES[0])
    fig, ax = plt.subplots(figsize=(6, 4))
    curve = [
        (float(o.epsilon_task if private else o.round), float(o.validation_metric))  # type: ignore[arg-type]
        for o in done
        if o.validation_metric is not None and (not private or o.epsilon_task is not None)
    ]
    if curve:
        ax.plot(*zip(*curve, strict=True), marker="o")
    metric = summary["metric"]
    ax.set_xlabel("task-level epsilon spent" if private else "round (NON-PRIVATE: no epsilon)")
    ax.set_ylabel(f"validation {metric}")
    ax.set_title(f"validation {metric} vs " + ("epsilon" if private else "round") + tag)
    _save(fig, Path(out_dir) / PLOT_FILES[1])
    return True


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
