"""Sample-level DP-MAML's tasks (issue 53): Poisson-sampled examples, each in stable, capped slots.

``accounting.sample_level.SampleLevelRound`` is valid only for a task builder that keeps three
conditions (docs/privacy.md, "Sample level (issue 53): the bound"); this one keeps them by
construction, for one participant's examples in one round:

* **Poisson sampling.** Example ``x`` is used with probability ``floor(q 2^64) / 2^64 <= q``
  (never above the rate the accountant is given: the safe side), decided by its own coin.
* **At most m slots, at most once in a support set.** A round has ``passes`` passes (``m =
  passes``). Each pass deals the participant's declared classes into blocks of ``n_way`` (one
  random permutation per pass); block ``b`` of pass ``p`` is task ``(p, b)``, the class at position
  ``j`` of the block is its label ``j``. In each pass a sampled example fills exactly one slot: the
  support or the query set of the task its class landed in (or none, when its class fell outside
  the used blocks). So ``x`` fills at most ``passes`` slots, never twice in one task.
* **Stable slots.** Every random choice about ``x`` (its coin, its role in each pass) is a keyed
  BLAKE2b (a PRF) of a 128-bit round key and ``x``'s identity, and the permutations depend on the
  class count alone, so an example's slots are a function of that example and of the round's
  randomness: adding or removing ``x`` changes no other example's slots. Nothing is capped by
  ranking and no hole is filled, so a task's support and query sizes vary (their expectation is
  ``q * examples_per_class * share`` per label); the computation normalises by a public constant
  (``metalearning.sample_level``), never by a realised count.

The round key and permutations come from the numpy ``Generator`` passed in (in a private run one
over a secret CSPRNG keystream, ``randomgen.AESCounter``, as the server's noise). The declared
classes are fixed before the round (a participant's class list, not those its sample covers).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MaskedTasks",
    "RoundSlots",
    "SlotRule",
    "TaskSlots",
    "build_round_slots",
    "masked_tasks",
    "slots_by_example",
]

_KEY_BYTES = 16  # AES-128-sized round key: what the PRF needs to be unpredictable
_PERSON = b"fedmeta-slots-v1"  # BLAKE2b personalisation: this PRF and no other


def _coin(words: np.ndarray, probability: float) -> np.ndarray:
    """``words < floor(p 2^64)``: true with probability at most ``p`` for uniform uint64 words."""
    # ldexp is exact and floor rounds down: threshold / 2^64 <= probability.
    threshold = math.floor(math.ldexp(float(probability), 64))
    if threshold >= 1 << 64:  # p = 1: every word (2^64 does not fit in a uint64)
        return np.ones(words.shape, bool)
    return words < np.uint64(threshold)


@dataclass(frozen=True)
class SlotRule:
    """The public shape of a round: how many passes, how tasks are cut, how often x is drawn.

    ``example_rate`` is the Poisson rate ``q``; ``support_share`` the probability that a sampled
    example is a support (not query) example in a pass (``k_shot / (k_shot + q_query)`` makes
    the nominal N-way K-shot ratio); ``tasks_per_pass`` the blocks used per pass (None: every full
    block). ``max_appearances`` is the accountant's ``m``.
    """

    n_way: int
    passes: int
    example_rate: float
    support_share: float
    tasks_per_pass: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_way", "passes", "tasks_per_pass"):
            value = getattr(self, name)
            if (value is not None or name != "tasks_per_pass") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        for name, closed in (("example_rate", True), ("support_share", False)):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, float | int)
            if not (number and 0 < value and (value <= 1 if closed else value < 1)):
                end = "]" if closed else ")"
                raise ValueError(f"{name} must be a number in (0, 1{end}; got {value!r}")

    @property
    def max_appearances(self) -> int:
        """``m``: the most slots one example fills in a round (one per pass)."""
        return self.passes


@dataclass(frozen=True)
class TaskSlots:
    """One task: its classes (label ``j`` is ``classes[j]``) and its examples' positions by role.

    ``support`` / ``query`` index the ``ids`` given to :func:`build_round_slots`; ``*_labels``
    are the examples' labels in this task (``0 .. n_way - 1``).
    """

    classes: np.ndarray
    support: np.ndarray
    support_labels: np.ndarray
    query: np.ndarray
    query_labels: np.ndarray


@dataclass(frozen=True)
class RoundSlots:
    """A round's tasks (pass-major: task ``p * tasks_per_pass + b``) and the sampled positions."""

    rule: SlotRule
    tasks: tuple[TaskSlots, ...]
    sampled: np.ndarray


