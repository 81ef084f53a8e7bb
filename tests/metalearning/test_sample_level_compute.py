"""Sample level (issue 53): the per-task computation of DP-MAML's Algorithm 2 (sample_level).

Oracles: a plain per-example autograd loop; the clip bound on every row (with a negative control
that skips the clip); a chi-square and a KS test of the inner noise; the query-side sensitivity
``a_q C_out`` with the adapted parameters fixed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch.func import functional_call

import fedmeta.metalearning as ml
from fedmeta.metalearning.example_slots import (
    MaskedTasks,
    SlotRule,
    build_round_slots,
    masked_tasks,
)
from fedmeta.metalearning.execution import loss_function
from fedmeta.metalearning.sample_level import (
    SampleLevelSteps,
    noisy_adapt,
    per_example_clipped_grads,
    per_example_grads,
    query_gradient_sums,
    sample_level_grads,
)

pytestmark = pytest.mark.unit

#: Probability that a statistical check here fails for a correct mechanism and a random seed.
FALSE_ALARM = 1e-3
#: Relative float slack on a clipped norm recomputed here (clip_by_global_norm keeps <= C itself;
#: the test's own norm may round differently by a few units in the last place).
NORM_SLACK = 1e-6


def _sinusoid(n_tasks: int, size: int, seed: int, scale: float = 1.0) -> MaskedTasks:
    g = torch.Generator().manual_seed(seed)

    def part() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.rand(n_tasks, size, 1, generator=g, dtype=torch.float64) * 10 - 5
        y = torch.randn(n_tasks, size, 1, generator=g, dtype=torch.float64) * scale
        return x, y, torch.rand(n_tasks, size, generator=g) > 0.25

    return MaskedTasks(*part(), *part())


def _images(n_tasks: int, size: int, seed: int, n_way: int = 3) -> MaskedTasks:
    g = torch.Generator().manual_seed(seed)

    def part() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.rand(n_tasks, size, 1, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, n_way, (n_tasks, size), generator=g)
        return x, y, torch.rand(n_tasks, size, generator=g) > 0.25

    return MaskedTasks(*part(), *part())


def _model(kind: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], MaskedTasks]:
    if kind == "mlp":
        model: torch.nn.Module = ml.SinusoidMLP().double()
        return model, ml.init_params(model, 0), _sinusoid(3, 4, 1)
    model = ml.ConvNet4(3, hidden=8, norm="group", groups=4, image_size=8).double()
    return model, ml.init_params(model, 0), _images(3, 4, 1)


def _loop_grad(model: torch.nn.Module, p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One example's flat gradient by plain autograd (the oracle)."""
    leaves = {n: v.detach().clone().requires_grad_(True) for n, v in p.items()}
    loss = loss_function(model)(functional_call(model, leaves, (x[None],)), y[None])
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True,
                                materialize_grads=True)  # fmt: skip
    return torch.cat([g.reshape(-1) for g in grads])


def _clip(g: torch.Tensor, c: float) -> torch.Tensor:
    # maml's clip (tested there), which also guards the float rounding of ``norm * (C / norm)``
    # by a factor 1 - 1e-6: the oracle here is the batching, the masks, the noise and the order.
    return ml.clip_by_global_norm(g[None], c)[0][0]


def _reference(model, params, tasks: MaskedTasks, steps: SampleLevelSteps, seed: int):
    """Algorithm 2, first order, task by task and example by example (no vmap, no batching)."""
    dim = sum(v.numel() for v in params.values())
    noise = np.random.default_rng(seed).standard_normal((tasks.num_tasks, steps.inner_steps, dim))
    sigma = steps.inner_noise_multiplier * steps.inner_clip
    sums = []
    for t in range(tasks.num_tasks):
        theta = ml.flatten_params(params).clone()
        spec = ml.param_spec(model)
        for k in range(steps.inner_steps):
            p = ml.unflatten_params(theta, spec)
            total = torch.zeros(dim, dtype=theta.dtype)
            for i in torch.nonzero(tasks.support_mask[t]).flatten().tolist():
                g = _loop_grad(model, p, tasks.support_x[t, i], tasks.support_y[t, i])
                total += _clip(g, steps.inner_clip)
            total += sigma * torch.from_numpy(noise[t, k]).to(theta.dtype)
            theta = theta - steps.inner_lr * total / steps.support_size
        p = ml.unflatten_params(theta, spec)
        q = [
            _clip(_loop_grad(model, p, tasks.query_x[t, i], tasks.query_y[t, i]), steps.outer_clip)
            for i in torch.nonzero(tasks.query_mask[t]).flatten().tolist()
        ]
        sums.append(torch.stack(q).sum(0) if q else torch.zeros(dim, dtype=theta.dtype))
    return torch.stack(sums)


