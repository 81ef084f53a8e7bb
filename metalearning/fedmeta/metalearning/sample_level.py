"""Sample-level DP-MAML's per-task computation (issue 53; DP-MAML, Algorithm 2), first order.

For each task (support set ``S``, query set ``Q``, padded with masks: :class:`~metalearning.
example_slots.MaskedTasks`) and meta-parameters ``phi``:

    theta <- phi;  repeat K times:                                            (inner DP-SGD)
        g_j   <- grad_theta l(theta; s_j) * min(1, C_in / ||grad||)          for each s_j in S
        theta <- theta - alpha * (sum_j g_j + N(0, (z_in C_in)^2 I)) / n     (n public)
    h_i <- grad_theta l(theta; q_i) * min(1, C_out / ||grad||)               for each q_i in Q
    returned: sum_i h_i per task, and every pre-clip norm (private diagnostics)

This is exactly the mechanism ``accounting.sample_level.SampleLevelRound`` bounds (docs/privacy.md,
"Sample level (issue 53): the bound"): each inner step is a Gaussian mechanism of sensitivity
``C_in`` in an example that appears once in the support set; the query gradients are taken with
respect to the noisy adapted ``theta`` itself (first order), so a support example reaches them only
through ``theta``, which the bound treats as released (post-processing), and a query example moves
its task's sum by at most ``C_out``. The server adds ``N(0, (z_out C_out)^2 I)`` to the sum over
tasks (not here). Second order would differentiate through the inner steps, so one support example
would move every query gradient of its task: refused (:class:`SampleLevelSteps`).

Per-example gradients are ``torch.func.vmap`` over examples of ``torch.func.grad`` of one
example's loss, itself vmapped over tasks; clipping reuses ``maml.clip_by_global_norm`` (a
non-finite gradient becomes zero, which keeps the sensitivity). Each example's loss is evaluated
alone (a batch of one), so its gradient depends on no other example whatever the model; a model
with batch statistics would then normalise each example by itself, which is not the model the rest
of fedmeta trains and evaluates, so it is refused, as are Meta-SGD's learned rates (not analysed at
sample level). The noise is drawn on the host from the numpy ``Generator`` passed in (in a private
run one over a secret CSPRNG keystream, as the server's ``NoiseSource``), task by task, so the
draws do not depend on ``chunk_size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedmeta.metalearning.example_slots import MaskedTasks
from fedmeta.metalearning.execution import Params, as_params, loss_function, resolve_device
from fedmeta.metalearning.maml import clip_by_global_norm
from fedmeta.metalearning.models import inner_rates

__all__ = ["SampleLevelGrads", "SampleLevelSteps", "noisy_adapt", "per_example_clipped_grads",
           "per_example_grads", "query_gradient_rows", "query_gradient_sums",
           "sample_level_grads", "standard_normal"]  # fmt: skip

# (batched params [T, ...], x [T, n, ...], y [T, n, ...]) -> per-example flat gradients [T, n, dim]
PerExampleGrads = Callable[[Params, Tensor, Tensor], Tensor]


def _positive(name: str, value: object, *, integer: bool = False) -> None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value > 0):  # type: ignore[arg-type,operator]
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} > 0; got {value!r}")


@dataclass(frozen=True)
class SampleLevelSteps:
    """The public constants of the per-task computation (module docstring).

    ``support_size`` is the public normaliser ``n`` of an inner step (never the realised count:
    it would be private). ``inner_noise_multiplier`` is ``z_in`` (relative to ``inner_clip``).
    """

    inner_steps: int
    inner_lr: float
    inner_clip: float
    inner_noise_multiplier: float
    support_size: int
    outer_clip: float
    order: Literal["first", "second"] = "first"

    def __post_init__(self) -> None:
        if self.order != "first":
            raise ValueError(
                f"order must be 'first' at sample level (second order differentiates through the "
                f"inner steps, so one support example moves every query gradient of its task); "
                f"got {self.order!r}"
            )
        for name in ("inner_steps", "support_size"):
            _positive(name, getattr(self, name), integer=True)
        for name in ("inner_lr", "inner_clip", "inner_noise_multiplier", "outer_clip"):
            _positive(name, getattr(self, name))


@dataclass(frozen=True)
class SampleLevelGrads:
    """Per task: the sum of its clipped query gradients ``[T, dim]``; pre-clip norms.

    ``query_norms`` ``[T, Q]`` and ``support_norms`` ``[K, T, S]`` (0 on padding) are private
    diagnostics: computed from raw examples, they may be released only if accounted.
    """

    query_sums: Tensor
    query_norms: Tensor
    support_norms: Tensor


def _check_model(model: nn.Module, params: Params) -> None:
    batch_layers = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    if getattr(model, "norm", None) == "batch" or any(
        isinstance(m, batch_layers) for m in model.modules()
    ):
        raise ValueError(
            "model norm must be 'group' or 'none' at sample level (each example's gradient is "
            "computed alone, and one example's batch statistics are not the task's); got 'batch'"
        )
    if inner_rates(params) is not None:
        raise ValueError("learned inner rates (Meta-SGD) are not supported at sample level")


def per_example_grads(model: nn.Module) -> PerExampleGrads:
    """Flat gradients of each example's own loss, for a batch of tasks with their own params."""
    loss_fn = loss_function(model)

    def example_loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    def flat(p: Params, x: Tensor, y: Tensor) -> Tensor:
        g = grad(example_loss)(p, x, y)
        return torch.cat([v.reshape(-1) for v in g.values()])

    return vmap(vmap(flat, in_dims=(None, 0, 0)), in_dims=(0, 0, 0))


