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
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmeta.metalearning.models import inner_rates
from fedmeta.metalearning.tasks import Task, stack_tasks

__all__ = [
    "EvalResult",
    "GradientMethod",
    "InnerLoop",
    "Metric",
    "NonFinite",
    "adapt",
    "bootstrap_interval",
    "diverged_tasks",
    "clip_by_global_norm",
    "evaluate",
    "meta_train",
    "per_task_clipped_grads",
    "per_task_grads",
    "resolve_device",
    "resolve_method",
    "task_scores",
]

Params = dict[str, Tensor]
#: How per-task gradients are batched: ``auto`` picks ``vmap`` or ``loop`` (module docstring).
GradientMethod: TypeAlias = Literal["auto", "vmap", "loop"]
#: What a held-out task's score is: query accuracy (classification) or query MSE (regression).
Metric: TypeAlias = Literal["accuracy", "mse"]
#: What to do with a task whose gradient is not finite (see :func:`clip_by_global_norm`).
NonFinite: TypeAlias = Literal["raise", "zero"]
# Serialises the start-up of worker pools (see _one_thread_workers).
_WORKER_START_LOCK = threading.Lock()
# (params, inputs, once_differentiable) -> outputs; see _loop_forward.
Forward = Callable[[Params, Tensor, bool], Tensor]


# --------------------------------------------------------------------------------------------------
# small helpers


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/``None`` -> ``cuda`` when available, else ``cpu``; anything else as given."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_method(
    model: nn.Module,
    device: torch.device,
    method: GradientMethod = "auto",
    n_tasks: int | None = None,
) -> Literal["vmap", "loop"]:
    """Choose ``"vmap"`` or ``"loop"`` for ``model`` on ``device`` (see the module docstring).

    Measured (docs/benchmarks.md): on CUDA vmap is 2.5-12x faster than a loop from 8 tasks on, but
    about 2x slower for a single task; on 2 CPU cores the loop wins for the conv net and vmap for
    the sinusoid MLP.
    """
    if method not in ("auto", "vmap", "loop"):
        raise ValueError(f"method must be 'auto', 'vmap' or 'loop'; got {method!r}")
    if method != "auto":
        return method
    if device.type == "cuda":
        return "loop" if n_tasks == 1 else "vmap"
    return "vmap" if getattr(model, "prefers_vmap_on_cpu", False) else "loop"


