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

import torch
import torch.nn.functional as F
from fedmeta.metalearning.tasks import Task, stack_tasks
from torch import Tensor, nn
from torch.func import functional_call

__all__ = [
    "EvalResult",
    "GradientMethod",
    "Metric",
    "NonFinite",
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
    per_task = 150 * 2**20 + images * pixels * hidden * 50 * (1 + 0.2 * inner_steps)
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
    # Rows within the bound are returned bit for bit; zero rows are inside, so no 0/0 arises.
    clipped = torch.where(inside[:, None], grads, grads * scale[:, None].to(grads.dtype))
    # Guard the float rounding of norm * (clip / norm): never exceed clip.
    renorm = torch.linalg.vector_norm(clipped, dim=1)
    over = renorm > clip
    if bool(over.any()):
        clipped = torch.where(
            over[:, None], clipped * (clip / renorm)[:, None] * (1 - 1e-6), clipped
        )
    return clipped, norms


# --------------------------------------------------------------------------------------------------
# per-task gradient, loop and vmap forms


def _inner_steps(
    params: Params, support_grad: Callable[[Params], Sequence[Tensor]], steps: int, lr: float
) -> Params:
    """``theta <- theta - alpha * grad_theta L(theta; S)``, ``steps`` times, from ``phi = params``.

    The inner loop of both gradient forms (DP-MAML Algorithm 1): ``support_grad(theta)`` is the
    support-loss gradient in ``params``' order, by autograd (the loop) or ``torch.func`` (vmap);
    whether it keeps the graph (second order) or not (FOMAML) is the caller's.
    """
    fast = params
    for _ in range(steps):
        g = support_grad(fast)
        fast = {n: p - lr * gi for (n, p), gi in zip(fast.items(), g, strict=True)}
    return fast


def _task_grad_autograd(
    forward: Forward,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    params: Params,
    task: Task,
    inner_steps: int,
    inner_lr: float,
    first_order: bool,
) -> Tensor:
    """One task's flat query gradient with plain autograd (the loop path).

    A parameter that does not reach the loss (``ConvNet4(norm="none")``'s norm scales) gets a zero
    gradient, as ``torch.func.grad`` reports it on the vmap path.
    """
    meta = {n: p.detach().requires_grad_(True) for n, p in params.items()}

    def support_grad(fast: Params) -> Sequence[Tensor]:
        # Support passes keep the NCHW kernels: second order differentiates them twice, and in
        # first order the channels-last layout saved nothing on these few images but changed the
        # float32 rounding (bench/compute_accuracy.py).
        loss = loss_fn(forward(fast, task.support_x, False), task.support_y)
        return torch.autograd.grad(
            loss,
            list(fast.values()),
            create_graph=not first_order,
            allow_unused=True,
            materialize_grads=True,
        )

    fast = _inner_steps(meta, support_grad, inner_steps, inner_lr)
    # The query pass is differentiated once even in second order: its backward only feeds the
    # inner steps' graph, which holds the second derivatives.
    qloss = loss_fn(forward(fast, task.query_x, True), task.query_y)
    grads = torch.autograd.grad(
        qloss, list(meta.values()), allow_unused=True, materialize_grads=True
    )
    return torch.cat([g.reshape(-1) for g in grads])


def _make_func_grad(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inner_steps: int,
    inner_lr: float,
    first_order: bool,
) -> Callable[..., Tensor]:
    """Build a pure function (params, sx, sy, qx, qy) -> flat query gradient."""

    def support_loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(functional_call(model, p, (x,)), y)

    inner_grad = torch.func.grad(support_loss)

    def query_loss(p: Params, sx: Tensor, sy: Tensor, qx: Tensor, qy: Tensor) -> Tensor:
        def support_grad(fast: Params) -> Sequence[Tensor]:
            g = inner_grad(fast, sx, sy)
            return [g[n].detach() if first_order else g[n] for n in fast]

        fast = _inner_steps(p, support_grad, inner_steps, inner_lr)
        return loss_fn(functional_call(model, fast, (qx,)), qy)

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
    inner_steps: int,
    inner_lr: float,
    first_order: bool,
) -> Callable[[Task, ThreadPoolExecutor | None], Tensor]:
    """``chunk_grads(batch, pool)``: a chunk's per-task gradients, by ``vmap`` or a task loop."""
    loss_fn = _loss_fn(model)
    if meth == "vmap":
        batched = torch.func.vmap(
            _make_func_grad(model, loss_fn, inner_steps, inner_lr, first_order),
            in_dims=(None, 0, 0, 0, 0),
        )

        def vmapped(b: Task, pool: ThreadPoolExecutor | None) -> Tensor:
            return batched(p, b.support_x, b.support_y, b.query_x, b.query_y)

        return vmapped
    forward = _loop_forward(model, dev)

    def one_task(b: Task, i: int) -> Tensor:
        return _task_grad_autograd(
            forward, loss_fn, p, b.task(i), inner_steps, inner_lr, first_order
        )

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
) -> Tensor:
    """Unclipped per-task MAML query gradients, ``[n_tasks, dim]`` on ``device``.

    ``tasks`` is a batched :class:`Task` (leading task dimension) or a sequence of unbatched tasks
    (all of one shape). ``on_chunk(start, grads)`` may transform each chunk before it is stored
    (used for clipping chunk by chunk). See :func:`per_task_clipped_grads` for the arguments.
    """
    if inner_steps < 0:
        raise ValueError(f"inner_steps must be >= 0; got {inner_steps}")
    dev = resolve_device(device)
    n = _num_tasks(tasks)
    meth = resolve_method(model, dev, method, n)
    chunk = chunk_size or _default_chunk(meth, dev, model, tasks, inner_steps)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk}")
    model = model.to(dev)
    p = _as_params(model, params, dev)
    dim = sum(v.numel() for v in p.values())
    dtype = next(iter(p.values())).dtype
    if out is None:
        out = torch.empty((n, dim), dtype=dtype, device=dev)
    workers = _task_threads(model, dev, n) if meth == "loop" else 1
    chunk_grads = _chunk_gradient_fn(model, p, dev, meth, inner_steps, inner_lr, first_order)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(_one_thread_workers(workers)) if workers > 1 else None
        stack.enter_context(_deterministic(dev, deterministic))
        for start, batch in _chunks(tasks, chunk):
            g = chunk_grads(batch.to(dev), pool)
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
) -> tuple[Tensor, Tensor]:
    """Clipped per-task MAML query gradients and their pre-clip L2 norms.

    Args:
        model: a :class:`~metalearning.models.SinusoidMLP` / :class:`~metalearning.models.ConvNet4`
            (or any module with ``loss_kind`` ``"mse"``/``"ce"``); its own parameters are not used
            unless ``params`` is None, and are never modified.
        params: meta-parameters phi: a ``{name: tensor}`` dict in the model's order, a flat vector
            (:func:`~metalearning.models.flatten_params` layout) or None for the module's own.
        tasks: a batched :class:`Task` (``support_x`` ``[n_tasks, ...]``) or a sequence of tasks.
        inner_steps: k inner SGD steps on the support set (0 gives the plain query-loss gradient).
        inner_lr: inner learning rate alpha.
        first_order: FOMAML (no differentiation through the inner steps).
        clip: L2 bound C on each task's whole flattened gradient (``math.inf``: no clipping).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ...
        chunk_size: tasks computed at once; bounds memory. Default: 32 for CPU vmap; on CUDA as
            many as fit in half the free GPU memory by a conservative estimate (at most 512).
        method: ``"auto"``, ``"vmap"`` or ``"loop"`` (see module docstring).
        nonfinite: ``"raise"`` or ``"zero"`` for a task whose gradient is NaN/inf.
        deterministic: on CUDA, run cuDNN in deterministic mode (bitwise-repeatable results).

    Returns:
        ``(clipped [n_tasks, dim], pre_clip_norms [n_tasks])``, on ``device``, in the params' dtype.
        Row i belongs to task i. Deterministic for given inputs (cuDNN deterministic mode on CUDA).
    """
    n = _num_tasks(tasks)
    norms_holder: list[Tensor] = []

    def clip_chunk(start: int, g: Tensor) -> Tensor:
        c, nrm = clip_by_global_norm(g, clip, nonfinite=nonfinite)
        norms_holder.append(nrm)
        return c

    clipped = per_task_grads(
        model, params, tasks, inner_steps=inner_steps, inner_lr=inner_lr,
        first_order=first_order, device=device, chunk_size=chunk_size, method=method,
        on_chunk=clip_chunk, deterministic=deterministic,
    )  # fmt: skip
    norms = torch.cat(norms_holder) if norms_holder else clipped.new_zeros(0)
    assert norms.shape[0] == n
    return clipped, norms