def _check_examples(ids: np.ndarray, labels: np.ndarray, n_classes: int) -> None:
    if ids.ndim != 1 or labels.shape != ids.shape:
        raise ValueError(
            f"ids and labels must be 1-D of one length; got {ids.shape} and {labels.shape}"
        )
    if np.unique(ids).size != ids.size:
        raise ValueError("ids must be distinct (one identity per example); got repeated ids")
    if ids.size and (labels.min() < 0 or labels.max() >= n_classes):
        raise ValueError(
            f"labels must be class positions in [0, n_classes={n_classes}); got values in "
            f"[{labels.min()}, {labels.max()}]"
        )


def _example_words(key: bytes, ids: np.ndarray, words: int) -> np.ndarray:
    """``words`` pseudo-random uint64 per example: keyed BLAKE2b of the example's id alone."""
    out = np.empty((ids.size, words), np.uint64)
    for i, ident in enumerate(ids.tolist()):
        digest = hashlib.blake2b(
            int(ident).to_bytes(8, "little", signed=True),
            key=key,
            person=_PERSON,
            digest_size=8 * words,
        ).digest()
        out[i] = np.frombuffer(digest, dtype="<u8")
    return out


def _blocks(n_classes: int, rule: SlotRule, rng: np.random.Generator) -> np.ndarray:
    """``[passes, n_classes]``: each class's position in the pass's permutation, -1 if unused.

    Position ``b * n_way + j`` is label ``j`` of block (task) ``b``.
    """
    full = n_classes // rule.n_way
    used = full if rule.tasks_per_pass is None else min(full, rule.tasks_per_pass)
    position = np.full((rule.passes, n_classes), -1, np.int64)
    for p in range(rule.passes):
        order = rng.permutation(n_classes)[: used * rule.n_way]
        position[p, order] = np.arange(order.size)
    return position


def build_round_slots(
    ids: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    rule: SlotRule,
    rng: np.random.Generator,
) -> RoundSlots:
    """One round's tasks from one participant's examples (module docstring).

    ``ids`` are the examples' distinct identities (int64: dataset rows or content digests) and
    ``labels`` their positions in the participant's ``n_classes`` declared classes. ``rng`` is
    the round's generator; it is read the same way whatever the examples are.
    """
    ids = np.asarray(ids, np.int64)
    labels = np.asarray(labels, np.int64)
    if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < rule.n_way:
        raise ValueError(f"n_classes must be an integer >= n_way={rule.n_way}; got {n_classes!r}")
    _check_examples(ids, labels, n_classes)
    key = rng.bytes(_KEY_BYTES)
    position = _blocks(n_classes, rule, rng)
    words = _example_words(key, ids, 1 + rule.passes)
    sampled = np.flatnonzero(_coin(words[:, 0], rule.example_rate))
    tasks: list[TaskSlots] = []
    for p in range(rule.passes):
        support = _coin(words[sampled, 1 + p], rule.support_share)
        tasks += _pass_tasks(position[p], labels[sampled], sampled, support, rule)
    return RoundSlots(rule, tuple(tasks), sampled)


