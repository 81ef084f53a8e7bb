"""Sample level (issue 53): the task builder keeps the bound's conditions (example_slots).

The accountant (accounting.sample_level) is valid only if each example fills at most ``m`` slots a
round, at most once in a support set, and no other example's slots depend on whether it is present.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedmeta.metalearning.example_slots import (
    RoundSlots,
    SlotRule,
    build_round_slots,
    masked_tasks,
    slots_by_example,
)

pytestmark = pytest.mark.unit

#: Probability that a statistical check here fails for a correct builder and a random seed.
FALSE_ALARM = 1e-4


@st.composite
def participants(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, SlotRule, int]:
    n_way = draw(st.integers(1, 4))
    n_classes = draw(st.integers(n_way, 12))
    n = draw(st.integers(1, 60))
    ids = np.array(draw(st.lists(st.integers(-(2**40), 2**40), min_size=n, max_size=n,
                                 unique=True)), np.int64)  # fmt: skip
    labels = np.array(draw(st.lists(st.integers(0, n_classes - 1), min_size=n, max_size=n)))
    rule = SlotRule(
        n_way=n_way,
        passes=draw(st.integers(1, 4)),
        example_rate=draw(st.sampled_from([0.3, 0.7, 1.0])),
        support_share=draw(st.sampled_from([0.2, 0.5, 0.9])),
        tasks_per_pass=draw(st.one_of(st.none(), st.integers(1, 3))),
    )
    return ids, labels, n_classes, rule, draw(st.integers(0, 2**32))


def _build(ids: np.ndarray, labels: np.ndarray, n_classes: int, rule: SlotRule, seed: int):
    slots = build_round_slots(ids, labels, n_classes, rule, np.random.default_rng(seed))
    return slots, slots_by_example(slots, ids)


def _check_cap_and_labels(slots: RoundSlots, ids: np.ndarray, labels: np.ndarray) -> None:
    by_example = slots_by_example(slots, ids)
    for slot_list in by_example.values():
        assert len(slot_list) <= slots.rule.max_appearances
        tasks = [t for t, _ in slot_list]
        assert len(tasks) == len(set(tasks)), "an example twice in one task"
    for task in slots.tasks:
        for positions, task_labels in ((task.support, task.support_labels),
                                       (task.query, task.query_labels)):  # fmt: skip
            np.testing.assert_array_equal(task.classes[task_labels], labels[positions])


def _check_stable(ids, labels, n_classes, rule, seed, removed: int) -> None:
    """Removing example ``removed`` changes no other example's slots (nor their task labels)."""
    full, by_full = _build(ids, labels, n_classes, rule, seed)
    keep = np.arange(ids.size) != removed
    less, by_less = _build(ids[keep], labels[keep], n_classes, rule, seed)
    assert len(full.tasks) == len(less.tasks)
    by_full.pop(int(ids[removed]), None)
    assert by_full == by_less
    for a, b in zip(full.tasks, less.tasks, strict=True):
        np.testing.assert_array_equal(a.classes, b.classes)


@settings(max_examples=150, deadline=None)
@given(participants(), st.data())
def test_slots_are_capped_and_stable(case, data) -> None:
    ids, labels, n_classes, rule, seed = case
    slots, _ = _build(ids, labels, n_classes, rule, seed)
    _check_cap_and_labels(slots, ids, labels)
    _check_stable(ids, labels, n_classes, rule, seed, data.draw(st.integers(0, ids.size - 1)))


@settings(max_examples=60, deadline=None)
@given(participants(), st.data())
def test_an_example_alone_gets_the_slots_it_gets_among_others(case, data) -> None:
    ids, labels, n_classes, rule, seed = case
    i = data.draw(st.integers(0, ids.size - 1))
    _, by_all = _build(ids, labels, n_classes, rule, seed)
    _, by_one = _build(ids[i : i + 1], labels[i : i + 1], n_classes, rule, seed)
    assert by_one.get(int(ids[i]), []) == by_all.get(int(ids[i]), [])


def _fill_holes(slots: RoundSlots, k_shot: int) -> RoundSlots:
    """A builder that caps each label's support at ``k_shot`` by rank: one removal lets the next
    example in, the construction docs/privacy.md calls void."""
    tasks = []
    for task in slots.tasks:
        keep = np.concatenate(
            [np.flatnonzero(task.support_labels == j)[:k_shot] for j in range(len(task.classes))]
        ).astype(np.int64)
        keep.sort()
        tasks.append(dataclasses.replace(task, support=task.support[keep],
                                         support_labels=task.support_labels[keep]))  # fmt: skip
    return dataclasses.replace(slots, tasks=tuple(tasks))


