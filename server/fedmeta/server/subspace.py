"""Private rounds in a subspace learned from public data (``privacy.subspace``).

Gradient embedding perturbation (Yu, Zhang, Chen, Yin, Liu 2021, "Do not let privacy overbill
utility: gradient embedding perturbation for private learning", ICLR 2021) and projected DP-SGD
(Zhou, Wu, Banerjee 2021, "Bypassing the ambient dimension: private SGD with gradient subspace
identification", ICLR 2021): at lot 100 the noise on the averaged gradient has norm about ``z C
sqrt(d) / lot`` over all ``d`` trained parameters, far above the signal (docs/results.md); in ``k``
dimensions it has ``z C sqrt(k) / lot``, and public gradients say which ``k`` directions keep most
of the signal (bench/subspace.py measured 97% at ``k = 64``).

A round with a subspace ``U`` (``[d, k]``, orthonormal columns: :class:`Subspace`):

1. the server's re-checked sum ``s`` of clipped rows, as always, is shrunk onto the ball of radius
   ``B = normaliser * C`` (a public bound; a sum of tasks each within C reaches it only when more
   than the expected lot's worth of them point the same way);
2. projected to ``k`` coordinates ``U^T s``, and the round's Gaussian noise is added there, on the
   release grid, from the same CSPRNG path (server/fedmeta/server/noise.py), which returns the
   round's event;
3. mapped back, ``U y``, then divided by the normaliser and stepped as today. What lies outside the
   subspace, ``(I - U U^T) s``, is **dropped**: it is never released.

**Accounting.** The release is ``y = U^T s + N(0, (z Delta)^2 I_k)``. For orthonormal columns
``||U^T g|| <= ||g|| <= C``, and the ball's projection moves no two sums further apart, so adding
or removing one task moves ``U^T s`` by at most C: the round is the Gaussian event of noise
multiplier ``z`` at sensitivity C that the ledger already composes, one release per round.
``Delta`` (:func:`projection_sensitivity`) is C raised by what floating point can add: the columns'
distance from orthonormal, measured, and the rounding of the ball's scaling and of the products
``U^T s`` (Higham 2002, Accuracy and Stability of Numerical Algorithms, section 3.1: a computed
dot product of length ``d`` errs by at most ``gamma_d sum |u_i||x_i|``, ``gamma_d = d u / (1 - d
u)``), which the shrinking onto the ball makes public. Drawing ``z Delta`` instead of ``z C`` errs
on the safe side (a factor ``1 + 1e-7`` at this CPU scale). The basis is a function of the public
tasks and of the released model only (post-processing): it costs nothing.

The basis is recomputed every ``refresh_every`` rounds at the released model
(:class:`PublicSubspace`); a resumed run computes it again at its resumed model.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedmeta.config import Config
from fedmeta.config_privacy import SubspaceConfig
from fedmeta.server.recheck import clip_margin

log = logging.getLogger("fedmeta.server")

#: Unit roundoff of float64.
UNIT_ROUNDOFF = 2.0**-53
#: Seed salt and task path of the basis's public tasks: apart from every other task builder's.
_BASIS_SALT = 0x5EED_0071
_BASIS_PATH = 0x5B5A


def gamma(n: int) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of ``n`` float64 steps."""
    nu = n * UNIT_ROUNDOFF
    if not nu < 0.5:
        raise ValueError(f"n = {n} is too long a computation for float64 error bounds")
    return nu / (1.0 - nu)