STEPS = SampleLevelSteps(inner_steps=2, inner_lr=0.05, inner_clip=0.5,
                         inner_noise_multiplier=1.3, support_size=4, outer_clip=0.7)  # fmt: skip


@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("atol", [1e-10])
def test_per_example_grads_equal_a_plain_loop(kind: str, atol: float) -> None:
    model, params, tasks = _model(kind)
    theta = {n: v.unsqueeze(0).expand(tasks.num_tasks, *v.shape) for n, v in params.items()}
    got = per_example_grads(model)(theta, tasks.support_x, tasks.support_y)
    for t in range(tasks.num_tasks):
        for i in range(tasks.support_x.shape[1]):
            want = _loop_grad(model, params, tasks.support_x[t, i], tasks.support_y[t, i])
            torch.testing.assert_close(got[t, i], want, rtol=0, atol=atol)


#: Clips that never bind (the pre-clip norms here stay below 1e3): rows are returned bit for bit.
LOOSE = SampleLevelSteps(inner_steps=2, inner_lr=0.05, inner_clip=1e3,
                         inner_noise_multiplier=1e-3, support_size=4, outer_clip=1e3)  # fmt: skip


# Where the clips bind, clip_by_global_norm guards the rounding of ``norm * (C / norm)`` by scaling
# a row that lands above C by 1 - 1e-6; a batched and a single norm can round an ulp apart, so the
# two computations may guard different rows: agreement to about C 1e-6 per row, not to rounding.
@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize(
    ("steps", "atol"), [(LOOSE, 1e-10), (STEPS, 5e-6)], ids=["loose", "binding"]
)
def test_the_round_equals_algorithm_2_computed_example_by_example(
    kind: str, steps: SampleLevelSteps, atol: float
) -> None:
    model, params, tasks = _model(kind)
    got = sample_level_grads(
        model, params, tasks, steps, np.random.default_rng(5), device="cpu", chunk_size=2
    )  # fmt: skip  (chunked: the noise must not depend on it)
    want = _reference(model, params, tasks, steps, 5)
    torch.testing.assert_close(got.query_sums, want, rtol=0, atol=atol)
    assert got.support_norms.shape == (steps.inner_steps, *tasks.support_mask.shape)
    assert not got.query_norms[~tasks.query_mask].any()
    if steps is LOOSE:  # the premise of the tight tolerance
        assert float(got.query_norms.max()) < 1e3 and float(got.support_norms.max()) < 1e3


def assert_rows_clipped(rows: torch.Tensor, clip: float, slack: float) -> None:
    """Every row's L2 norm is at most ``clip * (1 + slack)``."""
    norms = torch.linalg.vector_norm(rows.reshape(-1, rows.shape[-1]), dim=1)
    worst = float(norms.max())
    assert worst <= clip * (1 + slack), f"a per-example norm {worst} exceeds the clip {clip}"


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_every_per_example_gradient_is_clipped_and_skipping_the_clip_is_caught(kind: str) -> None:
    model, params, tasks = _model(kind)
    if kind == "mlp":
        tasks = _sinusoid(3, 6, 2, scale=100.0)  # targets far off: large gradients
    theta = {n: v.unsqueeze(0).expand(tasks.num_tasks, *v.shape) for n, v in params.items()}
    grads_of = per_example_grads(model)
    args = (grads_of, theta, tasks.support_x, tasks.support_y, tasks.support_mask)
    clipped, norms = per_example_clipped_grads(*args, 0.05)
    assert float(norms.max()) > 0.05  # the clip binds: the control below has something to catch
    assert_rows_clipped(clipped, 0.05, NORM_SLACK)
    unclipped, _ = per_example_clipped_grads(*args, math.inf)  # the path with the clip skipped
    with pytest.raises(AssertionError, match="exceeds the clip"):
        assert_rows_clipped(unclipped, 0.05, NORM_SLACK)