def _default_chunk(
    method: str,
    device: torch.device,
    model: nn.Module | None = None,
    tasks: Task | Sequence[Task] | None = None,
    inner_steps: int = 1,
) -> int:
    """Tasks per vmap chunk: 32 on the CPU; on CUDA as many as fit in half the free memory.

    The CUDA estimate is conservative against peaks measured on an H100 (ConvNet4, 28x28, 64
    filters, per task in a vmap chunk: 141 MiB for 5-way 1-shot 1 query second order 5 steps, 225
    MiB with 15 queries, 880 MiB for 20-way 15 queries): 150 MiB plus 50 bytes x pixels x filters
    per image, doubled at five inner steps.
    """
    if method == "loop":
        return 64
    if device.type != "cuda" or model is None or tasks is None:
        return 32
    first = tasks.task(0) if isinstance(tasks, Task) else tasks[0]
    images = first.support_x.shape[0] + first.query_x.shape[0]
    pixels = first.support_x[0].numel()
    hidden = getattr(model, "hidden", 64)
    # Plus the parameter copies vmap batches per task (one per inner step and a few more), which
    # the activation term above, measured at 64 filters, does not grow with: parameters grow with
    # the square of the width (dataset.filters), and Meta-SGD doubles them.
    copies = 4 * sum(p.numel() for p in model.parameters()) * (inner_steps + 3)
    per_task = 150 * 2**20 + images * pixels * hidden * 50 * (1 + 0.2 * inner_steps) + copies
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(1, min(512, 0.5 * free // per_task)))


def _loop_forward(model: nn.Module, device: torch.device) -> Forward:
    """The per-task forward of the loop path: ``(params, x, once_differentiable) -> output``.

    On the CPU a model may offer ``fused_forward`` (the same function, evaluated faster; see
    :meth:`~metalearning.models.ConvNet4.fused_forward`); ``once_differentiable`` tells it that the
    pass's graph will be differentiated at most once, which allows kernels without a double
    backward. Elsewhere it is ``functional_call``.
    """
    fused = _faithful_fused_forward(model) if device.type == "cpu" else None
    if fused is not None:

        def fast(p: Params, x: Tensor, once: bool) -> Tensor:
            out: Tensor = fused(p, x, once_differentiable=once)
            return out

        return fast

    def plain(p: Params, x: Tensor, once: bool) -> Tensor:
        out: Tensor = functional_call(model, p, (x,))
        return out

    return plain


def _faithful_fused_forward(model: nn.Module) -> Callable[..., Tensor] | None:
    """``model.fused_forward`` when it computes what calling the module computes, else None.

    It does not when a subclass overrides ``forward`` or a forward hook is registered: calling the
    module would run them, and ``fused_forward`` would silently bypass them.
    """
    fused = getattr(model, "fused_forward", None)
    faithful = getattr(model, "fused_forward_is_faithful", None)
    if fused is None or faithful is None or not faithful():
        return None
    return fused  # type: ignore[no-any-return]


def _task_threads(model: nn.Module, device: torch.device, n_tasks: int) -> int:
    """Worker threads for the CPU loop: tasks side by side, one intra-op thread each.

    Measured on 2 cores (``docs/benchmarks.md``): two tasks at once on one thread each beat one
    task at a time on two intra-op threads, most for second order, whose many small support-set
    ops split poorly across threads. A call with a single task keeps the intra-op threads. Every
    task of a multi-task call runs on one thread, so its gradient does not depend on the chunking
    or the scheduling.

    Only models with a ``fused_forward`` qualify: it is a pure function of the parameters it is
    given, whereas ``functional_call`` swaps them into the shared module for the duration of the
    call, so two threads would run on each other's parameters.
    """
    if device.type != "cpu" or n_tasks < 2 or _faithful_fused_forward(model) is None:
        return 1
    return max(1, min(torch.get_num_threads(), n_tasks))


@contextlib.contextmanager
def _one_thread_workers(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of ``workers`` threads, each set to one intra-op thread, that leaves torch as it was.

    ``torch.set_num_threads`` sets the calling thread's own setting and also the process-wide value
    that threads starting later inherit. The workers therefore all set theirs while this (locked)
    start-up waits, and the process-wide value is put back at once: two calls cannot capture each
    other's 1, and only a thread whose first torch work falls in those few milliseconds inherits
    1 (PyTorch initialises a thread's setting lazily from the process-wide value).
    """
    ready = threading.Barrier(workers + 1)

    def one_thread() -> None:
        # Initialise this thread's torch threading first: PyTorch does so lazily on a thread's
        # first parallel op, from the process-wide value, which would undo the 1 set here.
        torch.get_num_threads()
        torch.set_num_threads(1)
        ready.wait()

    pool = ThreadPoolExecutor(workers, thread_name_prefix="fedmeta-task")
    try:
        with _WORKER_START_LOCK:
            threads = torch.get_num_threads()
            try:
                for _ in range(workers):  # one per thread: each blocks at the barrier
                    pool.submit(one_thread)
                ready.wait(timeout=60)
            finally:
                torch.set_num_threads(threads)
        yield pool
    finally:
        pool.shutdown()


def _loss_fn(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    kind = getattr(model, "loss_kind", "ce")
    if kind == "mse":
        return F.mse_loss
    if kind == "ce":
        return F.cross_entropy
    raise ValueError(f"model.loss_kind must be 'mse' or 'ce'; got {kind!r}")


def _as_params(
    model: nn.Module, params: Mapping[str, Tensor] | Tensor | None, device: torch.device
) -> Params:
    """Meta-parameters as a dict on ``device`` from a dict, a flat vector or the module's own."""
    from fedmeta.metalearning.models import param_spec, unflatten_params

    if params is None:
        params = {n: p.detach() for n, p in model.named_parameters()}
    elif isinstance(params, Tensor):
        params = unflatten_params(params, param_spec(model))
    names = [n for n, _ in model.named_parameters()]
    if list(params) != names:
        raise ValueError(
            f"params must have the model's parameter names {names}; got {list(params)}"
        )
    return {n: p.detach().to(device) for n, p in params.items()}


def _chunks(tasks: Task | Sequence[Task], size: int) -> Iterator[tuple[int, Task]]:
    """Yield ``(start, batched_task)`` chunks of at most ``size`` tasks."""
    if isinstance(tasks, Task):
        n = tasks.support_x.shape[0]
        for s in range(0, n, size):
            yield s, Task(*(t[s : s + size] for t in tasks))
    else:
        for s in range(0, len(tasks), size):
            yield s, stack_tasks(tasks[s : s + size])


def _num_tasks(tasks: Task | Sequence[Task]) -> int:
    return tasks.support_x.shape[0] if isinstance(tasks, Task) else len(tasks)


@contextlib.contextmanager
def _deterministic(device: torch.device, on: bool = True) -> Iterator[None]:
    if device.type == "cuda" and on:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            yield
    else:
        yield


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


def _func_inner(
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
    adapted = _func_inner(model, loss_fn, inner, detach=first_order)

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
) -> Callable[[Task, ThreadPoolExecutor | None], Tensor]:
    """``chunk_grads(batch, pool)``: a chunk's per-task gradients, by ``vmap`` or a task loop."""
    loss_fn = _loss_fn(model)
    if meth == "vmap":
        batched = torch.func.vmap(
            _make_func_grad(model, loss_fn, inner, first_order),
            in_dims=(None, 0, 0, 0, 0),
        )

        def vmapped(b: Task, pool: ThreadPoolExecutor | None) -> Tensor:
            return batched(p, b.support_x, b.support_y, b.query_x, b.query_y)

        return vmapped
    forward = _loop_forward(model, dev)

    def one_task(b: Task, i: int) -> Tensor:
        return _task_grad_autograd(forward, loss_fn, p, b.task(i), inner, first_order)

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
) -> Tensor:
    """Unclipped per-task MAML query gradients, ``[n_tasks, dim]`` on ``device``.

    ``tasks`` is a batched :class:`Task` (leading task dimension) or a sequence of unbatched tasks
    (all of one shape). ``on_chunk(start, grads)`` may transform each chunk before it is stored
    (used for clipping chunk by chunk); it sees only the ``coordinates`` columns when they are given
    (then ``dim`` is their number). See :func:`per_task_clipped_grads` for the arguments.
    """
    inner = InnerLoop(inner_steps, inner_lr, inner_grad_clip, step_check)
    dev = resolve_device(device)
    n = _num_tasks(tasks)
    meth = resolve_method(model, dev, method, n)
    chunk = chunk_size or _default_chunk(meth, dev, model, tasks, inner_steps)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk}")
    model = model.to(dev)
    p = _as_params(model, params, dev)
    dim = sum(v.numel() for v in p.values())
    if coordinates is not None:
        coordinates = coordinates.to(dev)
        dim = int(coordinates.numel())
    dtype = next(iter(p.values())).dtype
    if out is None:
        out = torch.empty((n, dim), dtype=dtype, device=dev)
    workers = _task_threads(model, dev, n) if meth == "loop" else 1
    chunk_grads = _chunk_gradient_fn(model, p, dev, meth, inner, first_order)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(_one_thread_workers(workers)) if workers > 1 else None
        stack.enter_context(_deterministic(dev, deterministic))
        for start, batch in _chunks(tasks, chunk):
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
        chunk_size: tasks computed at once; bounds memory. Default: 32 for CPU vmap; on CUDA as
            many as fit in half the free GPU memory by a conservative estimate (at most 512).
        method: ``"auto"``, ``"vmap"`` or ``"loop"`` (see module docstring).
        nonfinite: ``"raise"`` or ``"zero"`` for a task whose gradient is NaN/inf.
        deterministic: on CUDA, cuDNN's deterministic mode (bitwise-repeatable results).
        coordinates: the rows hold (and C bounds) only these flat positions (``trained_coordinates``
            of :mod:`~metalearning.models`); None: all. Inner loops adapt every parameter.

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
        step_check=step_check, coordinates=coordinates,
    )  # fmt: skip
    return clipped, torch.cat(norms_holder) if norms_holder else clipped.new_zeros(0)


# --------------------------------------------------------------------------------------------------
# evaluation


@dataclass(frozen=True)
class EvalResult:
    """The test metric over held-out tasks: mean, a valid interval, median and diverged tasks.

    ``ci95`` is the normal-approximation half-width ``1.96 * std / sqrt(n)`` (MAML's reporting
    convention), kept for comparison only: on heavy-tailed errors it leaves the metric's range (an
    MSE interval below 0). ``ci95_low``/``ci95_high`` are the 95% percentile-bootstrap interval of
    the mean (Efron and Tibshirani 1993, ch. 13), which lies within the tasks' smallest and largest
    scores and so never leaves the metric's range. ``diverged`` counts tasks whose adaptation
    failed (:func:`diverged_tasks`); they stay in the mean.
    """

    mean: float
    ci95: float
    n_tasks: int
    metric: Metric
    pre_adaptation_mean: float | None = None
    median: float = math.nan
    ci95_low: float = math.nan
    ci95_high: float = math.nan
    diverged: int = 0

    def __iter__(self) -> Iterator[float]:
        """Unpack as ``mean, ci95 = evaluate(...)``."""
        return iter((self.mean, self.ci95))


# A task's adaptation counts as diverged when its query MSE ends this many times above where it
# started (or non-finite): adaptation is meant to lower the error, and the runs that blew up
# (docs/results.md) ended 1e9-1e25 times above it, whereas a noisy but working step ends within a
# small factor of its start.
DIVERGENCE_FACTOR = 10.0


def diverged_tasks(scores: Tensor, pre_scores: Tensor, metric: str) -> int:
    """Tasks whose score is non-finite or (MSE) ``DIVERGENCE_FACTOR`` times its pre-adaptation."""
    bad = ~torch.isfinite(scores)
    if metric == "mse":
        bad |= scores > DIVERGENCE_FACTOR * pre_scores
    return int(bad.sum())


def bootstrap_interval(scores: Tensor, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of ``scores`` (scipy.stats.bootstrap).

    Each resampled mean is a mean of observed scores, so the interval lies within [min, max] of
    them. A non-finite score makes the mean non-finite, and the interval is then reported as
    ``(nan, nan)`` rather than computed on the finite tasks alone. The seed is fixed: the interval
    is a function of the public test scores, and a fixed seed makes it repeatable.
    """
    from scipy import stats

    x = scores.double().numpy()
    if x.size < 2 or not bool(torch.isfinite(scores).all()):
        return math.nan, math.nan
    if float(x.min()) == float(x.max()):
        return float(x[0]), float(x[0])
    res = stats.bootstrap(
        (x,), np.mean, n_resamples=resamples, confidence_level=0.95, method="percentile",
        random_state=np.random.default_rng(seed), vectorized=True,
    )  # fmt: skip
    lo, hi = res.confidence_interval
    return float(lo), float(hi)


def _score(out: Tensor, y: Tensor, metric: str) -> Tensor:
    if metric == "accuracy":
        return (out.argmax(-1) == y).float().mean()
    return F.mse_loss(out, y)


def _adapt_and_score(
    forward: Forward,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    params: Params,
    task: Task,
    inner: InnerLoop,
    metric: Metric,
) -> Tensor:
    def loss_only(q: Params) -> Tensor:
        with torch.no_grad():
            return loss_fn(forward(q, task.support_x, True), task.support_y)

    def loss_and_grad(q: Params) -> tuple[Tensor, Params]:
        q = {n: v.detach().requires_grad_(True) for n, v in q.items()}
        loss = loss_fn(forward(q, task.support_x, False), task.support_y)
        g = torch.autograd.grad(loss, list(q.values()), allow_unused=True, materialize_grads=True)
        return loss.detach(), dict(zip(q, g, strict=True))

    start = {n: p.detach() for n, p in params.items()}
    fast = adapt(start, loss_and_grad, loss_only, inner)
    with torch.no_grad():
        return _score(forward(fast, task.query_x, True), task.query_y, metric)


def _vmap_scores(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    params: Params,
    batch: Task,
    inner: InnerLoop,
    metric: Metric,
) -> Tensor:
    """The vmap form of :func:`_adapt_and_score`, over a batch of tasks."""
    adapted = _func_inner(model, loss_fn, inner, detach=True)

    def one(pp: Params, sx: Tensor, sy: Tensor, qx: Tensor, qy: Tensor) -> Tensor:
        out: Tensor = functional_call(model, adapted(pp, sx, sy), (qx,))
        return _score(out, qy, metric)

    fn = torch.func.vmap(one, in_dims=(None, 0, 0, 0, 0))
    return fn(params, batch.support_x, batch.support_y, batch.query_x, batch.query_y).detach()


def task_scores(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    tasks: Task | Sequence[Task],
    *,
    inner_steps: int = 10,
    inner_lr: float = 0.4,
    device: str | torch.device | None = "auto",
    chunk_size: int | None = None,
    method: GradientMethod = "auto",
    inner_grad_clip: float = math.inf,
    step_check: bool = False,
) -> Tensor:
    """Each task's query score after ``inner_steps`` SGD steps on its own support set.

    The score is the query accuracy (classification) or MSE (regression). Each task is adapted
    separately from ``params`` by the same guarded inner loop as training (:class:`InnerLoop`),
    and with ``norm="batch"`` each forward pass normalises with its own batch (the task's support
    set, then its query set). Returns float64 ``[n_tasks]`` on the CPU; :func:`evaluate`
    summarises it.
    """
    inner = InnerLoop(inner_steps, inner_lr, inner_grad_clip, step_check)
    dev = resolve_device(device)
    meth = resolve_method(model, dev, method, _num_tasks(tasks))
    chunk = chunk_size or _default_chunk(meth, dev, model, tasks, 0)
    model = model.to(dev)
    p = _as_params(model, params, dev)
    loss_fn = _loss_fn(model)
    metric: Metric = "mse" if getattr(model, "loss_kind", "ce") == "mse" else "accuracy"
    scores: list[Tensor] = []
    forward = _loop_forward(model, dev)
    with _deterministic(dev):
        for _, batch in _chunks(tasks, chunk):
            b = batch.to(dev)
            if meth == "vmap":
                scores.append(_vmap_scores(model, loss_fn, p, b, inner, metric))
                continue
            for i in range(b.support_x.shape[0]):
                one = _adapt_and_score(forward, loss_fn, p, b.task(i), inner, metric)
                scores.append(one.reshape(1))
    if not scores:
        raise ValueError("task_scores needs at least one task")
    return torch.cat(scores).double().cpu()


def evaluate(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    tasks: Task | Sequence[Task],
    *,
    inner_steps: int = 10,
    inner_lr: float = 0.4,
    device: str | torch.device | None = "auto",
    chunk_size: int | None = None,
    method: GradientMethod = "auto",
    with_pre_adaptation: bool = False,
    inner_grad_clip: float = math.inf,
    step_check: bool = False,
) -> EvalResult:
    """Adapt on each task's support set (:class:`InnerLoop`), then score its query set.

    Returns the mean query accuracy (classification) or MSE (regression) over the tasks
    (:func:`task_scores`), its median, a 95% percentile-bootstrap interval of the mean
    (:func:`bootstrap_interval`), the normal-approximation half-width (MAML's convention) and the
    number of diverged tasks (:func:`diverged_tasks`; the pre-adaptation scores are computed for
    it). Build the tasks from held-out classes, e.g. ``sample_tasks(test_split, ..., n_tasks=600,
    seed=...)``. ``mean, ci95 = evaluate(...)`` unpacks.
    """
    if _num_tasks(tasks) == 0:
        raise ValueError("evaluate needs at least one task")

    def scores(steps: int) -> Tensor:
        return task_scores(
            model, params, tasks, inner_steps=steps, inner_lr=inner_lr, device=device,
            chunk_size=chunk_size, method=method, inner_grad_clip=inner_grad_clip,
            step_check=step_check,
        )  # fmt: skip

    s = scores(inner_steps)
    pre_scores = scores(0)
    n = s.numel()
    ci = 1.96 * float(s.std(unbiased=True)) / math.sqrt(n) if n > 1 else math.nan
    metric: Metric = "mse" if getattr(model, "loss_kind", "ce") == "mse" else "accuracy"
    lo, hi = bootstrap_interval(s)
    return EvalResult(
        float(s.mean()), ci, n, metric,
        float(pre_scores.mean()) if with_pre_adaptation else None,
        median=float(s.median()), ci95_low=lo, ci95_high=hi,
        diverged=diverged_tasks(s, pre_scores, metric),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# a small non-private trainer (tests, docs, baselines)


def meta_train(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    next_batch: Callable[[int], Task],
    *,
    steps: int,
    meta_lr: float = 1e-3,
    inner_steps: int = 1,
    inner_lr: float = 0.4,
    first_order: bool = False,
    clip: float = math.inf,
    device: str | torch.device | None = "auto",
    chunk_size: int | None = None,
    method: GradientMethod = "auto",
    inner_grad_clip: float = math.inf,
    step_check: bool = False,
) -> Params:
    """Non-private MAML with Adam on the mean (optionally clipped) per-task gradient.

    ``next_batch(step)`` returns a batched :class:`Task`; ``inner_grad_clip`` and ``step_check``
    guard the inner loop (:class:`InnerLoop`). Returns the trained parameters (a new dict).
    This is the outer loop of MAML without noise; the federated, private loop lives in ``server/``.
    """
    from fedmeta.metalearning.models import param_spec, unflatten_params

    dev = resolve_device(device)
    p = _as_params(model, params, dev)
    spec = param_spec(model)
    vec = torch.cat([v.reshape(-1) for v in p.values()]).clone().requires_grad_(True)
    opt = torch.optim.Adam([vec], lr=meta_lr)
    for step in range(steps):
        g, _ = per_task_clipped_grads(
            model,
            vec.detach(),
            next_batch(step),
            inner_steps=inner_steps,
            inner_lr=inner_lr,
            first_order=first_order,
            clip=clip,
            device=dev,
            chunk_size=chunk_size,
            method=method,
            inner_grad_clip=inner_grad_clip,
            step_check=step_check,
        )
        opt.zero_grad(set_to_none=True)
        vec.grad = g.mean(0)
        opt.step()
    return {k: v.clone() for k, v in unflatten_params(vec.detach(), spec).items()}
