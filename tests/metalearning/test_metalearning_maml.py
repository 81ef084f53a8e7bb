"""Per-task MAML gradients, clipping and evaluation (metalearning.maml)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch.func import functional_call

import fedmeta.metalearning as ml
from fedmeta.metalearning import Task

pytestmark = pytest.mark.unit


def _tiny_conv_tasks(
    n: int, seed: int, dtype=torch.float32, n_way: int = 3, *, binary: bool = False
) -> Task:
    """``n`` tasks of ``n_way`` classes, one support and two query images per class; ``binary``
    thresholds the pixels (Omniglot-like strokes, with exact ties in max-pool windows)."""
    g = torch.Generator().manual_seed(seed)
    sx = torch.rand(n, n_way, 1, 28, 28, generator=g, dtype=dtype)
    qx = torch.rand(n, 2 * n_way, 1, 28, 28, generator=g, dtype=dtype)
    if binary:
        sx, qx = (sx > 0.8).to(dtype), (qx > 0.8).to(dtype)
    sy = torch.arange(n_way).repeat(n, 1)
    qy = torch.arange(n_way).repeat(n, 2)
    return Task(sx, sy, qx, qy)


def _cast(params, dtype):
    return {k: v.to(dtype) for k, v in params.items()}


@pytest.mark.parametrize("first_order", [True, False])
@pytest.mark.parametrize("norm", ["batch", "group"])
def test_vmap_and_loop_agree_conv(first_order: bool, norm: str) -> None:
    model = ml.ConvNet4(3, hidden=8, norm=norm, groups=4).double()
    params = _cast(ml.init_params(model, 1), torch.float64)
    tasks = _tiny_conv_tasks(4, 2, torch.float64)
    kw = dict(inner_steps=2, inner_lr=0.3, first_order=first_order, clip=math.inf, device="cpu")
    gl, nl = ml.per_task_clipped_grads(model, params, tasks, method="loop", **kw)
    gv, nv = ml.per_task_clipped_grads(model, params, tasks, method="vmap", chunk_size=3, **kw)
    torch.testing.assert_close(gv, gl, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(nv, nl, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("first_order", [True, False])
def test_vmap_and_loop_agree_float32(first_order: bool) -> None:
    model = ml.SinusoidMLP()
    params = ml.init_params(model, 0)
    tasks = ml.SinusoidTasks(5, 5).sample(16, seed=3)
    kw = dict(inner_steps=3, inner_lr=0.01, first_order=first_order, clip=1.0, device="cpu")
    gl, nl = ml.per_task_clipped_grads(model, params, tasks, method="loop", **kw)
    gv, nv = ml.per_task_clipped_grads(model, params, tasks, method="vmap", chunk_size=5, **kw)
    torch.testing.assert_close(gv, gl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(nv, nl, rtol=1e-5, atol=1e-6)
    assert gl.shape == (16, ml.param_spec(model).numel)


def _query_loss_after_adaptation(model, flat, spec, task, k, lr):
    """Query loss as a plain function of the meta-parameters (for finite differences)."""
    p = ml.unflatten_params(flat, spec)
    fast = {n: v.detach().requires_grad_(True) for n, v in p.items()}
    for _ in range(k):
        loss = torch.nn.functional.mse_loss(
            functional_call(model, fast, (task.support_x,)), task.support_y
        )
        g = torch.autograd.grad(loss, list(fast.values()))
        fast = {
            n: (v - lr * gi).detach().requires_grad_(True)
            for (n, v), gi in zip(fast.items(), g, strict=False)
        }
    with torch.no_grad():
        return float(
            torch.nn.functional.mse_loss(
                functional_call(model, fast, (task.query_x,)), task.query_y
            )
        )


@pytest.mark.parametrize("method", ["loop", "vmap"])
def test_second_order_matches_finite_differences(method: str) -> None:
    model = ml.SinusoidMLP(hidden=6).double()
    spec = ml.param_spec(model)
    flat = ml.flatten_params(_cast(ml.init_params(model, 5), torch.float64))
    task = ml.SinusoidTasks(6, 6).sample(1, seed=11)
    task = Task(*(t.double() for t in task))
    k, lr = 2, 0.05
    g2, _ = ml.per_task_clipped_grads(
        model, flat, task, inner_steps=k, inner_lr=lr, clip=math.inf, device="cpu", method=method
    )
    g1, _ = ml.per_task_clipped_grads(
        model,
        flat,
        task,
        inner_steps=k,
        inner_lr=lr,
        first_order=True,
        clip=math.inf,
        device="cpu",
        method=method,
    )
    rng = np.random.default_rng(0)
    eps = 1e-6
    one = task.task(0)
    fd_errs, fo_errs = [], []
    for _ in range(6):
        d = torch.from_numpy(rng.standard_normal(spec.numel))
        fd = (
            _query_loss_after_adaptation(model, flat + eps * d, spec, one, k, lr)
            - _query_loss_after_adaptation(model, flat - eps * d, spec, one, k, lr)
        ) / (2 * eps)
        fd_errs.append(abs(float(g2[0] @ d) - fd) / max(1.0, abs(fd)))
        fo_errs.append(abs(float(g1[0] @ d) - fd) / max(1.0, abs(fd)))
    assert max(fd_errs) < 1e-6, fd_errs
    # the oracle is sharp enough to tell first order from second order
    assert max(fo_errs) > 1e-4, fo_errs


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        np.float64,
        st.tuples(st.integers(1, 6), st.integers(1, 20)),
        elements=st.floats(-1e3, 1e3, allow_nan=False, width=64),
    ),
    st.floats(1e-3, 1e3),
)
def test_clip_properties(g: np.ndarray, clip: float) -> None:
    grads = torch.from_numpy(g)
    clipped, norms = ml.clip_by_global_norm(grads, clip)
    torch.testing.assert_close(norms, torch.linalg.vector_norm(grads, dim=1))
    new = torch.linalg.vector_norm(clipped, dim=1)
    assert bool((new <= clip).all())
    small = norms <= clip
    assert torch.equal(clipped[small], grads[small])  # untouched, bit for bit
    big = ~small
    if bool(big.any()):
        torch.testing.assert_close(new[big], torch.full_like(new[big], clip), rtol=1e-5, atol=0)
        # direction kept
        cos = (clipped[big] * grads[big]).sum(1) / (new[big] * norms[big])
        torch.testing.assert_close(cos, torch.ones_like(cos))


def test_clip_zero_and_nonfinite() -> None:
    z = torch.zeros(3, 5)
    c, n = ml.clip_by_global_norm(z, 0.5)
    assert torch.equal(c, z) and torch.equal(n, torch.zeros(3))
    bad = torch.ones(2, 3)
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ml.clip_by_global_norm(bad, 1.0)
    c, n = ml.clip_by_global_norm(bad, 1.0, nonfinite="zero")
    assert torch.equal(c[1], torch.zeros(3)) and math.isinf(float(n[1]))
    assert float(torch.linalg.vector_norm(c[0])) <= 1.0
    with pytest.raises(ValueError, match="clip must be > 0"):
        ml.clip_by_global_norm(z, 0.0)


def _clip_reference(grads: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """clip_by_global_norm(nonfinite="zero") as first written: an entry-wise finiteness pass and
    a select between the row and its scaled copy; the faster version must agree bit for bit."""
    norms = torch.linalg.vector_norm(grads, dim=1)
    finite = torch.isfinite(grads).all(dim=1)
    grads = torch.where(finite[:, None], grads, torch.zeros_like(grads))
    norms = torch.where(finite, norms, torch.full_like(norms, math.inf))
    if math.isinf(clip):
        return grads, norms
    safe = torch.clamp(torch.where(finite, norms, torch.zeros_like(norms)), min=1e-30)
    inside = norms <= clip
    scale = torch.where(inside, torch.ones_like(safe), clip / safe)
    clipped = torch.where(inside[:, None], grads, grads * scale[:, None].to(grads.dtype))
    renorm = torch.linalg.vector_norm(clipped, dim=1)
    over = renorm > clip
    clipped = torch.where(over[:, None], clipped * (clip / renorm)[:, None] * (1 - 1e-6), clipped)
    return clipped, norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clip", [1e-3, 0.5, 3.0, math.inf])
def test_clip_equals_the_entrywise_reference_bit_for_bit(dtype: torch.dtype, clip: float) -> None:
    g = torch.Generator().manual_seed(3)
    grads = (
        torch.randn(12, 301, generator=g, dtype=dtype)
        * torch.tensor([1e-6, 0.01, 0.3, 1.0, 7.0, 1e3] * 2, dtype=dtype)[:, None]
    )
    grads[1, 5] = float("nan")
    grads[2, 0] = float("inf")
    grads[3, -1] = -float("inf")
    grads[4] = 0.0
    grads[5, :3] = -0.0
    if dtype == torch.float64:
        grads[6, :2] = 1e200  # finite entries whose norm overflows: not a non-finite row
    clipped, norms = ml.clip_by_global_norm(grads, clip, nonfinite="zero")
    ref_clipped, ref_norms = _clip_reference(grads, clip)
    assert torch.equal(norms, ref_norms)
    assert torch.equal(clipped, ref_clipped)
    assert torch.equal(torch.signbit(clipped), torch.signbit(ref_clipped))  # -0.0 stays -0.0


def test_per_task_grads_clip_and_leave_model_untouched() -> None:
    model = ml.SinusoidMLP()
    before = ml.flatten_params(model).clone()
    tasks = ml.SinusoidTasks(5, 5).sample(8, seed=1)
    g, n = ml.per_task_clipped_grads(
        model, None, tasks, inner_steps=1, inner_lr=0.01, clip=0.1, device="cpu"
    )
    assert bool((torch.linalg.vector_norm(g, dim=1) <= 0.1).all())
    assert bool((n > 0.1).all())
    assert all(p.grad is None for p in model.parameters())  # nothing meets in .grad
    assert torch.equal(ml.flatten_params(model), before)
    g2, n2 = ml.per_task_clipped_grads(
        model, None, tasks, inner_steps=1, inner_lr=0.01, clip=0.1, device="cpu"
    )
    assert torch.equal(g, g2) and torch.equal(n, n2)  # deterministic
    g3, n3 = ml.per_task_clipped_grads(
        model, None, tasks, inner_steps=1, inner_lr=0.01, clip=0.1, device="cpu", chunk_size=3
    )
    torch.testing.assert_close(g3, g, rtol=1e-5, atol=1e-7)  # chunking changes rounding only


def test_task_sequence_input_and_flat_params() -> None:
    model = ml.ConvNet4(3, hidden=8)
    flat = ml.flatten_params(ml.init_params(model, 0))
    batch = _tiny_conv_tasks(3, 0)
    seq = [batch.task(i) for i in range(3)]
    a, _ = ml.per_task_clipped_grads(model, flat, batch, clip=1.0, device="cpu", method="loop")
    b, _ = ml.per_task_clipped_grads(model, flat, seq, clip=1.0, device="cpu", method="loop")
    assert torch.equal(a, b)


def test_models_use_no_global_rng() -> None:
    state = torch.random.get_rng_state()
    a, b = ml.ConvNet4(5, seed=3), ml.ConvNet4(5, seed=3)
    ml.SinusoidMLP()
    ml.init_params(a, 0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(ml.flatten_params(a), ml.flatten_params(b))


def test_resolve_method_is_by_measurement() -> None:
    cpu = torch.device("cpu")
    assert ml.resolve_method(ml.ConvNet4(5), cpu) == "loop"
    assert ml.resolve_method(ml.SinusoidMLP(), cpu) == "vmap"
    assert ml.resolve_method(ml.ConvNet4(5), torch.device("cuda"), n_tasks=8) == "vmap"
    assert ml.resolve_method(ml.ConvNet4(5), torch.device("cuda"), n_tasks=1) == "loop"
    assert ml.resolve_device("cpu") == cpu


def test_evaluate_reports_mean_and_ci() -> None:
    model = ml.SinusoidMLP()
    tasks = ml.SinusoidTasks(10, 10).sample(40, seed=2)
    r = ml.evaluate(
        model,
        ml.init_params(model, 0),
        tasks,
        inner_steps=2,
        inner_lr=0.01,
        device="cpu",
        with_pre_adaptation=True,
    )
    mean, ci = r
    assert r.metric == "mse" and r.n_tasks == 40 and ci > 0 and mean > 0
    r_loop = ml.evaluate(
        model,
        ml.init_params(model, 0),
        tasks,
        inner_steps=2,
        inner_lr=0.01,
        device="cpu",
        method="loop",
    )
    assert r_loop.mean == pytest.approx(mean, rel=1e-5)


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_task_scores_are_per_task_and_behind_evaluate(method: str) -> None:
    model = ml.ConvNet4(3, hidden=8)
    params = ml.init_params(model, 1)
    tasks = _tiny_conv_tasks(4, seed=5, dtype=torch.float64, binary=True)
    model = model.double()
    params = {k: v.double() for k, v in params.items()}
    kw = {"inner_steps": 3, "inner_lr": 0.4, "device": "cpu", "method": method}
    s = ml.task_scores(model, params, tasks, **kw)
    assert s.shape == (4,) and s.dtype == torch.float64
    # a task's score depends on that task alone, and accuracies are counts of 6 queries
    alone = torch.cat([ml.task_scores(model, params, [tasks.task(i)], **kw) for i in (2, 0)])
    assert torch.equal(alone, s[[2, 0]])
    assert float((s * 6 - (s * 6).round()).abs().max()) < 1e-6
    r = ml.evaluate(model, params, tasks, **kw, with_pre_adaptation=True)
    assert r.mean == pytest.approx(float(s.mean()), abs=1e-12) and r.n_tasks == 4
    pre = ml.task_scores(model, params, tasks, **{**kw, "inner_steps": 0})
    assert r.pre_adaptation_mean == pytest.approx(float(pre.mean()), abs=1e-12)
    with pytest.raises(ValueError, match="at least one task"):
        ml.task_scores(model, params, [], **kw)


@pytest.mark.gpu
def test_gpu_vmap_matches_cpu_loop() -> None:
    # float64: CUDA vmap, CUDA loop and the CPU loop agree to ~1e-14 (measured on an H100). In
    # float32 the
    # per-task batch statistics of the last block (1x1 spatial, 5 images) amplify rounding, and CPU
    # vs GPU differ by ~20% on random-noise tasks; so the exact comparison is in float64.
    model = ml.ConvNet4(5).double()
    params = _cast(ml.init_params(model, 0), torch.float64)
    tasks = _tiny_conv_tasks(6, 3, torch.float64, n_way=5)
    kw = dict(inner_steps=2, inner_lr=0.4, first_order=False, clip=math.inf)
    gc, _ = ml.per_task_clipped_grads(model, params, tasks, device="cpu", method="loop", **kw)
    gg, _ = ml.per_task_clipped_grads(model, params, tasks, device="cuda", **kw)
    torch.testing.assert_close(gg.cpu(), gc, rtol=1e-9, atol=1e-11)
    g1, _ = ml.per_task_clipped_grads(model, params, tasks, device="cuda", chunk_size=4, **kw)
    torch.testing.assert_close(g1, gg, rtol=1e-9, atol=1e-11)
    model32 = ml.ConvNet4(5)
    p32 = ml.init_params(model32, 0)
    t32 = _tiny_conv_tasks(6, 3, n_way=5)
    a, na = ml.per_task_clipped_grads(model32, p32, t32, device="cuda", clip=1.0, inner_steps=2)
    b, nb = ml.per_task_clipped_grads(model32, p32, t32, device="cuda", clip=1.0, inner_steps=2)
    assert torch.equal(a, b) and torch.equal(na, nb)  # deterministic on CUDA
    assert bool((torch.linalg.vector_norm(a, dim=1) <= 1.0).all())


@pytest.mark.gpu
def test_gpu_evaluate_matches_cpu() -> None:
    model = ml.ConvNet4(5)
    params = ml.init_params(model, 0)
    tasks = _tiny_conv_tasks(10, 4, n_way=5)
    a = ml.evaluate(model, params, tasks, inner_steps=2, inner_lr=0.4, device="cpu")
    b = ml.evaluate(model, params, tasks, inner_steps=2, inner_lr=0.4, device="cuda")
    assert abs(a.mean - b.mean) <= 0.05
