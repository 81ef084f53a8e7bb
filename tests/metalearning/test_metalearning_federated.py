"""Sinusoid tasks, class partitions and federated task lists (metalearning.sinusoid, .federated)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedmeta.metalearning as ml

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- sinusoid


def test_sinusoid_tasks_ranges_and_determinism() -> None:
    fam = ml.SinusoidTasks(5, 7)
    b = fam.sample(50, seed=3)
    assert b.support_x.shape == (50, 5, 1) and b.query_y.shape == (50, 7, 1)
    assert float(b.support_x.min()) >= -5 and float(b.support_x.max()) <= 5
    assert float(b.query_y.abs().max()) <= 5
    assert all(torch.equal(x, y) for x, y in zip(b, fam.sample(50, seed=3), strict=False))
    assert not torch.equal(b.support_x, fam.sample(50, seed=4).support_x)


def test_sinusoid_federation_slices_and_stable_ids() -> None:
    fts = ml.FederatedTaskSet.sinusoid(4, tasks_per_participant=30, k_support=5, seed=7)
    assert fts.task_counts() == {"0": 30, "1": 30, "2": 30, "3": 30}
    ranges = [s["amplitude_range"] for s in fts.summary()]
    assert ranges[0][0] == pytest.approx(0.1) and ranges[-1][1] == pytest.approx(5.0)
    assert all(a[1] == pytest.approx(b[0]) for a, b in zip(ranges, ranges[1:], strict=False))
    for pid, (_lo, hi) in zip(fts.ids, ranges, strict=False):
        amp = fts.participant(pid).tasks(range(30)).query_y.abs().amax(dim=(1, 2))
        assert float(amp.max()) <= hi + 1e-5
    again = ml.FederatedTaskSet.sinusoid(4, tasks_per_participant=30, k_support=5, seed=7)
    t1, t2 = fts.participant(2).task(17), again.participant("2").task(17)
    assert all(torch.equal(x, y) for x, y in zip(t1, t2, strict=False))
    # fetching in another order gives the same task (ids, not call order)
    assert torch.equal(fts.participant(2).tasks([17, 3]).support_x[0], t1.support_x)
    assert fts.max_tasks_per_example == 1


# ---------------------------------------------------------------- partitions and task lists


def _fake_classes(n_groups: int = 6, per_group: int = 5, per_class: int = 20) -> ml.ClassDataset:
    n = n_groups * per_group
    images = torch.arange(n * per_class, dtype=torch.int64).remainder(256).to(torch.uint8)
    images = images.reshape(-1, 1, 1, 1).expand(-1, 1, 4, 4).contiguous()
    return ml.ClassDataset(
        images,
        np.arange(n + 1) * per_class,
        [str(i) for i in range(n)],
        [f"g{i // per_group}" for i in range(n)],
    )


@pytest.mark.parametrize("mode", ["group", "even"])
def test_partition_disjoint_deterministic(mode: str) -> None:
    ds = _fake_classes()
    parts = ml.partition_classes(ds, 4, mode=mode, seed=3)
    allc = np.concatenate(parts)
    assert sorted(allc.tolist()) == list(range(ds.n_classes))
    assert all(len(p) for p in parts)
    again = ml.partition_classes(ds, 4, mode=mode, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=False))
    if mode == "group":  # whole groups per participant
        owner = {}
        for i, p in enumerate(parts):
            for c in p:
                assert owner.setdefault(ds.groups[c], i) == i
    with pytest.raises(ValueError, match="n_participants"):
        ml.partition_classes(ds, 100, mode=mode)


def test_federated_task_lists_stable_and_reuse_reported() -> None:
    ds = _fake_classes()
    fts = ml.FederatedTaskSet.from_classes(
        ds, 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=50, seed=5
    )
    assert fts.task_counts() == {"0": 50, "1": 50, "2": 50}
    p = fts.participant(1)
    t = p.task(7)
    assert t.support_x.shape == (3, 1, 4, 4) and t.query_y.tolist() == [0, 0, 1, 1, 2, 2]
    own = set(p.plan.reshape(-1) // 20)
    assert own <= set(p.classes.tolist())
    other = set(fts.participant(0).plan.reshape(-1) // 20)
    assert not own & other
    again = ml.FederatedTaskSet.from_classes(
        ds, 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=80, seed=5
    )
    # task ids are stable: asking for more tasks (or a restart) does not change existing ones
    assert np.array_equal(again.participant(1).plan[:50], p.plan)
    assert all(torch.equal(a, b) for a, b in zip(again.participant(1).task(7), t, strict=False))
    counts = p.example_use_counts()
    assert p.max_tasks_per_example == counts.max() > 1
    s = fts.summary()
    assert (
        s[1]["tasks"] == 50
        and s[1]["classes"] == len(p.classes)
        and s[1]["max_tasks_per_example"] >= 2
    )


@pytest.mark.parametrize(("k_shot", "ids"), [(1, [7, 0, 49, 7]), (2, [3]), (1, list(range(50)))])
def test_a_batch_of_tasks_is_its_tasks_stacked_bit_for_bit(k_shot: int, ids: list[int]) -> None:
    """``tasks`` gathers every task's images at once; the batch is ``task``'s, stacked."""
    fts = ml.FederatedTaskSet.from_classes(
        _fake_classes(), 3, n_way=3, k_shot=k_shot, q_query=2, tasks_per_participant=50, seed=5
    )
    p = fts.participant(1)
    batch, one_by_one = p.tasks(ids), ml.stack_tasks([p.task(t) for t in ids])
    for got, want in zip(batch, one_by_one, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    with pytest.raises(IndexError, match="got 50"):
        p.tasks([1, 50])
    with pytest.raises(ValueError, match="at least one"):
        p.tasks([])


def test_the_pixel_table_is_the_hosts_division_bit_for_bit() -> None:
    """What an accelerator gathers (images.UNIT_PIXELS) is what the host divides, every value."""
    from fedmeta.metalearning.images import UNIT_PIXELS, pixels_to_unit

    every = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(pixels_to_unit(every).view(torch.int32), UNIT_PIXELS.view(torch.int32))


@pytest.mark.gpu
def test_a_batch_gathered_on_the_gpu_is_the_hosts_batch() -> None:
    """On CUDA the images are copied once and gathered there: the same values as on the host."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fts = ml.FederatedTaskSet.from_classes(
        _fake_classes(), 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=50, seed=5
    )
    p, cuda = fts.participant(1), torch.device("cuda")
    for got, want in zip(p.tasks([4, 9, 4], cuda), p.tasks([4, 9, 4]), strict=True):
        assert got.is_cuda and torch.equal(got.cpu(), want)