def projection_sensitivity(clip: float, *, d: int, k: int, defect: float, bound: float) -> float:
    """``Delta``: how far one task can move the computed ``U^T shrink_B(s)``; at least ``clip``.

    With ``sigma = ||U||_2 <= sqrt((1 + defect) / (1 - k gamma_d))`` (``defect`` bounds the
    Frobenius norm of ``U^T U - I`` as computed, whose own rounding ``k gamma_d sigma^2`` the
    denominator takes), ``m`` the re-check's margin and ``B = bound``:

    * the exact ball projection moves two sums at most ``||s - s'|| <= C`` apart, and the computed
      shrinking is within ``B (m + 2 gamma_{d+6})`` of it (the norm, the scale, the products);
    * each computed coordinate of ``U^T x`` (``||x|| <= B``) errs by at most ``gamma_d sigma B``
      (Higham 2002, eq. 3.5, any order of summation), ``sqrt(k)`` of them;

    so ``Delta = sigma (C + 2 B (m + 2 gamma_{d+6}) + 2 sqrt(k) gamma_d B)``: every term rounds up.
    """
    if not (math.isfinite(clip) and clip > 0 and math.isfinite(bound) and bound > 0):
        raise ValueError(f"clip and bound must be finite numbers > 0; got {clip}, {bound}")
    if not (math.isfinite(defect) and 0 <= defect < 1):
        raise ValueError(f"defect must be in [0, 1): the basis is far from orthonormal; {defect}")
    sigma = math.sqrt((1.0 + defect) / (1.0 - k * gamma(d)))
    shrink = bound * (clip_margin(d) + 2.0 * gamma(d + 6))
    products = math.sqrt(k) * gamma(d) * bound
    return sigma * (clip + 2.0 * shrink + 2.0 * products)


def shrink_to_ball(total: Tensor, bound: float) -> Tensor:
    """``total`` scaled onto the ball of radius ``bound`` when it is outside (float64, a copy).

    The scale carries the re-check's margin, so the computed result is within the ball.
    """
    out = total.detach().to(torch.float64).clone()
    norm = float(torch.linalg.vector_norm(out))
    limit = bound * (1.0 - clip_margin(out.numel()))
    if not math.isfinite(norm):
        raise ValueError("the round's sum is not finite; the re-check should have zeroed it")
    if norm > limit:
        out *= limit / norm
    return out


@dataclass(frozen=True)
class Subspace:
    """An orthonormal basis ``[d, k]`` (float64), how far from orthonormal, and its round."""

    basis: Tensor
    defect: float  # bounds ||U^T U - I||_F, the computation's own rounding included
    round: int  # 0-based index of the round at whose start it was computed

    @classmethod
    def of(cls, basis: Tensor, round_index: int) -> Subspace:
        """Measure ``basis``'s distance from orthonormal (rounded up: twice, plus ``k u``)."""
        u = basis.detach().to(torch.float64).contiguous()
        if u.ndim != 2 or not 1 <= u.shape[1] <= u.shape[0]:
            raise ValueError(f"a basis is [d, k] with 1 <= k <= d; got shape {tuple(u.shape)}")
        eye = torch.eye(u.shape[1], dtype=torch.float64)
        measured = float(torch.linalg.matrix_norm(u.T @ u - eye))
        if not measured < 0.5:  # checked here, before the round's spend, not at its release
            raise ValueError(f"the basis is not orthonormal (||U^T U - I||_F = {measured:.3g})")
        return cls(u, 2.0 * measured + u.shape[1] * UNIT_ROUNDOFF, round_index)

    @property
    def dimension(self) -> int:
        """``k``: the coordinates a round releases."""
        return int(self.basis.shape[1])

    def sensitivity(self, clip: float, bound: float) -> float:
        """``Delta`` of :func:`projection_sensitivity` for this basis."""
        d, k = self.basis.shape
        return projection_sensitivity(clip, d=int(d), k=int(k), defect=self.defect, bound=bound)

    def project(self, total: Tensor, clip: float, bound: float) -> tuple[Tensor, float]:
        """``U^T shrink_B(total)`` (``k`` values to release) and the sensitivity to noise it at."""
        return self.basis.T @ shrink_to_ball(total, bound), self.sensitivity(clip, bound)

    def lift(self, coordinates: Tensor) -> Tensor:
        """``U y``: the released coordinates back in parameter space (post-processing)."""
        return self.basis @ coordinates.to(torch.float64)

    def restrict(self, vector: Tensor) -> Tensor:
        """``U U^T v``: a non-private run's mean, confined to the subspace the private one uses."""
        return self.lift(self.basis.T @ vector.to(torch.float64))