def _adapted_difference(steps: SampleLevelSteps, seeds: tuple[int, int]) -> np.ndarray:
    """One inner step twice from the same data with independent noise: ``lr (n1 - n2) / n``."""
    model, params, _ = _model("mlp")
    tasks = _sinusoid(8, 5, 3, scale=10.0)
    grads_of = per_example_grads(model)
    runs = [noisy_adapt(grads_of, params, tasks, steps, np.random.default_rng(s))[0] for s in seeds]
    return torch.cat([(runs[0][n] - runs[1][n]).reshape(-1) for n in params]).numpy()


def _noise_std_p_values(diff: np.ndarray, claimed_std: float) -> tuple[float, float]:
    """Two-sided chi-square p-value of the variance, and the KS p-value against N(0, claimed)."""
    z = diff / claimed_std
    chi2 = float((z * z).sum())
    tail = stats.chi2.sf(chi2, z.size)
    return float(2 * min(tail, 1 - tail)), float(stats.kstest(z, "norm").pvalue)


def test_inner_noise_has_std_z_in_c_in_over_n_and_a_halved_noise_is_caught() -> None:
    steps = SampleLevelSteps(inner_steps=1, inner_lr=0.1, inner_clip=0.8,
                             inner_noise_multiplier=1.5, support_size=5,
                             outer_clip=1.0)  # fmt: skip
    # Per coordinate the step's noise is lr * z_in C_in / n * N(0, 1); two runs differ by sqrt(2).
    claimed = steps.inner_lr * steps.inner_noise_multiplier * steps.inner_clip / steps.support_size
    diff = _adapted_difference(steps, (1, 2))
    assert diff.size > 10_000
    chi2_p, ks_p = _noise_std_p_values(diff, claimed * math.sqrt(2))
    assert chi2_p > FALSE_ALARM and ks_p > FALSE_ALARM, (chi2_p, ks_p)
    halved = dataclasses.replace(steps, inner_noise_multiplier=steps.inner_noise_multiplier / 2)
    chi2_p, ks_p = _noise_std_p_values(_adapted_difference(halved, (1, 2)), claimed * math.sqrt(2))
    assert chi2_p < 1e-12 and ks_p < 1e-12, (chi2_p, ks_p)  # caught with a wide margin


def _with_query_example(base: MaskedTasks, x: torch.Tensor, y: torch.Tensor, tasks: int):
    """``base`` with one more query column, holding ``(x, y)`` in the first ``tasks`` tasks."""
    n = base.num_tasks
    column = [torch.zeros(n, 1, *t.shape[2:], dtype=t.dtype) for t in base[3:]]
    qx, qy, qm = (torch.cat([t, c], 1) for t, c in zip(base[3:], column, strict=True))
    qx[:tasks, -1], qy[:tasks, -1], qm[:tasks, -1] = x, y, True
    return base._replace(query_x=qx, query_y=qy, query_mask=qm)


@pytest.mark.parametrize("appearances", [1, 3])
def test_one_query_example_moves_the_released_sum_by_at_most_a_q_c_out(appearances: int) -> None:
    """Post-processing: the adapted parameters fixed (same support sets, same noise), a worst-case
    query example in ``a_q`` tasks moves the sum over tasks by at most ``a_q C_out``; with its clip
    skipped (the control) it moves it by far more."""
    model, params, base = _model("mlp")
    hostile = (torch.tensor([4.9], dtype=torch.float64), torch.tensor([1e4], dtype=torch.float64))
    with_x = _with_query_example(base, *hostile, appearances)
    grads_of = per_example_grads(model)
    pair = (base, with_x)
    adapted = [noisy_adapt(grads_of, params, t, STEPS, np.random.default_rng(9))[0] for t in pair]
    for n in params:
        assert torch.equal(adapted[0][n], adapted[1][n])  # only the query sets differ

    def change(clip: float) -> torch.Tensor:  # [T, dim]: with x minus without, per task
        after = query_gradient_sums(grads_of, adapted[1], with_x, clip)[0]
        return after - query_gradient_sums(grads_of, adapted[0], base, clip)[0]

    bound = appearances * STEPS.outer_clip
    for clip, bounded in ((STEPS.outer_clip, True), (math.inf, False)):
        moved = float(torch.linalg.vector_norm(change(clip).sum(0)))
        assert (moved <= bound * (1 + NORM_SLACK)) is bounded, (moved, bound)
    # Each task holding x moves by exactly x's clipped gradient (norm C_out), the others not at all.
    per_task = torch.linalg.vector_norm(change(STEPS.outer_clip), dim=1)
    want = torch.zeros_like(per_task)
    want[:appearances] = STEPS.outer_clip
    torch.testing.assert_close(per_task, want, rtol=1e-5, atol=1e-12)


