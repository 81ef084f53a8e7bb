"""How per-task work runs: the device, vmap or the loop, chunk sizes, threads and the forward pass.

What the gradient code (maml.py) and the evaluation (evaluation.py) share: ``method="auto"``'s
choice, the chunk size a device affords, a model's forward as a function of its parameters (fused
where the model offers it), one-thread workers for tasks side by side, deterministic algorithms.
The measurements behind the choices are in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmeta.metalearning.tasks import Task, stack_tasks

Params = dict[str, Tensor]


#: How per-task gradients are batched: ``auto`` picks ``vmap`` or ``loop`` (module docstring).
GradientMethod: TypeAlias = Literal["auto", "vmap", "loop"]

#: The arithmetic of the inner loop and the query pass (:func:`compute_precision`).
Precision: TypeAlias = Literal["fp32", "tf32", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "tf32", "bf16")


# Serialises the start-up of worker pools (see one_thread_workers).
_WORKER_START_LOCK = threading.Lock()


# (params, inputs, once_differentiable) -> outputs; see loop_forward.
Forward = Callable[[Params, Tensor, bool], Tensor]


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


def default_chunk(
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


def loop_forward(model: nn.Module, device: torch.device) -> Forward:
    """The per-task forward of the loop path: ``(params, x, once_differentiable) -> output``.

    On the CPU a model may offer ``fused_forward`` (the same function, evaluated faster; see
    :meth:`~metalearning.models.ConvNet4.fused_forward`); ``once_differentiable`` tells it that the
    pass's graph will be differentiated at most once, which allows kernels without a double
    backward. Elsewhere it is ``functional_call``.
    """
    fused = faithful_fused_forward(model) if device.type == "cpu" else None
    if fused is not None:

        def fast(p: Params, x: Tensor, once: bool) -> Tensor:
            out: Tensor = fused(p, x, once_differentiable=once)
            return out

        return fast

    def plain(p: Params, x: Tensor, once: bool) -> Tensor:
        out: Tensor = functional_call(model, p, (x,))
        return out

    return plain


def faithful_fused_forward(model: nn.Module) -> Callable[..., Tensor] | None:
    """``model.fused_forward`` when it computes what calling the module computes, else None.

    It does not when a subclass overrides ``forward`` or a forward hook is registered: calling the
    module would run them, and ``fused_forward`` would silently bypass them.
    """
    fused = getattr(model, "fused_forward", None)
    faithful = getattr(model, "fused_forward_is_faithful", None)
    if fused is None or faithful is None or not faithful():
        return None
    return fused  # type: ignore[no-any-return]


def task_threads(model: nn.Module, device: torch.device, n_tasks: int) -> int:
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
    if device.type != "cpu" or n_tasks < 2 or faithful_fused_forward(model) is None:
        return 1
    return max(1, min(torch.get_num_threads(), n_tasks))


@contextlib.contextmanager
def one_thread_workers(workers: int) -> Iterator[ThreadPoolExecutor]:
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


def loss_function(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss of ``model``: MSE for regression (``loss_kind``), else cross-entropy."""
    kind = getattr(model, "loss_kind", "ce")
    if kind == "mse":
        return F.mse_loss
    if kind == "ce":
        return F.cross_entropy
    raise ValueError(f"model.loss_kind must be 'mse' or 'ce'; got {kind!r}")


def as_params(
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


def task_chunks(tasks: Task | Sequence[Task], size: int) -> Iterator[tuple[int, Task]]:
    """Yield ``(start, batched_task)`` chunks of at most ``size`` tasks."""
    if isinstance(tasks, Task):
        n = tasks.support_x.shape[0]
        for s in range(0, n, size):
            yield s, Task(*(t[s : s + size] for t in tasks))
    else:
        for s in range(0, len(tasks), size):
            yield s, stack_tasks(tasks[s : s + size])


def num_tasks(tasks: Task | Sequence[Task]) -> int:
    """How many tasks ``tasks`` holds (a batched ``Task`` or a sequence of them)."""
    return tasks.support_x.shape[0] if isinstance(tasks, Task) else len(tasks)


@contextlib.contextmanager
def deterministic_algorithms(device: torch.device, on: bool = True) -> Iterator[None]:
    """Deterministic cuDNN kernels on CUDA while ``on`` (the CPU is deterministic already)."""
    if device.type == "cuda" and on:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            yield
    else:
        yield


def effective_precision(precision: str, device: torch.device) -> Precision:
    """The arithmetic that ``precision`` gives on ``device``: TF32 exists on CUDA only."""
    for known in PRECISIONS:
        if precision == known:
            return "fp32" if known == "tf32" and device.type != "cuda" else known
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")


@contextlib.contextmanager
def compute_precision(device: torch.device, precision: Precision) -> Iterator[None]:
    """The arithmetic of the passes run inside: a task's inner loop and its query pass.

    * ``fp32``: torch's defaults, unchanged (on CUDA torch lets cuDNN's convolutions use TF32:
      ``torch.backends.cudnn.allow_tf32`` is True by default, and ``deterministic_algorithms``
      keeps it; matrix products stay float32);
    * ``tf32``: on CUDA the matrix products (the linear head) too; elsewhere float32;
    * ``bf16``: ``torch.autocast`` to bfloat16: convolutions and matrix products take bfloat16
      operands and accumulate in float32; the losses, softmax and norms run in float32
      (autocast's float32 list), and every gradient with respect to a float32 parameter comes
      back float32.

    Autocast is thread-local: a worker thread enters its own (maml.py does, per task). The
    clip is never computed in here: callers cast each task's gradient to the parameters' dtype
    (float32 or better) before its norm.
    """
    chosen = effective_precision(precision, device)
    if chosen == "bf16":
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield
    elif chosen == "tf32":
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
    else:
        yield