def _pass_tasks(
    position: np.ndarray,
    sampled_labels: np.ndarray,
    sampled: np.ndarray,
    support: np.ndarray,
    rule: SlotRule,
) -> list[TaskSlots]:
    """One pass's tasks; ``position`` is the pass's row of :func:`_blocks`."""
    blocks = (int(position.max()) + 1) // rule.n_way  # the used blocks: public
    slot = position[sampled_labels]  # -1: the example's class is in no task this pass
    tasks = []
    for b in range(blocks):
        lo = b * rule.n_way
        classes = np.empty(rule.n_way, np.int64)
        members = np.flatnonzero((position >= lo) & (position < lo + rule.n_way))
        classes[position[members] - lo] = members
        inside = (slot >= lo) & (slot < lo + rule.n_way)
        s_mask, q_mask = inside & support, inside & ~support
        tasks.append(
            TaskSlots(
                classes=classes,
                support=sampled[s_mask],
                support_labels=slot[s_mask] - lo,
                query=sampled[q_mask],
                query_labels=slot[q_mask] - lo,
            )
        )
    return tasks


def slots_by_example(slots: RoundSlots, ids: np.ndarray) -> dict[int, list[tuple[int, str]]]:
    """Each used example's id -> its ``(task, "support" | "query")`` slots (for checks)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for t, task in enumerate(slots.tasks):
        for role, positions in (("support", task.support), ("query", task.query)):
            for i in positions.tolist():
                out.setdefault(int(ids[i]), []).append((t, role))
    return out


class MaskedTasks(NamedTuple):
    """Tasks of varying sizes, padded; ``*_mask`` ``[T, S]`` is False on padding.

    ``S`` and ``Q`` are the round's largest sizes (at least 1): data-dependent, never released.
    """

    support_x: Tensor
    support_y: Tensor
    support_mask: Tensor
    query_x: Tensor
    query_y: Tensor
    query_mask: Tensor

    @property
    def num_tasks(self) -> int:
        """The leading (task) dimension."""
        return int(self.support_x.shape[0])

    def select(self, start: int, stop: int) -> MaskedTasks:
        """Tasks ``start .. stop - 1``."""
        return MaskedTasks(*(t[start:stop] for t in self))

    def to(self, device: torch.device) -> MaskedTasks:
        """All six tensors on ``device``."""
        return MaskedTasks(*(t.to(device) for t in self))


def _padded(
    parts: list[tuple[np.ndarray, np.ndarray]],
    inputs: Callable[[np.ndarray], Tensor],
    targets: Callable[[np.ndarray, np.ndarray], Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    width = max(1, max(p.size for p, _ in parts))
    positions = np.concatenate([p for p, _ in parts])
    labels = np.concatenate([lab for _, lab in parts])
    x_all, y_all = inputs(positions), targets(positions, labels)
    x = x_all.new_zeros((len(parts), width, *x_all.shape[1:]))
    y = y_all.new_zeros((len(parts), width, *y_all.shape[1:]))
    mask = torch.zeros((len(parts), width), dtype=torch.bool, device=x_all.device)
    ends = np.cumsum([p.size for p, _ in parts]).tolist()
    for t, (p, _) in enumerate(parts):
        rows = slice(ends[t] - p.size, ends[t])
        x[t, : p.size], y[t, : p.size], mask[t, : p.size] = x_all[rows], y_all[rows], True
    return x, y, mask


def masked_tasks(
    slots: RoundSlots,
    inputs: Callable[[np.ndarray], Tensor],
    targets: Callable[[np.ndarray, np.ndarray], Tensor] | None = None,
) -> MaskedTasks:
    """The round's tasks as one padded batch.

    ``inputs(positions)`` returns the examples at those positions of the ``ids`` (e.g.
    ``lambda pos: dataset.example(ids[pos], device)``); ``targets(positions, task_labels)`` their
    targets, by default the task labels themselves (classification; a regression workload passes
    its own values).
    """

    def by_label(positions: np.ndarray, labels: np.ndarray) -> Tensor:
        return torch.as_tensor(labels, dtype=torch.int64)

    get_y = targets or by_label
    sx, sy, sm = _padded([(t.support, t.support_labels) for t in slots.tasks], inputs, get_y)
    qx, qy, qm = _padded([(t.query, t.query_labels) for t in slots.tasks], inputs, get_y)
    return MaskedTasks(sx, sy.to(sx.device), sm, qx, qy.to(qx.device), qm)
