"""Federated task sets: participants owning disjoint data, each with a fixed, numbered task list.

* :func:`partition_classes` - a class dataset's classes dealt to participants (whole alphabets, or
  an even random split).
* :class:`ParticipantTasks` / :class:`SinusoidParticipant` - one participant's tasks; task ``t`` is
  a pure function of ``(seed, participant, t)``, stable across rounds and restarts.
* :class:`FederatedTaskSet` - all participants; ``task_counts()`` feeds the accountant's sampler,
  ``participant(pid).tasks(ids)`` the per-task clipped gradients.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedmeta.metalearning.images import ClassDataset
from fedmeta.metalearning.sinusoid import SinusoidTasks
from fedmeta.metalearning.tasks import (
    Task,
    check_task_shape,
    numbered_plans,
    seeded_rng,
    stack_tasks,
    task_from_plan,
    tasks_from_plans,
)

__all__ = ["FederatedTaskSet", "ParticipantTasks", "SinusoidParticipant", "partition_classes"]


def partition_classes(
    ds: ClassDataset, n_participants: int, *, mode: str = "group", seed: int = 0
) -> list[np.ndarray]:
    """Split ``ds``'s classes into ``n_participants`` disjoint, sorted index arrays.

    ``mode="group"``: whole groups (Omniglot alphabets: the natural non-IID split) are shuffled with
    ``seed`` and dealt greedily to the participant with the fewest classes so far. ``mode="even"``:
    the classes are shuffled and dealt into near-equal parts (IID over classes).
    """
    if n_participants < 1:
        raise ValueError(f"n_participants must be >= 1; got {n_participants}")
    rng = np.random.default_rng([int(seed), 0x9A27])
    if mode == "even":
        if ds.n_classes < n_participants:
            raise ValueError(
                f"n_participants must be <= the number of classes ({ds.n_classes}); "
                f"got {n_participants}"
            )
        perm = rng.permutation(ds.n_classes)
        return [np.sort(p) for p in np.array_split(perm, n_participants)]
    if mode != "group":
        raise ValueError(f"mode must be 'group' or 'even'; got {mode!r}")
    groups: dict[str, list[int]] = {}
    for c, g in enumerate(ds.groups):
        groups.setdefault(g, []).append(c)
    if len(groups) < n_participants:
        raise ValueError(
            f"n_participants must be <= the number of groups/alphabets ({len(groups)}) for "
            f"mode='group'; got {n_participants} (use mode='even')"
        )
    names = sorted(groups)
    shuffled = rng.permutation(len(names))
    # Largest groups first (shuffled among ties) for a balanced greedy deal.
    order = sorted(shuffled.tolist(), key=lambda i: -len(groups[names[i]]))
    owned: list[list[int]] = [[] for _ in range(n_participants)]
    for j, i in enumerate(order):
        target = (
            j
            if j < n_participants
            else min(range(n_participants), key=lambda p: (len(owned[p]), p))
        )
        owned[target] += groups[names[i]]
    return [np.array(sorted(o), dtype=np.int64) for o in owned]


@dataclass
class ParticipantTasks:
    """One participant's fixed, numbered list of N-way K-shot tasks over its own classes.

    ``plan[t]`` holds the global example indices of task ``t`` (``[n_way, k_shot + q_query]``; row j
    is label j, the first ``k_shot`` columns the support set). Task ids are ``0 .. num_tasks - 1``.
    """

    id: str
    dataset: ClassDataset
    classes: np.ndarray
    plan: np.ndarray
    k_shot: int

    @property
    def num_tasks(self) -> int:
        """Number of tasks this participant holds."""
        return int(self.plan.shape[0])

    def task(self, task_id: int) -> Task:
        """Task ``task_id`` (unbatched)."""
        if not 0 <= task_id < self.num_tasks:
            raise IndexError(f"task_id must be in [0, {self.num_tasks}); got {task_id}")
        return task_from_plan(self.dataset, self.plan[task_id], self.k_shot)

    def tasks(self, task_ids: Sequence[int], device: torch.device | None = None) -> Task:
        """Return the given tasks as one batch (order kept): :meth:`task`'s tensors, stacked.

        One gather of every task's images at once rather than a task at a time, on ``device``
        (the host by default): a GPU round of DP-MAML's lot builds 1,600 tasks (48,000 images),
        which one task at a time on the host took a tenth of the round.
        """
        ids = np.asarray(task_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("tasks needs at least one task id")
        if ids.min() < 0 or ids.max() >= self.num_tasks:
            bad = int(ids[(ids < 0) | (ids >= self.num_tasks)][0])
            raise IndexError(f"task_id must be in [0, {self.num_tasks}); got {bad}")
        return tasks_from_plans(self.dataset, self.plan[ids], self.k_shot, device)

    def example_use_counts(self) -> np.ndarray:
        """Per example (global index order): how many of this participant's tasks use it."""
        return np.bincount(self.plan.reshape(-1), minlength=self.dataset.images.shape[0])

    @property
    def max_tasks_per_example(self) -> int:
        """Most tasks any single example appears in (the example-level group size)."""
        return int(self.example_use_counts().max(initial=0))

    def summary(self) -> dict[str, Any]:
        """Class, task and example-reuse counts."""
        groups = sorted({self.dataset.groups[c] for c in self.classes})
        return {
            "participant": self.id,
            "classes": int(len(self.classes)),
            "groups": len(groups),
            "tasks": self.num_tasks,
            "max_tasks_per_example": self.max_tasks_per_example,
        }


