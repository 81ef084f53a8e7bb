"""Run outputs: the printed plan and summary, ``summary.json``, ``rounds.csv`` and PNG plots.

Non-private runs are labelled NON-PRIVATE in every one of them. Files are written atomically.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from server.checkpoint import atomic_write_bytes

CSV_FIELDS = [
    "round", "mode", "participants_sampled", "participants_replied", "participants_failed",
    "tasks_requested", "tasks_received", "norm_violations", "epsilon", "epsilon_participant",
    "loss", "validation_metric", "round_seconds", "server_overhead_seconds", "lost_on_resume",
]  # fmt: skip


def _e(x: Any, fmt: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, fmt)


def _participant_eps(value: Any, note: str | None) -> str:
    """Participant-level epsilon for humans: the number, or why it is not meaningful."""
    if note:
        return f"{note} (valid but vacuous bound: {_e(value, '.3g')})"
    return f"epsilon {_e(value)}"


def format_plan(plan: dict[str, Any], private: bool, cfg_summary: dict[str, Any]) -> str:
    """The privacy plan, printed before training."""
    lines = ["== fedmeta federation plan =="]
    lines.append(
        f"dataset {cfg_summary['dataset']} | participants {cfg_summary['participants']} "
        f"({cfg_summary['participants_per_round']} per round, stage 2 {cfg_summary['stage2']}) | "
        f"planned rounds {cfg_summary['rounds']}"
    )
    if not private:
        lines.append(
            "mode: NON-PRIVATE baseline - no clipping, no noise, ledger not touched; "
            "NO privacy guarantee"
        )
        return "\n".join(lines)
    lines += [
        "mode: private (task-level DP, PLD accounting, enforced by the ledger)",
        f"budget: epsilon {_e(plan['epsilon_budget'], 'g')}, delta {_e(plan['delta'], 'g')} | "
        f"clip C = {_e(plan['clip'], 'g')}",
        f"noise multiplier z = {_e(plan['noise_multiplier'], '.4f')}"
        + (
            " (calibrated so the planned rounds spend the budget)"
            if plan.get("noise_calibrated")
            else ""
        ),
        "expected tasks per round (public normaliser): "
        f"{_e(plan['expected_tasks_per_round'], '.2f')}",
        f"ledger before this run: {plan['ledger_records_before']} spends, "
        f"epsilon {_e(plan['epsilon_spent_before'])}",
        f"rounds affordable: {plan['rounds_affordable']} | "
        f"rounds this run will run: {plan['rounds_to_run']}",
        f"at the planned end: task-level epsilon {_e(plan['epsilon_task_at_end'])} "
        f"(delta {_e(plan['delta'], 'g')})",
        "participant-level epsilon at the planned end: "
        + _participant_eps(plan["epsilon_participant_at_end"], plan.get("participant_level_note")),
    ]
    pub = plan.get("epsilon_tombs2022_published_at_end_NOT_VALID")
    if pub is not None:
        lines.append(
            f"(Tombs et al. 2022 Thm 3 as published: {_e(pub)} - NOT a valid guarantee, "
            "not enforced)"
        )
    return "\n".join(lines)


def format_summary(s: dict[str, Any]) -> str:
    """The summary printed at the end."""
    lines = ["== fedmeta summary ==", f"mode: {s['mode']}"]
    lines.append(
        f"rounds completed {s['rounds_completed']} of {s['rounds_planned']} planned | "
        f"stopped: {s['stopped_reason']}"
    )
    if s["private"]:
        lines.append(
            f"epsilon spent (task level) {_e(s['epsilon_spent'])} "
            f"of budget {_e(s['epsilon_budget'], 'g')} "
            f"at delta {_e(s['delta'], 'g')}"
        )
        lines.append(
            "participant level: "
            + _participant_eps(s["epsilon_participant_level"], s.get("participant_level_note"))
        )
        if s.get("noise_secure") is False:
            lines.append(
                "WARNING: insecure_test_seed was set - noise is reproducible, NOT private "
                "(tests only)"
            )
    else:
        lines.append("NON-PRIVATE: no clipping, no noise, no privacy guarantee")
    ci = s["final_metric_ci95"]
    lines.append(
        f"test {s['metric']} after adaptation: {_e(s['final_metric'], '.4f')} "
        f"(95% CI {_e(ci[0], '.4f')} .. {_e(ci[1], '.4f')}, {s['test_tasks']} tasks); "
        f"untrained meta-model: {_e(s['untrained_metric'], '.4f')}"
    )
    if s.get("rounds_lost_on_resume"):
        lines.append(
            "rounds spent but lost before a checkpoint (counted as spent): "
            f"{s['rounds_lost_on_resume']}"
        )
    return "\n".join(lines)


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    """``summary.json``."""
    path = Path(out_dir) / "summary.json"
    atomic_write_bytes(path, (json.dumps(summary, indent=2, default=str) + "\n").encode())
    return path


def write_rounds_csv(out_dir: Path, rows: list[dict[str, Any]], private: bool) -> Path:
    """``rounds.csv``: one row per round (mode column says private / NON-PRIVATE)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for row in rows:
        w.writerow(
            {
                **{k: "" if v is None else v for k, v in row.items()},
                "mode": "private" if private else "NON-PRIVATE",
            }
        )
    path = Path(out_dir) / "rounds.csv"
    atomic_write_bytes(path, buf.getvalue().encode())
    return path


def write_plots(out_dir: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[Path]:
    """PNG plots: epsilon vs round, validation metric vs epsilon (or vs round when non-private)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: list[Path] = []
    private = bool(summary["private"])
    tag = "" if private else " [NON-PRIVATE]"
    rows = [r for r in rows if not r.get("lost_on_resume")]
    metric = summary.get("metric", "metric")

    fig, ax = plt.subplots(figsize=(6, 4))
    if private:
        pts = [(r["round"], r["epsilon"]) for r in rows if r.get("epsilon") is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), label="task-level epsilon (PLD)")
        if summary.get("epsilon_budget"):
            ax.axhline(summary["epsilon_budget"], color="red", linestyle="--", label="budget")
        ax.set_ylabel("epsilon spent")
        ax.legend()
    else:
        ax.text(
            0.5,
            0.5,
            "NON-PRIVATE run: no epsilon",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("round")
    ax.set_title("privacy spent vs round" + tag)
    p = Path(out_dir) / "epsilon_vs_round.png"
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    plt.close(fig)
    out.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = [
        ((r["epsilon"] if private else r["round"]), r["validation_metric"])
        for r in rows
        if r.get("validation_metric") is not None and (not private or r.get("epsilon") is not None)
    ]
    if pts:
        ax.plot(*zip(*pts, strict=True), marker="o")
    ax.set_xlabel("task-level epsilon spent" if private else "round (NON-PRIVATE: no epsilon)")
    ax.set_ylabel(f"validation {metric}")
    ax.set_title(f"validation {metric} vs " + ("epsilon" if private else "round") + tag)
    p = Path(out_dir) / "validation_vs_epsilon.png"
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    plt.close(fig)
    out.append(p)
    return out


def write_all(
    out_dir: Path, summary: dict[str, Any], rows: list[dict[str, Any]], plots: bool = True
) -> None:
    """All files of a finished run."""
    write_summary(out_dir, summary)
    write_rounds_csv(out_dir, rows, bool(summary["private"]))
    if plots:
        write_plots(out_dir, rows, summary)
