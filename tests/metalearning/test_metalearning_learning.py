"""Non-private MAML learns (short CPU runs; numbers are recorded in docs/workload.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fedmeta.metalearning as ml

pytestmark = pytest.mark.integration


def _sinusoid_run(steps: int) -> ml.EvalResult:
    torch.set_num_threads(1)
    model = ml.SinusoidMLP()
    fam = ml.SinusoidTasks(10, 10)
    params = ml.meta_train(
        model,
        ml.init_params(model, 0),
        lambda s: fam.sample(25, seed=s),
        steps=steps,
        meta_lr=5e-3,
        inner_steps=1,
        inner_lr=0.01,
        device="cpu",
    )
    r = ml.evaluate(
        model,
        params,
        fam.sample(200, seed=999),
        inner_steps=10,
        inner_lr=0.01,
        device="cpu",
        with_pre_adaptation=True,
    )
    print(
        f"sinusoid {steps} steps: pre-adaptation MSE {r.pre_adaptation_mean:.3f}, "
        f"post-adaptation MSE {r.mean:.3f} +- {r.ci95:.3f}"
    )
    return r


def _omniglot_run(root: Path, cache: Path, steps: int, n_test: int) -> ml.EvalResult:
    torch.set_num_threads(1)
    splits = ml.load_omniglot(root, cache=cache)
    batch = 8
    fts = ml.FederatedTaskSet.from_classes(
        splits.train,
        4,
        n_way=5,
        k_shot=1,
        q_query=1,
        tasks_per_participant=steps * batch // 4 + batch,
        seed=0,
    )

    def next_batch(step: int) -> ml.Task:
        pid, i = step % 4, (step // 4) * batch
        return fts.participant(pid).tasks(range(i, i + batch))

    model = ml.ConvNet4(5)
    params = ml.meta_train(
        model,
        ml.init_params(model, 0),
        next_batch,
        steps=steps,
        meta_lr=3e-3,
        inner_steps=1,
        inner_lr=0.4,
        device="cpu",
    )
    test = ml.sample_tasks(splits.test, n_way=5, k_shot=1, q_query=5, n_tasks=n_test, seed=1)
    r = ml.evaluate(model, params, test, inner_steps=3, inner_lr=0.4, device="cpu")
    print(f"omniglot 5-way 1-shot, {steps} steps: held-out accuracy {r.mean:.3f} +- {r.ci95:.3f}")
    return r


def test_sinusoid_maml_learns() -> None:
    r = _sinusoid_run(1000)
    # reached 0.41 +- 0.08 vs 3.29 pre-adaptation (800 steps); 0.19 at 2000 steps
    assert r.pre_adaptation_mean is not None
    assert r.mean < 0.3 * r.pre_adaptation_mean
    assert r.mean < 1.0


def test_omniglot_5way_1shot_learns_far_above_chance(shared_omniglot: Path, tmp_path: Path) -> None:
    r = _omniglot_run(shared_omniglot, tmp_path, steps=80, n_test=100)
    # reached 0.62 +- 0.03 at 80 steps, 0.74 at 120, 0.79 at 150 (seed 0); chance is 0.20
    assert r.mean > 0.45


@pytest.mark.slow
def test_omniglot_longer_run(shared_omniglot: Path, tmp_path: Path) -> None:
    r = _omniglot_run(shared_omniglot, tmp_path, steps=400, n_test=600)
    assert r.mean > 0.8


@pytest.mark.slow
def test_sinusoid_longer_run() -> None:
    r = _sinusoid_run(4000)
    assert r.mean < 0.2