def test_negative_control_hole_filling_is_caught_by_the_stability_check() -> None:
    ids, labels = np.arange(200), np.arange(200) % 10
    rule = SlotRule(n_way=5, passes=1, example_rate=1.0, support_share=0.5)
    full, _ = _build(ids, labels, 10, rule, 7)
    capped = slots_by_example(_fill_holes(full, 1), ids)
    removed = int(full.tasks[0].support[0])  # in a support set, with rivals for its place
    keep = ids != ids[removed]
    less = build_round_slots(ids[keep], labels[keep], 10, rule, np.random.default_rng(7))
    capped_less = slots_by_example(_fill_holes(less, 1), ids[keep])
    capped.pop(int(ids[removed]), None)
    assert capped != capped_less  # the next example moved into the support set
    _check_stable(ids, labels, 10, rule, 7, removed)  # the real builder holds


def test_inclusion_and_role_rates_match_the_rule() -> None:
    n, rate, share = 40_000, 0.1, 0.25
    ids, labels = np.arange(n) * 3 + 1, np.arange(n) % 20
    rule = SlotRule(n_way=5, passes=1, example_rate=rate, support_share=share)
    slots, _ = _build(ids, labels, 20, rule, 11)
    assert stats.binomtest(slots.sampled.size, n, rate).pvalue > FALSE_ALARM
    support = sum(t.support.size for t in slots.tasks)
    used = support + sum(t.query.size for t in slots.tasks)
    assert used == slots.sampled.size  # 20 classes, 4 full blocks: every sampled example is used
    assert stats.binomtest(support, used, share).pvalue > FALSE_ALARM


def test_unused_classes_and_task_count_are_public() -> None:
    ids, labels = np.arange(70), np.arange(70) % 7  # 7 classes, 3-way: one class left out a pass
    rule = SlotRule(n_way=3, passes=2, example_rate=1.0, support_share=0.5, tasks_per_pass=5)
    slots, by_example = _build(ids, labels, 7, rule, 3)
    assert len(slots.tasks) == 2 * 2  # min(7 // 3, 5) blocks per pass
    assert max(len(v) for v in by_example.values()) <= 2
    assert sum(len(v) for v in by_example.values()) == 2 * 60  # 6 of 7 classes used per pass


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(ids=np.array([1, 1])), "ids must be distinct"),
        (dict(labels=np.array([0, 9])), "labels must be class positions in [0, n_classes=4)"),
        (dict(n_classes=1), "n_classes must be an integer >= n_way=2"),
    ],
)
def test_bad_examples_get_one_clear_error(change, message) -> None:
    args = dict(ids=np.array([1, 2]), labels=np.array([0, 1]), n_classes=4,
                rule=SlotRule(2, 1, 0.5, 0.5), rng=np.random.default_rng(0))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        build_round_slots(**(args | change))


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_way", 0), ("passes", True), ("tasks_per_pass", 0), ("example_rate", 0.0),
     ("example_rate", 1.5), ("support_share", 1.0), ("support_share", float("nan"))],
)  # fmt: skip
def test_bad_rule_values_are_refused_naming_the_field(field: str, value: object) -> None:
    args: dict[str, object] = dict(n_way=2, passes=1, example_rate=0.5, support_share=0.5)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SlotRule(**(args | {field: value}))  # type: ignore[arg-type]


def test_masked_tasks_pads_and_gathers_by_position() -> None:
    ids, labels = np.arange(100, 160), np.arange(60) % 6
    rule = SlotRule(n_way=3, passes=2, example_rate=0.5, support_share=0.5)
    slots, _ = _build(ids, labels, 6, rule, 5)
    batch = masked_tasks(slots, lambda pos: torch.as_tensor(ids[pos], dtype=torch.float64))
    for t, task in enumerate(slots.tasks):
        for x, y, mask, positions, task_labels in (
            (batch.support_x, batch.support_y, batch.support_mask, task.support,
             task.support_labels),
            (batch.query_x, batch.query_y, batch.query_mask, task.query, task.query_labels),
        ):  # fmt: skip
            n = positions.size
            assert mask[t].sum() == n and bool(mask[t, :n].all())
            np.testing.assert_array_equal(x[t, :n].numpy(), ids[positions])
            np.testing.assert_array_equal(y[t, :n].numpy(), task_labels)
            assert not x[t, n:].any() and not y[t, n:].any()


def test_a_participant_with_no_examples_gets_the_public_number_of_empty_tasks() -> None:
    empty = np.array([], np.int64)
    slots = build_round_slots(empty, empty, 4, SlotRule(2, 2, 0.5, 0.5), np.random.default_rng(0))
    assert len(slots.tasks) == 4 and slots.sampled.size == 0
    batch = masked_tasks(slots, lambda pos: torch.zeros(len(pos), 1))
    assert batch.num_tasks == 4 and not batch.support_mask.any() and not batch.query_mask.any()
