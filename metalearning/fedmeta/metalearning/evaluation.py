"""Evaluation on held-out tasks: adapt from the meta-parameters, score each task's query set.

Scores are query accuracy or MSE after the inner loop (``InnerLoop``), with a bootstrap interval
and a count of tasks the adaptation made worse by more than ``DIVERGENCE_FACTOR``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmeta.metalearning.execution import (
    Forward,
    GradientMethod,
    Params,
    as_params,
    default_chunk,
    deterministic_algorithms,
    loop_forward,
    loss_function,
    num_tasks,
    resolve_device,
    resolve_method,
    task_chunks,
)
from fedmeta.metalearning.maml import InnerLoop, Metric, adapt, func_inner
from fedmeta.metalearning.tasks import Task


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
    adapted = func_inner(model, loss_fn, inner, detach=True)

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
    meth = resolve_method(model, dev, method, num_tasks(tasks))
    chunk = chunk_size or default_chunk(meth, dev, model, tasks, 0)
    model = model.to(dev)
    p = as_params(model, params, dev)
    loss_fn = loss_function(model)
    metric: Metric = "mse" if getattr(model, "loss_kind", "ce") == "mse" else "accuracy"
    scores: list[Tensor] = []
    forward = loop_forward(model, dev)
    with deterministic_algorithms(dev):
        for _, batch in task_chunks(tasks, chunk):
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
    if num_tasks(tasks) == 0:
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