def per_example_clipped_grads(
    grads_of: PerExampleGrads, params: Params, x: Tensor, y: Tensor, mask: Tensor, clip: float
) -> tuple[Tensor, Tensor]:
    """Per-example gradients ``[T, n, dim]`` clipped to ``clip``, zero on padding; pre-clip norms.

    ``clip = math.inf`` skips the clipping (a negative control for tests, never a private path).
    """
    g = grads_of(params, x, y)
    t, n, dim = g.shape
    clipped, norms = clip_by_global_norm(g.reshape(t * n, dim), clip, nonfinite="zero")
    keep = mask.reshape(t * n, 1)
    clipped = torch.where(keep, clipped, torch.zeros_like(clipped)).reshape(t, n, dim)
    norms = torch.where(keep[:, 0], norms, torch.zeros_like(norms)).reshape(t, n)
    return clipped, norms


def _unflat(flat: Tensor, like: Params) -> Params:
    """``[T, dim]`` -> ``{name: [T, *shape]}`` in ``like``'s order and shapes."""
    out, start = {}, 0
    for name, v in like.items():
        size = v[0].numel()
        out[name] = flat[:, start : start + size].reshape(v.shape)
        start += size
    return out


def standard_normal(rng: np.random.Generator, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Standard normals drawn on the host from ``rng`` (float64), in ``like``'s dtype and device."""
    draw = rng.standard_normal(shape)
    return torch.from_numpy(draw).to(device=like.device, dtype=like.dtype)


def noisy_adapt(
    grads_of: PerExampleGrads,
    params: Params,
    tasks: MaskedTasks,
    steps: SampleLevelSteps,
    rng: np.random.Generator,
) -> tuple[Params, Tensor]:
    """Each task's noisy adapted parameters ``{name: [T, ...]}`` and ``support_norms [K, T, S]``.

    The noise of all ``K`` steps of task ``t`` is drawn before task ``t + 1``'s (``[T, K, dim]``
    in one draw), so a task's noise does not depend on how the tasks are chunked.
    """
    t = tasks.num_tasks
    theta = {n: v.unsqueeze(0).expand(t, *v.shape) for n, v in params.items()}
    dim = sum(v.numel() for v in params.values())
    noise = standard_normal(rng, (t, steps.inner_steps, dim), next(iter(params.values())))
    sigma = steps.inner_noise_multiplier * steps.inner_clip
    norms = []
    for k in range(steps.inner_steps):
        g, nrm = per_example_clipped_grads(
            grads_of, theta, tasks.support_x, tasks.support_y, tasks.support_mask, steps.inner_clip
        )
        noisy = (g.sum(dim=1) + sigma * noise[:, k]) / steps.support_size
        update = _unflat(noisy, theta)
        theta = {n: theta[n] - steps.inner_lr * update[n] for n in theta}
        norms.append(nrm)
    return theta, torch.stack(norms)


def query_gradient_sums(
    grads_of: PerExampleGrads, adapted: Params, tasks: MaskedTasks, outer_clip: float
) -> tuple[Tensor, Tensor]:
    """Per task, the sum of its query examples' gradients at ``adapted`` clipped to ``outer_clip``.

    Returns ``(sums [T, dim], pre-clip norms [T, Q])``. ``adapted`` enters as a constant: the
    gradient is with respect to it (first order), never through the inner loop.
    """
    adapted = {n: v.detach() for n, v in adapted.items()}
    g, norms = per_example_clipped_grads(
        grads_of, adapted, tasks.query_x, tasks.query_y, tasks.query_mask, outer_clip
    )
    return g.sum(dim=1), norms


def _adapted_chunks(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    tasks: MaskedTasks,
    steps: SampleLevelSteps,
    rng: np.random.Generator,
    device: str | torch.device | None,
    chunk_size: int,
) -> Iterator[tuple[PerExampleGrads, MaskedTasks, Params, Tensor]]:
    """Each chunk of ``tasks`` on the device with its noisy adapted parameters and support norms.

    The one inner loop both outputs below are computed from, so that they draw the same inner
    noise from the same ``rng``. Run it under ``torch.no_grad()``: ``torch.func.grad``
    differentiates inside; nothing else keeps a graph.
    """
    _positive("chunk_size", chunk_size, integer=True)
    dev = resolve_device(device)
    model = model.to(dev)
    p = as_params(model, params, dev)
    _check_model(model, p)
    grads_of = per_example_grads(model)
    for start in range(0, tasks.num_tasks, chunk_size):
        chunk = tasks.select(start, start + chunk_size).to(dev)
        adapted, support_norms = noisy_adapt(grads_of, p, chunk, steps, rng)
        yield grads_of, chunk, adapted, support_norms


def sample_level_grads(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    tasks: MaskedTasks,
    steps: SampleLevelSteps,
    rng: np.random.Generator,
    *,
    device: str | torch.device | None = "auto",
    chunk_size: int = 32,
) -> SampleLevelGrads:
    """The per-task computation of one round (module docstring), ``chunk_size`` tasks at a time.

    ``params`` as in ``maml.per_task_clipped_grads`` (a dict, a flat vector or None for the
    module's own); results on ``device`` in the params' dtype.
    """
    sums, q_norms, s_norms = [], [], []
    with torch.no_grad():
        for grads_of, chunk, adapted, support_norms in _adapted_chunks(
            model, params, tasks, steps, rng, device, chunk_size
        ):
            chunk_sums, chunk_norms = query_gradient_sums(
                grads_of, adapted, chunk, steps.outer_clip
            )
            sums.append(chunk_sums)
            q_norms.append(chunk_norms)
            s_norms.append(support_norms)
    return SampleLevelGrads(torch.cat(sums), torch.cat(q_norms), torch.cat(s_norms, dim=1))


def query_gradient_rows(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    tasks: MaskedTasks,
    steps: SampleLevelSteps,
    rng: np.random.Generator,
    *,
    device: str | torch.device | None = "auto",
    chunk_size: int = 32,
) -> Tensor:
    """Every query example's gradient at its task's noisy adapted parameters, clipped: ``[n, dim]``.

    The same computation as :func:`sample_level_grads` (the same inner noise from the same
    ``rng``), returning the clipped per-example rows (task-major, padding dropped) instead of
    their per-task sums, so that the server can re-check each example's row against
    ``outer_clip`` as it re-checks a task's row at task level (server/fedmeta/server/
    validation.py). Their sum is ``sample_level_grads(...).query_sums.sum(0)``.
    """
    rows = []
    with torch.no_grad():
        for grads_of, chunk, adapted, _ in _adapted_chunks(
            model, params, tasks, steps, rng, device, chunk_size
        ):
            adapted = {n: v.detach() for n, v in adapted.items()}
            g, _ = per_example_clipped_grads(
                grads_of, adapted, chunk.query_x, chunk.query_y, chunk.query_mask, steps.outer_clip
            )
            rows.append(g[chunk.query_mask])
    if rows:
        return torch.cat(rows)
    dev = resolve_device(device)
    dim = sum(v.numel() for v in as_params(model, params, dev).values())
    return torch.zeros((0, dim), dtype=torch.float32, device=dev)
