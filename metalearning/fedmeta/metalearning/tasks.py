"""Tasks: one N-way K-shot task, batches of tasks, and tasks drawn from a class dataset.

* :class:`Task` - ``(support_x, support_y, query_x, query_y)``; batched when the tensors carry a
  leading task dimension (:func:`stack_tasks`).
* :func:`sample_tasks` - held-out evaluation tasks from all classes of a
  :class:`~metalearning.images.ClassDataset`; task ``i`` depends on ``(seed, i)`` only.
* :func:`seeded_rng`, :func:`draw_plan`, :func:`numbered_plans`, :func:`task_from_plan` - the
  draws every task builder in this package shares (:mod:`metalearning.sinusoid`,
  :mod:`metalearning.federated`), so that a task is a pure function of its seed path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedmeta.metalearning.images import ClassDataset

__all__ = [
    "Task",
    "check_task_shape",
    "draw_plan",
    "numbered_plans",
    "sample_tasks",
    "seeded_rng",
    "stack_tasks",
    "task_from_plan",
    "tasks_from_plans",
]


class Task(NamedTuple):
    """One task (or a batch of tasks with a leading task dimension)."""

    support_x: Tensor
    support_y: Tensor
    query_x: Tensor
    query_y: Tensor

    def to(self, device: torch.device | str) -> Task:
        """Move all four tensors to ``device`` (no copy when already there)."""
        return Task(*(t.to(device, non_blocking=True) for t in self))

    def task(self, i: int) -> Task:
        """Task ``i`` of a batch."""
        return Task(*(t[i] for t in self))

    @property
    def num_tasks(self) -> int:
        """Leading dimension of a batched task."""
        return int(self.support_x.shape[0])


def stack_tasks(tasks: Sequence[Task]) -> Task:
    """Stack unbatched tasks of one shape into a batched :class:`Task`."""
    if not tasks:
        raise ValueError("stack_tasks needs at least one task")
    return Task(*(torch.stack(parts) for parts in zip(*tasks, strict=True)))


def seeded_rng(seed: int, *path: int) -> np.random.Generator:
    """Return a Generator that is a pure function of ``(seed, *path)``.

    Each task builder uses its own constant as the first path element, so two builders never draw
    the same stream for the same seed.
    """
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, *(int(p) for p in path)])


def task_from_plan(ds: ClassDataset, plan: np.ndarray, k_shot: int) -> Task:
    """Build a task from ``plan`` [n_way, k_shot + q] global example indices; label = row index."""
    return tasks_from_plans(ds, plan[None], k_shot).task(0)


def tasks_from_plans(
    ds: ClassDataset, plans: np.ndarray, k_shot: int, device: torch.device | None = None
) -> Task:
    """The tasks of ``plans`` [n, n_way, k_shot + q] as one batch: each task's images at once.

    Gathered on ``device`` (the host by default); task ``i`` is :func:`task_from_plan` of
    ``plans[i]``.
    """
    n, n_way, per = plans.shape
    x = ds.example(plans, device)  # [n, n_way, per, C, H, W]
    y = torch.arange(n_way, device=x.device).repeat_interleave(per).reshape(n_way, per)
    image = x.shape[3:]
    support_y = y[:, :k_shot].reshape(1, -1).repeat(n, 1)
    query_y = y[:, k_shot:].reshape(1, -1).repeat(n, 1)
    return Task(x[:, :, :k_shot].reshape(n, -1, *image), support_y,
                x[:, :, k_shot:].reshape(n, -1, *image), query_y)  # fmt: skip


def draw_plan(
    offsets: np.ndarray, classes: np.ndarray, n_way: int, per: int, rng: np.random.Generator
) -> np.ndarray:
    """``n_way`` of ``classes`` without replacement, then ``per`` examples of each: [n_way, per].

    ``offsets`` is a :class:`~metalearning.images.ClassDataset`'s: class ``c`` holds the examples
    ``offsets[c]`` to ``offsets[c + 1]`` (exclusive). Taking the offsets rather than the dataset
    keeps the draw cheap to ship to another process (:func:`numbered_plans`).
    """
    chosen = rng.choice(classes, size=n_way, replace=False)
    rows = []
    for c in chosen:
        lo, hi = int(offsets[c]), int(offsets[c + 1])
        rows.append(lo + rng.choice(hi - lo, size=per, replace=False))
    return np.stack(rows)


def numbered_plans(
    offsets: np.ndarray,
    classes: np.ndarray,
    n_way: int,
    per: int,
    n_tasks: int,
    seed: int,
    *path: int,
) -> np.ndarray:
    """Tasks ``0 .. n_tasks - 1`` of one list, task ``t`` drawn from ``seeded_rng(seed, *path, t)``.

    Returns ``[n_tasks, n_way, per]`` int64. Each task depends on its own seed path only, so lists
    (or parts of one) drawn in different processes are the same as drawn in one.
    """
    plans = np.empty((n_tasks, n_way, per), np.int64)
    for t in range(n_tasks):
        plans[t] = draw_plan(offsets, classes, n_way, per, seeded_rng(seed, *path, t))
    return plans


def check_task_shape(ds: ClassDataset, classes: np.ndarray, n_way: int, per: int) -> None:
    """Raise ValueError unless ``n_way`` of ``classes`` have ``per`` examples each."""
    if n_way < 1 or per < 2:
        raise ValueError(f"n_way must be >= 1 and k_shot, q_query >= 1; got {n_way}, {per}")
    eligible = int((ds.counts[classes] >= per).sum()) if len(classes) else 0
    if eligible < n_way:
        raise ValueError(
            f"need {n_way} classes with >= {per} examples (k_shot + q_query) for a task; "
            f"only {eligible} of {len(classes)} classes qualify"
        )


def sample_tasks(
    ds: ClassDataset,
    *,
    n_way: int,
    k_shot: int,
    q_query: int,
    n_tasks: int,
    seed: int,
    path: tuple[int, ...] = (0x7E57,),
) -> Task:
    """``n_tasks`` N-way K-shot tasks (``q_query`` queries per class) from all classes of ``ds``.

    For validation / meta-test evaluation (default 600 tasks in
    :func:`~metalearning.evaluation.evaluate`'s usage) and public pre-training. Task i depends only
    on
    ``(seed, *path, i)``; ``path`` keeps one builder's stream apart from another's.
    """
    per = k_shot + q_query
    classes = np.flatnonzero(ds.counts >= per)
    check_task_shape(ds, np.arange(ds.n_classes), n_way, per)
    return stack_tasks(
        [
            task_from_plan(
                ds, draw_plan(ds.offsets, classes, n_way, per, seeded_rng(seed, *path, i)), k_shot
            )
            for i in range(n_tasks)
        ]
    )