def test_task_lists_drawn_in_worker_processes_match_one_process(monkeypatch) -> None:
    # DP-MAML's 400,000-task universe is numbered in worker processes; the lists must be the very
    # tasks one process draws (a task is a pure function of its seed path), whatever the cores.
    from fedmeta.metalearning import federated

    ds = _fake_classes()
    serial = ml.FederatedTaskSet.from_classes(
        ds, 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=40, seed=5
    )
    monkeypatch.setattr(federated, "PARALLEL_TASKS", 1)
    monkeypatch.setattr(federated.os, "sched_getaffinity", lambda pid: {0, 1})
    drawn = []
    real = federated._draw_lists
    monkeypatch.setattr(
        federated,
        "_draw_lists",
        lambda jobs, parallel: drawn.append(parallel) or real(jobs, parallel=parallel),
    )
    pooled = ml.FederatedTaskSet.from_classes(
        ds, 3, n_way=3, k_shot=1, q_query=2, tasks_per_participant=40, seed=5
    )
    assert drawn == [True]
    for pid in serial.ids:
        assert pooled.participant(pid).plan.dtype == np.int64
        assert np.array_equal(pooled.participant(pid).plan, serial.participant(pid).plan)


def test_disjoint_example_mode() -> None:
    ds = _fake_classes()
    fts = ml.FederatedTaskSet.from_classes(
        ds,
        2,
        n_way=3,
        k_shot=1,
        q_query=3,
        tasks_per_participant=None,
        disjoint_examples=True,
        seed=1,
    )
    assert fts.max_tasks_per_example == 1
    for pid in fts.ids:
        p = fts.participant(pid)
        assert len(np.unique(p.plan)) == p.plan.size
        # capacity: 15 classes x 20 examples / (3 ways x 4 per class) = 25 tasks at most
        assert 20 <= p.num_tasks <= 25
    capped = ml.FederatedTaskSet.from_classes(
        ds, 2, n_way=3, k_shot=1, q_query=3, tasks_per_participant=5, disjoint_examples=True, seed=1
    )
    assert capped.task_counts() == {"0": 5, "1": 5}
