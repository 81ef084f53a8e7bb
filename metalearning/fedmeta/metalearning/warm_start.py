"""A public warm start: non-private MAML on declared public classes before private training.

Public pre-training is the regime in which DP few-shot learning does best (Tobaben et al. 2023,
"On the efficacy of differentially private few-shot image classification"), provided the public
data shares nothing with the private data. :func:`public_warm_start` refuses public classes that
are also meta-train, validation or meta-test classes (by name), then runs :func:`meta_train` on
tasks drawn from the public classes alone. Nothing private is read, so it spends no budget.

Pre-training is the same computation for every run of the same settings (it reads public data and
public seeds only), so :func:`public_warm_start` can keep its result in a cache folder, keyed by
everything it is a function of (:func:`warm_start_key`); repeated runs then start at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from fedmeta.metalearning.errors import DataError
from fedmeta.metalearning.execution import (
    GradientMethod,
    Params,
    as_params,
    resolve_device,
)
from fedmeta.metalearning.images import ClassDataset
from fedmeta.metalearning.maml import per_task_clipped_grads
from fedmeta.metalearning.models import flatten_params, param_spec
from fedmeta.metalearning.tasks import Task, check_task_shape, sample_tasks

__all__ = ["WarmStart", "check_disjoint", "public_warm_start"]

#: Seed path of the pre-training tasks, apart from every other task builder's.
_PRETRAIN_PATH = 0x9B11C


@dataclass(frozen=True)
class WarmStart:
    """How to pre-train: meta-steps, public tasks per step, Adam's rate, and the inner loop."""

    steps: int
    tasks_per_step: int
    meta_lr: float
    inner_steps: int
    inner_lr: float
    first_order: bool
    inner_grad_clip: float = math.inf  # the training inner loop's guards (InnerLoop)
    step_check: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or self.tasks_per_step < 1 or not self.meta_lr > 0:
            raise ValueError(f"steps, tasks_per_step >= 1 and meta_lr > 0; got {self}")


def check_disjoint(public: ClassDataset, private: Sequence[ClassDataset]) -> None:
    """Raise DataError if a public class is also a participant's or a held-out class (by name)."""
    shared: set[str] = set()
    for ds in private:
        shared |= set(public.names) & set(ds.names)
    if shared:
        few = ", ".join(sorted(shared)[:5])
        raise DataError(
            f"public.warm_start: {len(shared)} public classes are also private or held-out "
            f"classes ({few}{', ...' if len(shared) > 5 else ''}); the public data must be "
            "disjoint from the participants' and the test data"
        )


def public_warm_start(
    model: nn.Module,
    params: Tensor,
    public: ClassDataset,
    how: WarmStart,
    *,
    n_way: int,
    k_shot: int,
    q_query: int,
    seed: int,
    cache_dir: Path | None = None,
) -> Tensor:
    """``params`` (flat) after ``how.steps`` non-private MAML steps on ``public``'s tasks.

    Task ``i`` of step ``s`` is a pure function of ``(seed, s, i)``; the result is flat float32
    on the CPU, like the initial parameters it replaces. With ``cache_dir`` the result is read
    from there when the same warm start (:func:`warm_start_key`) was computed before, else
    computed and written there; a missing, unreadable or wrong-sized file is recomputed.
    """
    path = None
    if cache_dir is not None:
        key = warm_start_key(model, params, public, how, (n_way, k_shot, q_query), seed)
        path = cache_dir / f"warm-start-{key}.npy"
        cached = _read_cached(path, params.shape)
        if cached is not None:
            return cached
    check_task_shape(public, np.arange(public.n_classes), n_way, k_shot + q_query)

    def batch(step: int) -> Task:
        return sample_tasks(public, n_way=n_way, k_shot=k_shot, q_query=q_query,
                            n_tasks=how.tasks_per_step, seed=seed,
                            path=(_PRETRAIN_PATH, step))  # fmt: skip

    trained = meta_train(
        model,
        params,
        batch,
        steps=how.steps,
        meta_lr=how.meta_lr,
        inner_steps=how.inner_steps,
        inner_lr=how.inner_lr,
        first_order=how.first_order,
        inner_grad_clip=how.inner_grad_clip,
        step_check=how.step_check,
    )
    result = flatten_params(trained).detach().to("cpu", torch.float32).contiguous()
    if path is not None:
        _write_cached(path, result)
    return result


#: Bump when pre-training changes in a way its inputs do not show, so old results are not reused.
_CACHE_VERSION = 1


def warm_start_key(
    model: nn.Module, params: Tensor, public: ClassDataset, how: WarmStart, shape: tuple[int, ...],
    seed: int,
) -> str:  # fmt: skip
    """A digest of everything :func:`public_warm_start` computes from, and of where it runs.

    The device and torch's version are in it: pre-training is bitwise-repeatable on one device and
    version, not across them.
    """
    h = hashlib.sha256()
    for part in (
        f"v{_CACHE_VERSION}", type(model).__name__, repr(param_spec(model)),
        repr(dataclasses.astuple(how)), repr(shape), str(seed), torch.__version__,
        resolve_device("auto").type, repr(public.names), repr(public.offsets.tolist()),
    ):  # fmt: skip
        h.update(part.encode() + b"\0")
    h.update(params.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    h.update(public.images.contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def _read_cached(path: Path, shape: torch.Size) -> Tensor | None:
    """The cached warm start at ``path``, or None if it is not there or not readable as one."""
    try:
        cached = torch.from_numpy(np.load(path, allow_pickle=False))
    except (OSError, ValueError):
        return None  # not there yet, or damaged: computed again
    return cached if cached.shape == shape and cached.dtype == torch.float32 else None


def _write_cached(path: Path, params: Tensor) -> None:
    """Write ``params`` to ``path`` atomically; a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, params.numpy())
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the next run the pre-training again


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
    p = as_params(model, params, dev)
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