@dataclass
class SinusoidParticipant:
    """A participant's slice of the sinusoid task distribution and its numbered task list.

    Task ``t`` is drawn from ``(seed, index, t)``: amplitude in this participant's
    ``amplitude_range``, phase and x as in :class:`SinusoidTasks`. Every task has its own x points,
    so no example is shared between tasks (``max_tasks_per_example == 1``).
    """

    id: str
    index: int
    family: SinusoidTasks
    num_tasks: int
    seed: int

    def task(self, task_id: int) -> Task:
        """Task ``task_id`` (unbatched)."""
        if not 0 <= task_id < self.num_tasks:
            raise IndexError(f"task_id must be in [0, {self.num_tasks}); got {task_id}")
        return self.family.task_from_rng(seeded_rng(self.seed, 0x5111, self.index, task_id))[0]

    def tasks(self, task_ids: Sequence[int], device: torch.device | None = None) -> Task:
        """Return the given tasks as one batch (order kept), on ``device`` (the host by default)."""
        batch = stack_tasks([self.task(int(t)) for t in task_ids])
        return batch if device is None else batch.to(device)

    @property
    def max_tasks_per_example(self) -> int:
        """Always 1: sinusoid tasks share no points."""
        return 1

    def summary(self) -> dict[str, Any]:
        """Task count and amplitude slice."""
        return {
            "participant": self.id,
            "classes": None,
            "amplitude_range": list(self.family.amplitude_range),
            "tasks": self.num_tasks,
            "max_tasks_per_example": 1,
        }


@dataclass
class FederatedTaskSet:
    """Participants (ids ``"0"``, ``"1"``, ...) with disjoint data and fixed numbered task lists.

    Build with :meth:`from_classes` (image data) or :meth:`sinusoid`. ``task_counts()`` feeds
    ``accounting.TwoStageSampler.sample``; ``participant(pid).tasks(ids)`` feeds
    :func:`~metalearning.maml.per_task_clipped_grads`.
    """

    participants: dict[str, ParticipantTasks | SinusoidParticipant]
    config: dict[str, Any] = field(default_factory=dict)

    def participant(self, pid: str | int) -> ParticipantTasks | SinusoidParticipant:
        """Participant by id (``"3"`` or ``3``)."""
        key = str(pid)
        if key not in self.participants:
            raise KeyError(f"unknown participant {pid!r}; ids are 0..{len(self.participants) - 1}")
        return self.participants[key]

    @property
    def ids(self) -> list[str]:
        """Participant ids in order."""
        return list(self.participants)

    def task_counts(self) -> dict[str, int]:
        """Participant id -> number of tasks."""
        return {pid: p.num_tasks for pid, p in self.participants.items()}

    @property
    def max_tasks_per_example(self) -> int:
        """Largest number of tasks any single example appears in, over all participants."""
        return max((p.max_tasks_per_example for p in self.participants.values()), default=0)

    def summary(self) -> list[dict[str, Any]]:
        """One dict per participant: classes, tasks, max tasks per example."""
        return [p.summary() for p in self.participants.values()]

    @classmethod
    def sinusoid(
        cls,
        n_participants: int,
        *,
        tasks_per_participant: int = 1000,
        k_support: int = 10,
        k_query: int = 10,
        partition: str = "amplitude",
        seed: int = 0,
        family: SinusoidTasks | None = None,
    ) -> FederatedTaskSet:
        """Build sinusoid participants with fixed, seed-derived task lists.

        ``partition="amplitude"`` gives participant i the i-th of ``n_participants`` equal amplitude
        intervals (non-IID); ``"iid"`` gives everyone the whole distribution.
        """
        fam = family or SinusoidTasks(k_support, k_query)
        if n_participants < 1 or tasks_per_participant < 1:
            raise ValueError(
                f"n_participants and tasks_per_participant must be >= 1; got {n_participants}, "
                f"{tasks_per_participant}"
            )
        lo, hi = fam.amplitude_range
        parts: dict[str, ParticipantTasks | SinusoidParticipant] = {}
        for i in range(n_participants):
            if partition == "amplitude":
                w = (hi - lo) / n_participants
                f_i = SinusoidTasks(
                    fam.k_support,
                    fam.k_query,
                    (lo + i * w, lo + (i + 1) * w),
                    fam.phase_range,
                    fam.x_range,
                )
            elif partition == "iid":
                f_i = fam
            else:
                raise ValueError(f"partition must be 'amplitude' or 'iid'; got {partition!r}")
            parts[str(i)] = SinusoidParticipant(str(i), i, f_i, tasks_per_participant, seed)
        return cls(parts, {"kind": "sinusoid", "partition": partition, "seed": seed})

    @classmethod
    def from_classes(
        cls,
        ds: ClassDataset,
        n_participants: int,
        *,
        n_way: int = 5,
        k_shot: int = 1,
        q_query: int = 15,
        tasks_per_participant: int | None = 1000,
        partition: str = "group",
        disjoint_examples: bool = False,
        seed: int = 0,
    ) -> FederatedTaskSet:
        """Partition ``ds``'s classes (:func:`partition_classes`) and fix each participant's tasks.

        With ``disjoint_examples=False`` task ``t`` of participant ``i`` is drawn from ``(seed, i,
        t)`` alone (classes without replacement, then ``k_shot + q_query`` examples per class
        without replacement); examples may recur across tasks. With ``disjoint_examples=True`` each
        example is used by at most one task: tasks are dealt from per-class shuffled pools (seeded
        by ``(seed, i)``) until fewer than ``n_way`` classes have enough unused examples, or
        ``tasks_per_participant`` is reached (None: as many as fit).
        """
        per = k_shot + q_query
        if k_shot < 1 or q_query < 1:
            raise ValueError(f"k_shot and q_query must be >= 1; got {k_shot}, {q_query}")
        if not disjoint_examples and (tasks_per_participant is None or tasks_per_participant < 1):
            raise ValueError(f"tasks_per_participant must be >= 1; got {tasks_per_participant}")
        owned = partition_classes(ds, n_participants, mode=partition, seed=seed)
        eligible = []
        for i, classes in enumerate(owned):
            try:
                check_task_shape(ds, classes, n_way, per)
            except ValueError as e:
                raise ValueError(f"participant {i}: {e}") from None
            eligible.append(classes[ds.counts[classes] >= per])
        if disjoint_examples:
            plans = []
            for i, classes in enumerate(eligible):
                rng = seeded_rng(seed, 0xD15, i)
                plans.append(_disjoint_plan(ds, classes, n_way, per, tasks_per_participant, rng))
                if not len(plans[-1]):
                    raise ValueError(f"participant {i}: not enough examples for one disjoint task")
        else:
            assert tasks_per_participant is not None
            jobs = [(ds.offsets, classes, n_way, per, tasks_per_participant, seed, 0x7A5C, i)
                    for i, classes in enumerate(eligible)]  # fmt: skip
            plans = _draw_lists(jobs, parallel=len(jobs) * tasks_per_participant >= PARALLEL_TASKS)
        parts: dict[str, ParticipantTasks | SinusoidParticipant] = {
            str(i): ParticipantTasks(str(i), ds, classes, plan.astype(np.int64), k_shot)
            for i, (classes, plan) in enumerate(zip(owned, plans, strict=True))
        }
        cfg = {
            "kind": "classes", "n_way": n_way, "k_shot": k_shot, "q_query": q_query,
            "partition": partition, "disjoint_examples": disjoint_examples, "seed": seed,
        }  # fmt: skip
        return cls(parts, cfg)