class PublicSubspace:
    """The run's current subspace, recomputed every ``refresh_every`` rounds at the released model.

    ``compute(params, round_index)`` returns a ``[d, k]`` basis from public data and ``params``
    alone (:func:`public_subspace` builds it from the workload).
    """

    def __init__(self, refresh_every: int, compute: Callable[[Tensor, int], Tensor]) -> None:
        """Nothing is computed until the first round asks (:meth:`at`)."""
        self.refresh_every = refresh_every
        self._compute = compute
        self.current: Subspace | None = None

    def at(self, params: Tensor, round_index: int) -> Subspace:
        """The subspace of round ``round_index``; a new one at every refresh (and on resume)."""
        due = round_index % self.refresh_every == 0
        if self.current is None or (due and self.current.round != round_index):
            started = time.perf_counter()
            self.current = Subspace.of(self._compute(params, round_index), round_index)
            # Public work on the released model: its time says nothing private.
            seconds = time.perf_counter() - started
            log.info("subspace basis (k = %d) for round %d computed in %.1f s",
                     self.current.dimension, round_index + 1, seconds)  # fmt: skip
        return self.current


def public_subspace(cfg: Config, workload: Any) -> PublicSubspace | None:
    """The run's :class:`PublicSubspace` (None: ``privacy.subspace.dimension`` is unset).

    The basis tasks are drawn from the workload's public classes only, with seeds of their own
    per refresh; the gradients use the training inner loop and ``privacy.clip``.
    """
    settings = cfg.privacy.subspace
    k = settings.dimension
    if k is None:
        return None
    if workload.public_classes is None:  # the configuration refuses this; a workload may not
        raise ValueError("privacy.subspace.dimension needs public data: set public.warm_start")
    if k > workload.trained_dim:
        raise ValueError(
            f"privacy.subspace.dimension = {k} exceeds the {workload.trained_dim} trained "
            "parameters (training.trained_parameters): lower it, or unset it for the full space"
        )
    from fedmeta.adaptation import inner_kwargs
    from fedmeta.metalearning import sample_tasks
    from fedmeta.metalearning.public_basis import public_gradient_basis

    ds = cfg.dataset
    inner = {**inner_kwargs(cfg.training, evaluation=False),
             "first_order": cfg.training.first_order}  # fmt: skip
    seed = (cfg.seed * 1_000_003 + _BASIS_SALT) % (2**63)
    # The accelerator when there is one (public work, any device will do), unless told the host.
    device = "cpu" if cfg.federation.client_device == "cpu" else "auto"

    def compute(params: Tensor, round_index: int) -> Tensor:
        tasks = sample_tasks(workload.public_classes, n_way=ds.ways, k_shot=ds.shots,
                             q_query=ds.query, n_tasks=settings.basis_tasks, seed=seed,
                             path=(_BASIS_PATH, round_index))  # fmt: skip
        return public_gradient_basis(
            workload.model, params, tasks, k, clip=cfg.privacy.clip,
            coordinates=workload.trained_coordinates, inner=inner, device=device,
        )  # fmt: skip

    return PublicSubspace(settings.refresh_every, compute)


def subspace_summary(subspace: SubspaceConfig) -> dict[str, Any] | None:
    """``summary.json``'s ``subspace`` entry (None: the run trained in the full space)."""
    if subspace.dimension is None:
        return None
    return {
        "dimension": subspace.dimension,
        "refresh_every": subspace.refresh_every,
        "basis_tasks": subspace.basis_tasks,
        "basis": "top right singular vectors of clipped MAML gradients of public tasks at the "
        "released model (Yu et al. 2021; Zhou et al. 2021)",
        "residual": "dropped",
    }


def subspace_line(subspace: SubspaceConfig) -> str | None:
    """The plan's line on the subspace (None: the full space)."""
    if subspace.dimension is None:
        return None
    return (
        f"subspace (Yu et al. 2021; Zhou et al. 2021): noise on k = {subspace.dimension} "
        f"coordinates, the top directions of {subspace.basis_tasks} PUBLIC task gradients at the "
        f"released model, recomputed every {subspace.refresh_every} rounds; the residual outside "
        "it is dropped"
    )
