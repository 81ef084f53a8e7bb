"""``fedmeta evaluate``'s account of what the model has seen (issue 42, item 1).

The rule is core/fedmeta/seen.py's.

JSON: ``seen_fraction`` (the fraction of the distinct items scored - the test tasks' pool and,
with ``--omniglot-runs``, the runs' 800 drawings - that the model was trained, selected or
warm-started on; ``null`` with ``seen_note`` when that cannot be known), per part
``seen_fraction_test`` / ``seen_fraction_runs``, and ``held_out``: the same metrics over unseen
items only (test tasks drawn from the test classes none of whose drawings were seen; the runs none
of whose 40 drawings were seen). Flagged, never refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedmeta.config import Config
from fedmeta.seen import seen_fraction, seen_mask, trained_items
from fedmeta.workload import Workload


def trained_or_note(cfg: Config, workload: Workload) -> tuple[np.ndarray | None, str | None]:
    """The model's training items, or None and the one line saying why they are unknown."""
    try:
        trained = trained_items(workload, cfg)
    except (OSError, ValueError) as error:  # DataError is a ValueError
        return None, f"the training data of this checkpoint cannot be read ({error})"
    if trained is None:
        where = cfg.dataset.path or cfg.dataset.name
        return None, (f"the training data of this checkpoint ({where}) has no item digests to "
                      "compare with: seen_fraction unknown")  # fmt: skip
    return trained, None


def test_part(
    trained: np.ndarray, workload: Workload, evaluate_tasks: Any, overall: dict[str, Any]
) -> tuple[dict[str, Any], np.ndarray]:
    """Seen fraction of the test classes' items, and the test metrics over unseen classes.

    Nothing seen: the metrics of the tasks already scored (``overall``). Else tasks as many,
    drawn from the test classes none of whose items were seen.
    """
    split = workload.splits.test if workload.splits is not None else None
    if split is None or split.item_ids is None:
        return {"seen_fraction_test": None}, np.zeros(0, np.uint64)
    items = split.item_ids
    frac = seen_fraction(trained, [items])
    if frac == 0:
        held = {k: overall[k] for k in ("mean", "ci95", "median", "tasks")}
        return {"seen_fraction_test": 0.0, "held_out_test": held}, items
    keep = [
        c
        for c in range(split.n_classes)
        if not seen_mask(trained, items[split.offsets[c] : split.offsets[c + 1]]).any()
    ]
    ds = workload.dataset
    if len(keep) < ds.ways:
        return {"seen_fraction_test": frac, "held_out_test": None}, items
    from fedmeta.metalearning import sample_tasks

    tasks = sample_tasks(split.subset(keep), n_way=ds.ways, k_shot=ds.shots, q_query=ds.query,
                         n_tasks=int(overall["tasks"]), seed=workload.seed,
                         path=(0x7E57, 0x5EE))  # fmt: skip
    r = evaluate_tasks(tasks)
    held = {"mean": r.mean, "ci95": [r.ci95_low, r.ci95_high], "median": r.median,
            "tasks": r.n_tasks, "classes": len(keep)}  # fmt: skip
    return {"seen_fraction_test": frac, "held_out_test": held}, items


def runs_part(
    trained: np.ndarray, runs: Sequence[Any], errors: Sequence[float]
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Seen fraction of the runs' drawings, and the error over the runs none of them seen."""
    groups = [np.asarray(r.item_ids) for r in runs if r.item_ids is not None]
    if len(groups) != len(runs):
        return {"seen_fraction_runs": None}, []
    unseen = [e for g, e in zip(groups, errors, strict=True) if not seen_mask(trained, g).any()]
    held = {"run_errors": [float(e) for e in unseen], "runs": len(unseen),
            "mean_error": float(np.mean(unseen)) if unseen else None}  # fmt: skip
    return {"seen_fraction_runs": seen_fraction(trained, groups), "held_out_runs": held}, groups


def combined(
    parts: dict[str, Any], groups: Sequence[np.ndarray], trained: np.ndarray
) -> dict[str, Any]:
    """The top-level ``seen_fraction`` and ``held_out`` block (and a warning when seen > 0)."""
    frac = seen_fraction(trained, groups) if groups else 0.0
    held: dict[str, Any] = dict(parts.pop("held_out_test", None) or {})
    if "held_out_runs" in parts:
        held.update(parts.pop("held_out_runs"))
    out = {"seen_fraction": frac, "held_out": held, **parts}
    if frac > 0:
        out["seen_warning"] = (
            f"{frac:.1%} of the scored items were in this model's training, "
            "selection or warm-start data: held_out scores unseen items only"
        )
    return out


def unknown(note: str) -> dict[str, Any]:
    """``seen_fraction: null`` (never 0) and the one line saying why."""
    return {"seen_fraction": None, "held_out": None, "seen_note": note}
