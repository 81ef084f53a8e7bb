"""ConvNet4's CPU fast path (``fused_forward``) computes the module's function and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_metalearning_maml import _tiny_conv_tasks
from torch.func import functional_call

import fedmeta.metalearning as ml
from fedmeta.metalearning import Task
from fedmeta.metalearning.models import _BatchNormNHWC, to_channels_last

# Unit tests unless marked otherwise (tests/conftest.py).


def _binary_images(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    # Binary strokes on a blank page, as in Omniglot: blank 3x3 patches give bit-identical conv
    # outputs, so max-pool windows are full of exact ties - the case the ReLU/pool swap must keep.
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 1, 28, 28, generator=g) > 0.8).to(dtype)


@pytest.mark.parametrize("norm", ["batch", "group", "none"])
@pytest.mark.parametrize("once", [True, False])
def test_fused_forward_matches_module_forward_with_ties(norm: str, once: bool) -> None:
    model = ml.ConvNet4(5, hidden=16, norm=norm, groups=4).double()
    params = {k: v.double().requires_grad_(True) for k, v in ml.init_params(model, 3).items()}
    x = _binary_images(20, 1)
    y = torch.arange(5).repeat(4)
    ref = functional_call(model, params, (x,))
    out = model.fused_forward(params, x, once_differentiable=once)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if norm == "group":  # same NCHW kernels, only the ReLU moved: bit for bit
        assert torch.equal(out, ref)
    # norm="none" leaves the norm parameters unused: both sides must agree on that too.
    g_ref = torch.autograd.grad(F.cross_entropy(ref, y), list(params.values()), allow_unused=True)
    g_out = torch.autograd.grad(F.cross_entropy(out, y), list(params.values()), allow_unused=True)
    for name, a, b in zip(params, g_out, g_ref, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
            if norm == "group":
                assert torch.equal(a, b), name


def test_batchnorm_nhwc_matches_f_batch_norm() -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5, 7, 7, generator=g, dtype=torch.float64) * 3 + 10).requires_grad_(True)
    w = (torch.rand(5, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)
    b = torch.randn(5, generator=g, dtype=torch.float64).requires_grad_(True)
    dy = torch.randn(6, 5, 7, 7, generator=g, dtype=torch.float64)
    ref = F.batch_norm(x, None, None, w, b, training=True)
    out = _BatchNormNHWC.apply(to_channels_last(x), w, b)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(
        torch.autograd.grad(out, (x, w, b), dy),
        torch.autograd.grad(ref, (x, w, b), dy),
        strict=True,
    ):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda t, ww, bb: _BatchNormNHWC.apply(to_channels_last(t), ww, bb),
        (x[:2, :, :3, :3].detach().clone().requires_grad_(True), w, b),
    )


def test_batchnorm_nhwc_refuses_a_second_derivative() -> None:
    # The loop path only uses it where the graph is differentiated once; a second derivative
    # through it must fail loudly rather than be silently wrong.
    x = torch.randn(4, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    out = _BatchNormNHWC.apply(to_channels_last(x), w, torch.zeros(3, dtype=torch.float64))
    (gx,) = torch.autograd.grad((out**3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gx.sum(), w)


def test_to_channels_last_single_channel() -> None:
    x = torch.rand(3, 1, 6, 6)
    cl = to_channels_last(x)
    assert cl.stride() == (36, 1, 6, 1) and torch.equal(cl, x)
    out = F.conv2d(cl, torch.randn(4, 1, 3, 3), padding=1)
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_batchnorm_nhwc_float32_as_accurate_as_the_nchw_kernel() -> None:
    """Guard against naive float32 sums: PyTorch's own channels-last batch norm had 20x the error of
    its NCHW kernel on a first-layer-sized map, which the network amplified into 1e-3 to 0.6
    relative error in task gradients (docs/benchmarks.md)."""
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(75, 64, 28, 28, generator=g, dtype=torch.float64) * 0.3 + 1.0
    dy64 = torch.randn(75, 64, 28, 28, generator=g, dtype=torch.float64)
    w64 = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
    b64 = torch.randn(64, generator=g, dtype=torch.float64)

    def run(fn, x, dy, w, b):
        x, w, b = (t.detach().requires_grad_(True) for t in (x, w, b))
        y = fn(x, w, b)
        return [y.detach(), *torch.autograd.grad(y, (x, w, b), dy)]

    def native(x, w, b):
        return F.batch_norm(x, None, None, w, b, training=True)

    ref = run(native, x64, dy64, w64, b64)
    f32 = (w64.float(), b64.float())
    nchw = run(native, x64.float(), dy64.float(), *f32)
    ours = run(
        _BatchNormNHWC.apply, to_channels_last(x64.float()), to_channels_last(dy64.float()), *f32
    )
    for name, a, b, r in zip(("y", "dx", "dw", "db"), ours, nchw, ref, strict=True):
        err_ours = float((a.double() - r).abs().max() / r.abs().max())
        err_nchw = float((b.double() - r).abs().max() / r.abs().max())
        assert err_ours <= 3 * err_nchw + 1e-7, (name, err_ours, err_nchw)


def test_loop_path_uses_the_fused_forward_on_cpu_only() -> None:
    from fedmeta.metalearning.execution import loop_forward

    model = ml.ConvNet4(3, hidden=8)
    params = ml.init_params(model, 0)
    x = torch.rand(4, 1, 28, 28)
    cpu = loop_forward(model, torch.device("cpu"))
    meta = loop_forward(model, torch.device("meta"))
    torch.testing.assert_close(cpu(params, x, True), functional_call(model, params, (x,)))
    assert cpu.__name__ == "fast" and meta.__name__ == "plain"
    assert loop_forward(ml.SinusoidMLP(), torch.device("cpu")).__name__ == "plain"
    assert math.isfinite(float(cpu(params, x, False).sum()))


def _threads(n: int):
    import contextlib

    @contextlib.contextmanager
    def ctx():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return ctx()


def test_tasks_side_by_side_give_the_one_thread_gradients_and_restore_threads() -> None:
    model = ml.ConvNet4(3, hidden=8)
    params = ml.init_params(model, 0)
    tasks = _tiny_conv_tasks(5, 4, binary=True)
    kw = dict(inner_steps=2, first_order=False, device="cpu", method="loop", chunk_size=2)
    with _threads(1):
        one = ml.per_task_grads(model, params, tasks, **kw)
    with _threads(2):
        two = ml.per_task_grads(model, params, tasks, **kw)
        assert torch.get_num_threads() == 2
    # every task of a multi-task call runs on one intra-op thread, whatever torch's setting
    assert torch.equal(one, two)


def test_worker_errors_propagate_and_threads_are_restored() -> None:
    model = ml.ConvNet4(3, hidden=8)
    params = ml.init_params(model, 0)
    bad = Task(
        torch.rand(3, 3, 1, 28, 28),
        torch.full((3, 3), 7),  # label 7 with 3 classes
        torch.rand(3, 3, 1, 28, 28),
        torch.arange(3).repeat(3, 1),
    )
    with _threads(2):
        with pytest.raises((IndexError, RuntimeError)):
            ml.per_task_grads(model, params, bad, device="cpu", method="loop")
        assert torch.get_num_threads() == 2


@pytest.mark.integration
def test_only_pure_forwards_run_side_by_side() -> None:
    """``functional_call`` swaps parameters into the shared module, so a model without a
    ``fused_forward`` must never run two tasks at once (it did, and raced, during development)."""
    from fedmeta.metalearning.execution import task_threads

    cpu = torch.device("cpu")
    with _threads(2):
        assert task_threads(ml.SinusoidMLP(), cpu, 8) == 1
        assert task_threads(ml.ConvNet4(3), cpu, 8) == 2
        assert task_threads(ml.ConvNet4(3), cpu, 1) == 1
        model = ml.SinusoidMLP()
        params = ml.init_params(model, 0)
        tasks = ml.SinusoidTasks(5, 5).sample(16, seed=3)
        kw = dict(inner_steps=2, device="cpu", method="loop")
        first = ml.per_task_grads(model, params, tasks, **kw)
        for _ in range(10):
            assert torch.equal(ml.per_task_grads(model, params, tasks, **kw), first)


@pytest.mark.parametrize("first_order", [True, False])
def test_norm_none_loop_matches_vmap(first_order: bool) -> None:
    # norm="none" leaves the norm scales out of the graph: the loop must report zeros for them,
    # as the vmap path does, not fail.
    model = ml.ConvNet4(3, hidden=8, norm="none").double()
    params = {k: v.double() for k, v in ml.init_params(model, 2).items()}
    tasks = _tiny_conv_tasks(3, 5, torch.float64)
    kw = dict(inner_steps=2, first_order=first_order, device="cpu")
    loop = ml.per_task_grads(model, params, tasks, method="loop", **kw)
    vmap = ml.per_task_grads(model, params, tasks, method="vmap", **kw)
    torch.testing.assert_close(loop, vmap, rtol=1e-10, atol=1e-12)
    res = ml.evaluate(model, params, tasks, inner_steps=2, device="cpu", method="loop")
    assert 0.0 <= res.mean <= 1.0


def test_fused_forward_not_used_when_calling_the_module_would_differ() -> None:
    from fedmeta.metalearning.execution import faithful_fused_forward

    class Scaled(ml.ConvNet4):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    plain = ml.ConvNet4(3, hidden=8)
    assert faithful_fused_forward(plain) is not None
    assert faithful_fused_forward(Scaled(3, hidden=8)) is None
    hooked = ml.ConvNet4(3, hidden=8)
    handle = hooked.blocks[1].register_forward_hook(lambda m, i, o: o * 0)
    assert faithful_fused_forward(hooked) is None
    handle.remove()
    assert faithful_fused_forward(hooked) is not None
    # and the gradients then follow the subclass's forward
    sub = Scaled(3, hidden=8).double()
    params = {k: v.double() for k, v in ml.init_params(sub, 0).items()}
    tasks = _tiny_conv_tasks(2, 6, torch.float64)
    kw = dict(inner_steps=1, device="cpu")
    torch.testing.assert_close(
        ml.per_task_grads(sub, params, tasks, method="loop", **kw),
        ml.per_task_grads(sub, params, tasks, method="vmap", **kw),
        rtol=1e-10,
        atol=1e-12,
    )


def test_workers_run_on_one_thread_and_leave_torch_as_it_was() -> None:
    import threading

    from fedmeta.metalearning.execution import one_thread_workers

    def fresh_thread_setting() -> int:
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        return seen[0]

    with _threads(2):
        with one_thread_workers(2) as pool:
            # each worker, whenever it runs, computes with one intra-op thread
            assert set(pool.map(lambda _: torch.get_num_threads(), range(8))) == {1}
            # while the process-wide default is already back for everyone else
            assert torch.get_num_threads() == 2
            assert fresh_thread_setting() == 2
        assert torch.get_num_threads() == 2
        assert fresh_thread_setting() == 2


def test_concurrent_callers_keep_their_thread_setting() -> None:
    import threading

    model = ml.ConvNet4(3, hidden=8)
    params = ml.init_params(model, 0)
    tasks = _tiny_conv_tasks(4, 7)
    seen: list[int] = []

    def caller() -> None:
        # Each caller decides its own setting, after torch's lazy per-thread initialisation
        # (which copies the process-wide value, 1 while another call's workers start up).
        torch.get_num_threads()
        torch.set_num_threads(2)
        for _ in range(3):
            ml.per_task_grads(model, params, tasks, device="cpu", method="loop")
        seen.append(torch.get_num_threads())

    with _threads(2):
        callers = [threading.Thread(target=caller) for _ in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert torch.get_num_threads() == 2
    assert seen == [2, 2, 2], seen