def test_second_order_is_refused_with_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"^order must be 'first' at sample level .*got 'second'$"):
        dataclasses.replace(STEPS, order="second")


@pytest.mark.parametrize(
    ("field", "value"),
    [("inner_steps", 0), ("inner_steps", 1.0), ("support_size", True), ("inner_lr", 0.0),
     ("inner_clip", math.inf), ("inner_noise_multiplier", -1.0), ("outer_clip", math.nan)],
)  # fmt: skip
def test_bad_constants_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        dataclasses.replace(STEPS, **{field: value})


def test_models_without_per_example_gradients_are_refused() -> None:
    batch_norm = ml.ConvNet4(3, hidden=8, norm="batch", groups=4, image_size=8)
    tasks = _images(1, 2, 0)
    with pytest.raises(ValueError, match="^model norm must be .group. or .none. at sample level"):
        sample_level_grads(batch_norm, None, tasks, STEPS, np.random.default_rng(0), device="cpu")
    layered = torch.nn.Sequential(
        torch.nn.Linear(1, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )
    with pytest.raises(ValueError, match="^model norm must be"):
        sample_level_grads(layered, None, _sinusoid(1, 2, 0), STEPS, np.random.default_rng(0),
                           device="cpu")  # fmt: skip
    meta_sgd = ml.with_learned_inner_rates(ml.SinusoidMLP(), 0.01)
    with pytest.raises(ValueError, match="learned inner rates"):
        sample_level_grads(meta_sgd, None, _sinusoid(1, 2, 0), STEPS, np.random.default_rng(0),
                           device="cpu")  # fmt: skip


def test_a_round_from_sampled_examples_runs_and_an_empty_task_only_takes_noise() -> None:
    """The builder's slots, padded, through the computation: a task with no examples returns a
    zero sum (its inner steps took noise only), and sums stay within (query count) x C_out."""
    ids, labels = np.arange(60), np.arange(60) % 6
    rule = SlotRule(n_way=3, passes=2, example_rate=0.3, support_share=0.5)
    slots = build_round_slots(ids, labels, 6, rule, np.random.default_rng(4))
    images = torch.rand(60, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    tasks = masked_tasks(slots, lambda pos: images[torch.as_tensor(pos)])
    empty = MaskedTasks(*(t[:1] for t in tasks))._replace(
        support_mask=torch.zeros_like(tasks.support_mask[:1]),
        query_mask=torch.zeros_like(tasks.query_mask[:1]),
    )
    model = ml.ConvNet4(3, hidden=8, norm="group", groups=4, image_size=8)
    both = MaskedTasks(*(torch.cat([a, b]) for a, b in zip(tasks, empty, strict=True)))
    out = sample_level_grads(model, ml.init_params(model, 1), both, STEPS,
                             np.random.default_rng(0), device="cpu")  # fmt: skip
    sums, counts = out.query_sums, both.query_mask.sum(1)
    assert sums.shape == (len(slots.tasks) + 1, ml.param_spec(model).numel)
    assert not sums[-1].any()
    norms = torch.linalg.vector_norm(sums, dim=1)
    assert bool((norms <= counts * STEPS.outer_clip * (1 + NORM_SLACK)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("atol", [1e-9])
def test_cuda_computes_what_the_cpu_computes(atol: float) -> None:
    model, params, tasks = _model("conv")
    args = (model, params, tasks, LOOSE)
    cpu = sample_level_grads(*args, np.random.default_rng(3), device="cpu")
    gpu = sample_level_grads(*args, np.random.default_rng(3), device="cuda")
    assert gpu.query_sums.device.type == "cuda"
    torch.testing.assert_close(gpu.query_sums.cpu(), cpu.query_sums, rtol=0, atol=atol)
    torch.testing.assert_close(gpu.support_norms.cpu(), cpu.support_norms, rtol=0, atol=atol)
