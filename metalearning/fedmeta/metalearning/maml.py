"""Per-task MAML query gradients with per-task L2 clipping (DP-MAML Algorithm 1, inner loop, clip).

For each task i (support set S_i, query set Q_i) and meta-parameters phi:

    theta_i <- phi;  repeat k times: theta_i <- theta_i - alpha * grad_theta L(theta_i; S_i)
    g_i     <- grad_phi L(theta_i(phi); Q_i)
    g_i_hat <- g_i * min(1, C / ||g_i||_2)                    (Algorithm 1, "Gradients Clipping")

Second order differentiates through the inner steps; first order (FOMAML, Finn et al. 2017, Sec.
5.2) treats the inner gradients as constants, so g_i is the query gradient at theta_i.

Per-task gradients are computed with ``torch.autograd.grad`` / ``torch.func.grad`` and returned as
rows of a tensor; they never touch any ``.grad`` attribute, so nothing sums them before clipping.

Batching: ``method="vmap"`` vectorises tasks with :func:`torch.func.vmap` in chunks of
``chunk_size``; ``method="loop"`` runs task by task. ``method="auto"`` picks what was measured
fastest: vmap on CUDA (the loop for a single task), and on the CPU vmap only for models that declare
``prefers_vmap_on_cpu`` (the sinusoid MLP; the conv net is 1.2-2.3x slower and 25-45x more
memory-hungry under vmap on 2 CPU cores). On the CPU the loop evaluates a model through its
``fused_forward`` when it has one (the same function, computed faster:
:meth:`~metalearning.models.ConvNet4.fused_forward`) and, when torch has several threads, runs
tasks side by side on one thread each. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fedmeta.metalearning.execution import (
    Forward,
    GradientMethod,
    Params,
    Precision,
    as_params,
    compute_precision,
    default_chunk,
    deterministic_algorithms,
    loop_forward,
    loss_function,
    num_tasks,
    one_thread_workers,
    resolve_device,
    resolve_method,
    task_chunks,
    task_threads,
)
from fedmeta.metalearning.models import inner_rates
from fedmeta.metalearning.tasks import Task

__all__ = [
    "InnerLoop",
    "Metric",
    "NonFinite",
    "adapt",
    "clip_by_global_norm",
    "per_task_clipped_grads",
    "per_task_grads",
]

#: What a held-out task's score is: query accuracy (classification) or query MSE (regression).
Metric: TypeAlias = Literal["accuracy", "mse"]
#: What to do with a task whose gradient is not finite (see :func:`clip_by_global_norm`).
NonFinite: TypeAlias = Literal["raise", "zero"]


# --------------------------------------------------------------------------------------------------
# small helpers


# --------------------------------------------------------------------------------------------------
# clipping


def clip_by_global_norm(
    grads: Tensor, clip: float, *, nonfinite: NonFinite = "raise"
) -> tuple[Tensor, Tensor]:
    """Clip each row of ``grads`` ([n, dim]) to L2 norm at most ``clip``; return (clipped, norms).

    Row i is multiplied by ``min(1, clip / ||g_i||)`` (DP-MAML Algorithm 1; Abadi et al. 2016). Rows
    with norm <= clip are returned unchanged, an all-zero row stays zero (no division by zero), and
    ``clip = inf`` disables clipping. Non-finite rows raise ``ValueError`` (``nonfinite="raise"``)
    or are replaced by zeros (``"zero"``), which keeps the sensitivity bound; their reported norm is
    ``inf``.
    """
    if not clip > 0:
        raise ValueError(f"clip must be > 0; got {clip}")
    if grads.ndim != 2:
        raise ValueError(f"grads must be [n_tasks, dim]; got shape {tuple(grads.shape)}")
    norms = torch.linalg.vector_norm(grads, dim=1)
    # A NaN or infinite entry makes its row's norm non-finite, so only rows whose norm is not
    # finite need the entry-wise check (a finite float64 row can still overflow its norm): one
    # pass over the rows fewer, on the client and on the server's re-check alike.
    finite = torch.isfinite(norms)
    if not bool(finite.all()):
        finite = torch.isfinite(grads).all(dim=1)
    if not bool(finite.all()):
        if nonfinite == "raise":
            bad = torch.nonzero(~finite).flatten().tolist()
            raise ValueError(f"non-finite per-task gradient in rows {bad}")
        if nonfinite != "zero":
            raise ValueError(f"nonfinite must be 'raise' or 'zero'; got {nonfinite!r}")
        grads = torch.where(finite[:, None], grads, torch.zeros_like(grads))
        norms = torch.where(finite, norms, torch.full_like(norms, math.inf))
    if math.isinf(clip):
        return grads, norms
    safe = torch.clamp(torch.where(finite, norms, torch.zeros_like(norms)), min=1e-30)
    inside = norms <= clip
    scale = torch.where(inside, torch.ones_like(safe), clip / safe)
    # Rows within the bound are scaled by exactly 1, which returns them bit for bit (x * 1.0 == x
    # for every finite or infinite x, signed zeros included); zero rows are inside, so no 0/0.
    clipped = grads * scale[:, None].to(grads.dtype)
    # Guard the float rounding of norm * (clip / norm): never exceed clip.
    renorm = torch.linalg.vector_norm(clipped, dim=1)
    over = renorm > clip
    if bool(over.any()):
        clipped = torch.where(
            over[:, None], clipped * (clip / renorm)[:, None] * (1 - 1e-6), clipped
        )
    return clipped, norms


# --------------------------------------------------------------------------------------------------
# the inner loop: one function for training and evaluation, loop and vmap


@dataclass(frozen=True)
class InnerLoop:
    """How a task adapts: ``steps`` SGD steps at ``lr`` on its support set, made safe by design.

    Plain MAML steps ``theta <- theta - lr * g`` diverge when ``lr`` exceeds ``2 / lambda_max`` of
    the support loss's Hessian: a sinusoid of amplitude A scales the MSE gradient and curvature by
    up to A (A^2 for the loss), and a meta-model trained under DP noise can sit where the
    curvature is large, so a fixed rate that is safe on most tasks overshoots on a few, and each
    overshoot grows the next gradient (docs/results.md measured test MSEs of 9e9 and 1.8e25).
    Two guards, used identically in training (:func:`per_task_grads`) and evaluation
    (:func:`task_scores`):

    * ``grad_clip``: each inner gradient is scaled to global L2 norm at most ``grad_clip``, so
      one step moves the parameters by at most ``lr * grad_clip`` (with Meta-SGD's learned rates,
      the largest rate's magnitude times ``grad_clip``) (Zhang et al. 2020, "Why
      gradient clipping accelerates training", for clipped GD on non-smooth-Lipschitz losses).
    * ``step_check``: a backtracking (Armijo-style, with constant 0) acceptance test: a step is
      kept only if the support loss at the new point is finite and not larger than before;
      otherwise the task stays where it was and halves its own step. The support loss is then
      non-increasing in the number of steps, for every task, whatever the meta-model.

    The decisions are data-dependent selections (``torch.where``), so the same code runs under
    autograd, second order and ``torch.func.vmap``; the selected branch's gradient flows, the
    decision itself is a constant, as for any piecewise function.
    """

    steps: int = 1
    lr: float = 0.4
    grad_clip: float = math.inf
    step_check: bool = False

    def __post_init__(self) -> None:
        """Reject values that cannot define an inner loop."""
        if self.steps < 0:
            raise ValueError(f"inner_steps must be >= 0; got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"inner_lr must be > 0; got {self.lr}")
        if not self.grad_clip > 0:
            raise ValueError(f"inner_grad_clip must be > 0; got {self.grad_clip}")


# (params) -> (support loss, gradient); the gradient is detached unless second order.
LossAndGrad = Callable[[Params], tuple[Tensor, Params]]


def _clipped_step(
    p: Params, g: Params, lr: Tensor | float, clip: float, rates: Params | None
) -> Params:
    if not math.isinf(clip):
        norm = torch.sqrt(sum((v * v).sum() for v in g.values()))  # type: ignore[arg-type]
        scale = torch.clamp(clip / torch.clamp(norm, min=1e-30), max=1.0)
        g = {n: v * scale for n, v in g.items()}
    if rates is None:
        return {n: p[n] - lr * g[n] for n in p}
    return {n: p[n] - lr * rates[n] * g[n] for n in p}  # Meta-SGD: a learned rate per coordinate


def adapt(
    params: Params,
    loss_and_grad: LossAndGrad,
    loss_only: Callable[[Params], Tensor],
    inner: InnerLoop,
) -> Params:
    """``inner.steps`` guarded SGD steps from ``params`` (see :class:`InnerLoop`).

    When ``params`` carry learned inner rates (Meta-SGD, :func:`~fedmeta.metalearning.models.
    with_learned_inner_rates`), each coordinate steps by its own rate and ``inner.lr`` is unused:
    the rates were initialised at it. The rates are read from ``params``, so the query gradient
    reaches them through the steps, in first order too (there only the inner gradients are
    constants): ``d L_q / d alpha = -sum_steps g_support * g_query``.
    """
    rates = inner_rates(params)
    # The rates are not adapted and stay out of the inner gradients: a gradient with respect to a
    # rate would run back through the previous steps (which read it) and free their graph before
    # the query gradient needs it. The forward pass never reads them, so it does not miss them.
    fast = params if rates is None else {n: params[n] for n in rates}
    base_lr = inner.lr if rates is None else 1.0
    if not inner.step_check:
        for _ in range(inner.steps):
            _, g = loss_and_grad(fast)
            fast = _clipped_step(fast, g, base_lr, inner.grad_clip, rates)
        return fast
    if inner.steps == 0:
        return fast
    loss, g = loss_and_grad(fast)
    lr = torch.full_like(loss.detach(), base_lr)
    for step in range(inner.steps):
        cand = _clipped_step(fast, g, lr, inner.grad_clip, rates)
        last = step == inner.steps - 1
        # The last candidate needs only its loss: no step follows it.
        cand_loss, cand_g = (loss_only(cand), g) if last else loss_and_grad(cand)
        ok = (torch.isfinite(cand_loss) & (cand_loss <= loss)).detach()
        fast = {n: torch.where(ok, cand[n], fast[n]) for n in fast}
        if not last:
            loss = torch.where(ok, cand_loss, loss)
            g = {n: torch.where(ok, cand_g[n], g[n]) for n in g}
            lr = torch.where(ok, lr, lr * 0.5)
    return fast


# --------------------------------------------------------------------------------------------------
# per-task gradient, loop and vmap forms


def _task_grad_autograd(
    forward: Forward,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    params: Params,
    task: Task,
    inner: InnerLoop,
    first_order: bool,
) -> Tensor:
    """One task's flat query gradient with plain autograd (the loop path).

    A parameter that does not reach the loss (``ConvNet4(norm="none")``'s norm scales) gets a zero
    gradient, as ``torch.func.grad`` reports it on the vmap path.
    """
    meta = {n: p.detach().requires_grad_(True) for n, p in params.items()}

    # Support passes keep the NCHW kernels: second order differentiates them twice, and in
    # first order the channels-last layout saved nothing on these few images but changed the
    # float32 rounding (bench/compute_accuracy.py).
    def loss_only(fast: Params) -> Tensor:
        return loss_fn(forward(fast, task.support_x, False), task.support_y)

    def loss_and_grad(fast: Params) -> tuple[Tensor, Params]:
        loss = loss_only(fast)
        g = torch.autograd.grad(
            loss,
            list(fast.values()),
            create_graph=not first_order,
            allow_unused=True,
            materialize_grads=True,
        )
        return loss, dict(zip(fast, g, strict=True))

    fast = adapt(meta, loss_and_grad, loss_only, inner)
    # The query pass is differentiated once even in second order: its backward only feeds the
    # inner steps' graph, which holds the second derivatives.
    qloss = loss_fn(forward(fast, task.query_x, True), task.query_y)
    grads = torch.autograd.grad(
        qloss, list(meta.values()), allow_unused=True, materialize_grads=True
    )
    return torch.cat([g.reshape(-1) for g in grads])


def func_inner(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inner: InnerLoop,
    detach: bool,
) -> Callable[[Params, Tensor, Tensor], Params]:
    """The :func:`adapt` of one task in ``torch.func`` form: (params, sx, sy) -> adapted."""

    def support_loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(functional_call(model, p, (x,)), y)

    grad_and_loss = torch.func.grad_and_value(support_loss)

    def adapted(p: Params, sx: Tensor, sy: Tensor) -> Params:
        def loss_and_grad(q: Params) -> tuple[Tensor, Params]:
            g, loss = grad_and_loss(q, sx, sy)
            if detach:
                g = {n: v.detach() for n, v in g.items()}
            return loss, g

        return adapt(p, loss_and_grad, lambda q: support_loss(q, sx, sy), inner)

    return adapted


def _make_func_grad(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inner: InnerLoop,
    first_order: bool,
) -> Callable[..., Tensor]:
    """Build a pure function (params, sx, sy, qx, qy) -> flat query gradient."""
    adapted = func_inner(model, loss_fn, inner, detach=first_order)

    def query_loss(p: Params, sx: Tensor, sy: Tensor, qx: Tensor, qy: Tensor) -> Tensor:
        return loss_fn(functional_call(model, adapted(p, sx, sy), (qx,)), qy)

    outer = torch.func.grad(query_loss)

    def flat(p: Params, sx: Tensor, sy: Tensor, qx: Tensor, qy: Tensor) -> Tensor:
        g = outer(p, sx, sy, qx, qy)
        return torch.cat([v.reshape(-1) for v in g.values()])

    return flat


def _chunk_gradient_fn(
    model: nn.Module,
    p: dict[str, Tensor],
    dev: torch.device,
    meth: str,
    inner: InnerLoop,
    first_order: bool,
    precision: Precision = "fp32",
) -> Callable[[Task, ThreadPoolExecutor | None], Tensor]:
    """``chunk_grads(batch, pool)``: a chunk's per-task gradients, by ``vmap`` or a task loop.

    The passes run in ``precision`` (entered per task: autocast is thread-local); the rows come
    back in the parameters' dtype, so the clip's norm is never taken in bfloat16.
    """
    loss_fn = loss_function(model)
    dtype = next(iter(p.values())).dtype
    if meth == "vmap":
        batched = torch.func.vmap(
            _make_func_grad(model, loss_fn, inner, first_order),
            in_dims=(None, 0, 0, 0, 0),
        )

        def vmapped(b: Task, pool: ThreadPoolExecutor | None) -> Tensor:
            with compute_precision(dev, precision):
                g = batched(p, b.support_x, b.support_y, b.query_x, b.query_y)
            return g.to(dtype)

        return vmapped
    forward = loop_forward(model, dev)

    def one_task(b: Task, i: int) -> Tensor:
        with compute_precision(dev, precision):
            g = _task_grad_autograd(forward, loss_fn, p, b.task(i), inner, first_order)
        return g.to(dtype)

    def looped(b: Task, pool: ThreadPoolExecutor | None) -> Tensor:
        ids = range(b.support_x.shape[0])
        if pool is None:
            return torch.stack([one_task(b, i) for i in ids])
        return torch.stack(list(pool.map(lambda i: one_task(b, i), ids)))

    return looped


def per_task_grads(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    tasks: Task | Sequence[Task],
    *,
    inner_steps: int = 1,
    inner_lr: float = 0.4,
    first_order: bool = False,
    device: str | torch.device | None = "auto",
    chunk_size: int | None = None,
    method: GradientMethod = "auto",
    out: Tensor | None = None,
    on_chunk: Callable[[int, Tensor], Tensor] | None = None,
    deterministic: bool = True,
    inner_grad_clip: float = math.inf,
    step_check: bool = False,
    coordinates: Tensor | None = None,
    precision: Precision = "fp32",
) -> Tensor:
    """Unclipped per-task MAML query gradients, ``[n_tasks, dim]`` on ``device``.

    ``tasks`` is a batched :class:`Task` (leading task dimension) or a sequence of unbatched tasks
    (all of one shape). ``on_chunk(start, grads)`` may transform each chunk before it is stored
    (used for clipping chunk by chunk); it sees only the ``coordinates`` columns when they are given
    (then ``dim`` is their number). See :func:`per_task_clipped_grads` for the arguments.
    """
    inner = InnerLoop(inner_steps, inner_lr, inner_grad_clip, step_check)
    dev = resolve_device(device)
    n = num_tasks(tasks)
    meth = resolve_method(model, dev, method, n)
    chunk = chunk_size or default_chunk(meth, dev, model, tasks, inner_steps)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk}")
    model = model.to(dev)
    p = as_params(model, params, dev)
    dim = sum(v.numel() for v in p.values())
    if coordinates is not None:
        coordinates = coordinates.to(dev)
        dim = int(coordinates.numel())
    dtype = next(iter(p.values())).dtype
    if out is None:
        out = torch.empty((n, dim), dtype=dtype, device=dev)
    workers = task_threads(model, dev, n) if meth == "loop" else 1
    chunk_grads = _chunk_gradient_fn(model, p, dev, meth, inner, first_order, precision)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(one_thread_workers(workers)) if workers > 1 else None
        stack.enter_context(deterministic_algorithms(dev, deterministic))
        for start, batch in task_chunks(tasks, chunk):
            g = chunk_grads(batch.to(dev), pool)
            if coordinates is not None:
                g = g[:, coordinates]
            if on_chunk is not None:
                g = on_chunk(start, g)
            out[start : start + g.shape[0]] = g
    return out


def per_task_clipped_grads(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    tasks: Task | Sequence[Task],
    *,
    inner_steps: int = 1,
    inner_lr: float = 0.4,
    first_order: bool = False,
    clip: float = 1.0,
    device: str | torch.device | None = "auto",
    chunk_size: int | None = None,
    method: GradientMethod = "auto",
    nonfinite: NonFinite = "raise",
    deterministic: bool = True,
    inner_grad_clip: float = math.inf,
    step_check: bool = False,
    coordinates: Tensor | None = None,
    precision: Precision = "fp32",
) -> tuple[Tensor, Tensor]:
    """Clipped per-task MAML query gradients and their pre-clip L2 norms.

    Args:
        model: a ``SinusoidMLP`` / ``ConvNet4`` (any module with ``loss_kind`` ``"mse"``/``"ce"``);
            its own parameters are used only if ``params`` is None, and are never modified.
        params: meta-parameters phi: a ``{name: tensor}`` dict in the model's order, a flat vector
            (:func:`~metalearning.models.flatten_params` layout) or None for the module's own.
        tasks: a batched :class:`Task` (``support_x`` ``[n_tasks, ...]``) or a sequence of tasks.
        inner_steps: k inner SGD steps on the support set (0 gives the plain query-loss gradient).
        inner_lr: inner learning rate alpha.
        inner_grad_clip: L2 bound on each inner gradient (:class:`InnerLoop`; inf: none).
        step_check: keep an inner step only if the support loss does not rise (:class:`InnerLoop`).
        first_order: FOMAML (no differentiation through the inner steps).
        clip: L2 bound C on each task's whole flattened gradient (``math.inf``: no clipping).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ...
        chunk_size: tasks computed at once (bounds memory); None: ``execution.default_chunk``.
        method: ``"auto"``, ``"vmap"`` or ``"loop"`` (see module docstring).
        nonfinite: ``"raise"`` or ``"zero"`` for a task whose gradient is NaN/inf.
        deterministic: on CUDA, cuDNN's deterministic mode (bitwise-repeatable results).
        coordinates: the rows hold (and C bounds) only these flat positions (``trained_coordinates``
            of :mod:`~metalearning.models`); None: all. Inner loops adapt every parameter.
        precision: the passes' arithmetic (``execution.compute_precision``); never the clip's.

    Returns:
        ``(clipped [n_tasks, dim], pre_clip_norms [n_tasks])`` on ``device`` in the params' dtype,
        row i for task i; a deterministic function of the inputs (see ``deterministic``).
    """
    norms_holder: list[Tensor] = []

    def clip_chunk(start: int, g: Tensor) -> Tensor:
        c, nrm = clip_by_global_norm(g, clip, nonfinite=nonfinite)
        norms_holder.append(nrm)
        return c

    clipped = per_task_grads(
        model, params, tasks, inner_steps=inner_steps, inner_lr=inner_lr,
        first_order=first_order, device=device, chunk_size=chunk_size, method=method,
        on_chunk=clip_chunk, deterministic=deterministic, inner_grad_clip=inner_grad_clip,
        step_check=step_check, coordinates=coordinates, precision=precision,
    )  # fmt: skip
    return clipped, torch.cat(norms_holder) if norms_holder else clipped.new_zeros(0)


# --------------------------------------------------------------------------------------------------
# evaluation
