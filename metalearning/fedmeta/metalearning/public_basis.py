"""The directions public task gradients take: the basis of private training in a subspace.

Gradient embedding perturbation (Yu, Zhang, Chen, Yin, Liu 2021, "Do not let privacy overbill
utility", Algorithm 1) and projected DP-SGD (Zhou, Wu, Banerjee 2021, "Bypassing the ambient
dimension", Algorithm 1) estimate the subspace the private gradients live in from gradients on
public data: here the clipped per-task MAML gradients of public tasks at the current
meta-parameters, whose top right singular vectors span the subspace (their "anchor" gradients).

:func:`public_gradient_basis` returns an ``[d, k]`` float64 matrix with orthonormal columns. It is a
function of the public tasks and the parameters it is given only; the server calls it with the
released (noisy) model, so it costs no privacy (server/fedmeta/server/subspace.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fedmeta.metalearning.maml import per_task_grads
from fedmeta.metalearning.tasks import Task

__all__ = ["clipped_grads", "public_gradient_basis", "top_directions"]

#: Columns of the gradient matrix taken at a time into float64 (bounds the extra memory).
_BLOCK = 8192


def clipped_grads(
    model: nn.Module,
    params: Tensor,
    tasks: Task,
    *,
    clip: float,
    coordinates: Tensor | None,
    inner: Mapping[str, Any],
    device: str = "cpu",
) -> Tensor:
    """``[n, d]`` float32 per-task MAML gradients on ``device``, each clipped to L2 norm ``clip``.

    ``inner``: the training inner loop (``inner_steps``, ``inner_lr``, ``first_order`` and the
    guards), so the public gradients are those the participants' rows are.
    """
    grads = per_task_grads(model, params, tasks, device=device, coordinates=coordinates, **inner)
    norms = torch.linalg.vector_norm(grads.to(torch.float64), dim=1)
    scale = torch.clamp(clip / norms.clamp_min(1e-300), max=1.0)
    return grads * scale.to(grads.dtype)[:, None]


def top_directions(rows: Tensor, k: int) -> Tensor:
    """The top ``k`` right singular vectors of ``rows`` (``[n, d]``), as ``[d, k]`` float64 columns.

    Through the ``n x n`` Gram matrix (``n`` is the number of public tasks, far below ``d``): its
    eigenvectors ``w_j`` give ``v_j = rows^T w_j / sqrt(lambda_j)``; a QR factorisation then makes
    the columns orthonormal to working precision whatever the spectrum (a direction of a tiny or
    zero singular value is inaccurate, never harmful: the privacy argument needs orthonormal
    columns only, and the server measures how far from orthonormal they are).
    """
    n, d = rows.shape
    if not 1 <= k <= min(n, d):
        raise ValueError(f"k must be in [1, min(tasks, dimension) = {min(n, d)}]; got {k}")
    # On the rows' device: on a GPU the Gram product (n^2 d float64 multiply-adds) takes well
    # under a second, where the host needs tens of seconds for 1000 public tasks.
    gram = torch.zeros((n, n), dtype=torch.float64, device=rows.device)
    for start in range(0, d, _BLOCK):
        block = rows[:, start : start + _BLOCK].to(torch.float64)
        gram += block @ block.T
    values, vectors = torch.linalg.eigh(gram)  # ascending
    top = torch.flip(vectors[:, -k:], dims=[1])
    scale = torch.flip(values[-k:], dims=[0]).clamp_min(torch.finfo(torch.float64).tiny).rsqrt()
    basis = torch.empty((d, k), dtype=torch.float64, device=rows.device)
    for start in range(0, d, _BLOCK):
        block = rows[:, start : start + _BLOCK].to(torch.float64)
        basis[start : start + _BLOCK] = (block.T @ top) * scale
    if not bool(torch.isfinite(basis).all()):
        raise ValueError("the public gradients are not finite: no basis can be computed from them")
    q: Tensor = torch.linalg.qr(basis).Q
    return q


def public_gradient_basis(
    model: nn.Module,
    params: Tensor,
    tasks: Task,
    k: int,
    *,
    clip: float,
    coordinates: Tensor | None,
    inner: Mapping[str, Any],
    device: str = "cpu",
) -> Tensor:
    """``[d, k]`` orthonormal float64 columns (on the host) spanning ``tasks``' top gradients.

    Computed on ``device``. The gradients are clipped to ``clip`` first (as the participants'
    are), so no public task outweighs the others in the basis.
    """
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0; got {clip}")
    rows = clipped_grads(model, params, tasks, clip=clip, coordinates=coordinates, inner=inner,
                         device=device)  # fmt: skip
    return top_directions(rows, k).cpu()