# --------------------------------------------------------------------------------------------------
# evaluation


@dataclass(frozen=True)
class EvalResult:
    """Mean metric over test tasks and its 95% normal-approximation confidence half-width."""

    mean: float
    ci95: float
    n_tasks: int
    metric: Metric
    pre_adaptation_mean: float | None = None

    def __iter__(self) -> Iterator[float]:
        """Unpack as ``mean, ci95 = evaluate(...)``."""
        return iter((self.mean, self.ci95))


def _adapt_and_score(
    forward: Forward,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    params: Params,
    task: Task,
    steps: int,
    lr: float,
    metric: Metric,
) -> Tensor:
    fast = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    for _ in range(steps):
        loss = loss_fn(forward(fast, task.support_x, False), task.support_y)
        g = torch.autograd.grad(
            loss, list(fast.values()), allow_unused=True, materialize_grads=True
        )
        fast = {
            n: (p - lr * gi).detach().requires_grad_(True)
            for (n, p), gi in zip(fast.items(), g, strict=True)
        }
    with torch.no_grad():
        out = forward(fast, task.query_x, True)
        if metric == "accuracy":
            return (out.argmax(-1) == task.query_y).float().mean()
        return F.mse_loss(out, task.query_y)


def _vmap_scores(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    params: Params,
    batch: Task,
    steps: int,
    lr: float,
    metric: Metric,
) -> Tensor:
    """The vmap form of :func:`_adapt_and_score`, over a batch of tasks."""

    def one(pp: Params, sx: Tensor, sy: Tensor, qx: Tensor, qy: Tensor) -> Tensor:
        fast = pp
        g_fn = torch.func.grad(lambda q, x, y: loss_fn(functional_call(model, q, (x,)), y))
        for _ in range(steps):
            g = g_fn(fast, sx, sy)
            fast = {n: fast[n] - lr * g[n].detach() for n in fast}
        out: Tensor = functional_call(model, fast, (qx,))
        if metric == "accuracy":
            return (out.argmax(-1) == qy).float().mean()
        return F.mse_loss(out, qy)

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
) -> Tensor:
    """Each task's query score after ``inner_steps`` SGD steps on its own support set.

    The score is the query accuracy (classification) or MSE (regression). Each task is adapted
    separately from ``params``, and with ``norm="batch"`` each forward pass normalises with its
    own batch (the task's support set, then its query set). Returns float64 ``[n_tasks]`` on the
    CPU; :func:`evaluate` summarises it.
    """
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
                scores.append(_vmap_scores(model, loss_fn, p, b, inner_steps, inner_lr, metric))
                continue
            for i in range(b.support_x.shape[0]):
                one = _adapt_and_score(
                    forward, loss_fn, p, b.task(i), inner_steps, inner_lr, metric
                )
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
) -> EvalResult:
    """Adapt on each task's support set for ``inner_steps`` SGD steps, then score its query set.

    Returns the mean query accuracy (classification) or MSE (regression) over the tasks
    (:func:`task_scores`) with a 95% confidence half-width ``1.96 * std / sqrt(n)`` (MAML's
    reporting convention). Build the tasks from held-out classes, e.g. ``sample_tasks(test_split,
    ..., n_tasks=600, seed=...)``. ``mean, ci95 = evaluate(...)`` unpacks.
    """
    if _num_tasks(tasks) == 0:
        raise ValueError("evaluate needs at least one task")

    def scores(steps: int) -> Tensor:
        return task_scores(
            model, params, tasks, inner_steps=steps, inner_lr=inner_lr, device=device,
            chunk_size=chunk_size, method=method,
        )  # fmt: skip

    s = scores(inner_steps)
    pre = float(scores(0).mean()) if with_pre_adaptation else None
    n = s.numel()
    ci = 1.96 * float(s.std(unbiased=True)) / math.sqrt(n) if n > 1 else math.nan
    metric: Metric = "mse" if getattr(model, "loss_kind", "ce") == "mse" else "accuracy"
    return EvalResult(float(s.mean()), ci, n, metric, pre)


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
) -> Params:
    """Non-private MAML with Adam on the mean (optionally clipped) per-task gradient.

    ``next_batch(step)`` returns a batched :class:`Task`. Returns the trained parameters (a new
    dict). This is the outer loop of MAML without noise; the federated, private loop lives in
    ``server/``.
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
        )
        opt.zero_grad(set_to_none=True)
        vec.grad = g.mean(0)
        opt.step()
    return {k: v.clone() for k, v in unflatten_params(vec.detach(), spec).items()}
