"""What an evaluation scores that the model has already seen (issue 42, item 1).

A score on items the model was trained, selected or warm-started on is not a held-out score. Every
item is named by its content digest at source resolution (metalearning/items.py: a drawing's ink
mask, whatever its file format), the same digest that names a budget's data, so a drawing of the
official one-shot runs (105 x 105 PNGs) is recognised as the npz drawing a participant trained on.

``trained_items`` rebuilds, from a checkpoint's configuration, every item the model saw: the
participants' classes (all of the split's training classes), the validation classes when model
selection chose on them, and the public classes of a warm start. An evaluation then reports
``seen_fraction`` (the fraction of the distinct items it scores that are among them; None when the
training data's items cannot be found) and the same metrics over unseen items only (``held_out``).
Seen items are flagged, never refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedmeta.config import Config
from fedmeta.workload import Workload


def trained_items(workload: Workload, cfg: Config) -> np.ndarray | None:
    """Every item digest the model of ``cfg`` (built as ``workload``) saw (None: unknown).

    The sinusoid has no items (a generated function family): None.
    """
    splits = workload.splits
    if splits is None:
        return None
    parts = [splits.train.item_ids]
    if cfg.training.model_selection == "best_validation":
        parts.append(splits.val.item_ids)
    if workload.warm_start is not None:
        public = workload.public_classes
        parts.append(None if public is None else public.item_ids)
    if any(p is None for p in parts):
        return None
    return np.unique(np.concatenate([p for p in parts if p is not None]))


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
