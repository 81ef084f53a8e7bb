"""What an evaluation scores that the model has already seen (issue 42, item 1).

A score on items the model was trained, selected or warm-started on is not a held-out score. Every
item is named by its content digest at source resolution (metalearning/items.py: a drawing's ink
mask, whatever its file format), the same digest that names a budget's data, so a drawing of the
official one-shot runs (105 x 105 PNGs) is recognised as the npz drawing a participant trained on.

``trained_items`` rebuilds every item the model saw: the participants' items (from a checkpoint's
configuration, all of the split's training classes; in a run, the item digests the participants
declared when they registered), the validation classes when model selection chose on them, and the
public classes of a warm start. An evaluation then reports ``seen_fraction`` (the fraction of the
distinct items it scores that are among them; None, with ``seen_note``, when the training items
cannot be found) and the same metrics over unseen items only (``held_out``). Seen items are
flagged (``seen_warning``), never refused. ``fedmeta evaluate`` (cli/fedmeta/cli/evaluate.py) and
the run's own test evaluation (server/fedmeta/server/test_seen.py) both report through here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # a summary's line is read without torch (core/fedmeta/workload.py needs it)
    from fedmeta.config_training import TrainingConfig
    from fedmeta.workload import Workload


def trained_items(
    workload: Workload, training: TrainingConfig, participants: np.ndarray | None = None
) -> np.ndarray | None:
    """Every item digest the model built as ``workload`` saw (None: unknown).

    ``training``: its ``model_selection`` (``best_validation`` saw the validation classes too).
    ``participants``: the participants' items when known otherwise than from the configuration
    (a run's registrations); else the split's training classes. The sinusoid has no items (a
    generated function family): None.
    """
    splits = workload.splits
    if splits is None:
        return None
    parts = [splits.train.item_ids if participants is None else participants]
    if training.model_selection == "best_validation":
        parts.append(splits.val.item_ids)
    if workload.warm_start is not None:
        public = workload.public_classes
        parts.append(None if public is None else public.item_ids)
    if any(p is None for p in parts):
        return None
    return np.unique(np.concatenate([np.asarray(p, np.uint64) for p in parts if p is not None]))


def seen_mask(trained: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Which of ``items`` are among the (sorted, unique) ``trained`` items."""
    if not len(trained):
        return np.zeros(len(items), dtype=bool)
    pos = np.minimum(np.searchsorted(trained, items), len(trained) - 1)
    return np.asarray(trained[pos] == items)


def seen_fraction(trained: np.ndarray, groups: Sequence[np.ndarray]) -> float:
    """The fraction of the distinct items of ``groups`` that the model saw."""
    items = np.unique(np.concatenate([np.asarray(g, dtype=np.uint64) for g in groups]))
    return float(seen_mask(trained, items).mean()) if len(items) else 0.0


def trained_or_note(
    training: TrainingConfig, workload: Workload, participants: np.ndarray | None = None
) -> tuple[np.ndarray | None, str | None]:
    """The model's training items, or None and the one line saying why they are unknown."""
    try:
        trained = trained_items(workload, training, participants)
    except (OSError, ValueError) as error:  # DataError is a ValueError
        return None, f"the training data of this model cannot be read ({error})"
    if trained is None:
        where = workload.dataset.path or workload.dataset.name
        return None, (f"the training data of this model ({where}) has no item digests to "
                      "compare with: seen_fraction unknown")  # fmt: skip
    return trained, None


def part_of_test_classes(
    trained: np.ndarray,
    workload: Workload,
    evaluate_tasks: Callable[[Any], Any],
    overall: Mapping[str, Any],
) -> tuple[dict[str, Any], np.ndarray]:
    """Seen fraction of the test classes' items, and the test metrics over unseen classes.

    Nothing seen: the metrics of the tasks already scored (``overall``: mean, ci95, median,
    tasks). Else tasks as many, drawn from the test classes none of whose items were seen.
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


def part_of_runs(
    trained: np.ndarray, runs: Sequence[Any], errors: Sequence[float]
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Seen fraction of the official runs' drawings; the error over the runs none of them seen."""
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
    """The top-level ``seen_fraction`` and ``held_out`` block (and a warning when seen > 0).

    No scored item with a digest: unknown (null), never 0.
    """
    if not groups:
        return {**unknown("the scored items have no digests to compare with"), **parts}
    frac = seen_fraction(trained, groups)
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


def seen_line(result: Mapping[str, Any]) -> str:
    """Both facts in one line: how much of what was scored the model had seen, and the rest."""
    frac = result.get("seen_fraction")
    if frac is None:
        return f"seen in training: unknown ({result.get('seen_note', '')})"
    held = result.get("held_out") or {}
    parts = []
    if held.get("mean") is not None:
        parts.append(f"test {held['mean']:.4f} over {held['tasks']} tasks")
    if held.get("mean_error") is not None:
        parts.append(f"runs' mean error {held['mean_error']:.4f} over {held['runs']} runs")
    flag = "WARNING: " if frac > 0 else ""
    return (f"{flag}seen in training: {frac:.1%} of the scored items; on unseen items only: "
            + ("; ".join(parts) or "none left"))  # fmt: skip