#: Numbering at least this many tasks in all spreads the participants' lists over processes: about
#: 180 us a task in one process (400,000 tasks, DP-MAML's universe: 73 s on one core of a 2-core
#: VM), against a few seconds to start the workers (docs/benchmarks.md).
PARALLEL_TASKS = 100_000


def _draw_lists(jobs: Sequence[tuple[Any, ...]], *, parallel: bool) -> list[np.ndarray]:
    """:func:`numbered_plans` of each job, in worker processes when ``parallel`` and cores allow.

    A task depends on its seed path only, so the lists are the same either way. Workers ignore
    Ctrl-C: the parent stops (cancelling the lists not yet begun) and reports it once.
    """
    workers = min(len(jobs), len(os.sched_getaffinity(0)))
    if not parallel or workers < 2:
        return [numbered_plans(*job) for job in jobs]
    context = multiprocessing.get_context("spawn")  # no fork of a process that runs torch threads
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_sigint) as pool:
        try:
            return list(pool.map(numbered_plans, *zip(*jobs, strict=True)))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _disjoint_plan(
    ds: ClassDataset,
    eligible: np.ndarray,
    n_way: int,
    per: int,
    limit: int | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """Tasks dealt from per-class shuffled pools, so that no example is in two tasks.

    Stops when fewer than ``n_way`` classes have ``per`` unused examples, or at ``limit`` tasks
    (None: as many as fit). Returns ``[tasks, n_way, per]`` (possibly zero tasks).
    """
    pools = {
        int(c): list(int(ds.offsets[c]) + rng.permutation(int(ds.counts[c]))) for c in eligible
    }
    rows: list[np.ndarray] = []
    cap = math.inf if limit is None else limit
    while len(rows) < cap:
        avail = np.array([c for c in eligible if len(pools[int(c)]) >= per])
        if len(avail) < n_way:
            break
        chosen = rng.choice(avail, size=n_way, replace=False)
        rows.append(np.stack([[pools[int(c)].pop() for _ in range(per)] for c in chosen]))
    return np.stack(rows) if rows else np.zeros((0, n_way, per), np.int64)
