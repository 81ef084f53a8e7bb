"""One round's dominating pair (a ``RoundModel``) and its hockey-stick curves, vectorised.

The derivation of each pair is in ``composition``'s module docstring; the curves are the closed
forms of dp-accounting's ``GaussianPrivacyLoss`` (sensitivity 1), evaluated over arrays.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from fedmeta.accounting.schemes import (
    REPLACE_ONE,
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    Unit,
    check_unit,
)

if TYPE_CHECKING:
    # dp-accounting and scipy load where they compute (about 1.5 s), not with the package: the
    # ``fedmeta`` command's registration and a participant import accounting names only.
    from dp_accounting.pld import privacy_loss_mechanism as plm


#: ``add_remove``: Poisson-subsampled Gaussian pair, remove and add PLDs; ``replace``: the symmetric
#: REPLACE pair of Poisson sampling; ``wor_replace``: the symmetrised pair of sampling without
#: replacement under replace-one.
Pair: TypeAlias = Literal["add_remove", "replace", "wor_replace"]


Floats: TypeAlias = npt.NDArray[np.float64]


#: Accepted noise multipliers (a range of the accountant).
NOISE_MULTIPLIER_RANGE: tuple[float, float] = (1e-4, 1e6)


@dataclass(frozen=True)
class RoundModel:
    """One round's dominating pair: ``(1 - weight) * [no loss] + weight * pair(rate, sigma)``.

    ``sigma`` is the noise standard deviation in units of the pair's sensitivity (``C`` for the
    Poisson pairs, ``2C`` for the substitution inside a fixed-size sample). ``sample_size`` and
    ``population`` are the integer sizes of a without-replacement stage (its RDP needs them).
    """

    weight: float
    rate: float
    sigma: float
    pair: Pair
    sample_size: int | None = None
    population: int | None = None


ModelGroups: TypeAlias = tuple[tuple[RoundModel, int], ...]


def check_noise(z: float) -> None:
    """Refuse a noise multiplier outside ``NOISE_MULTIPLIER_RANGE`` (the accountant's range)."""
    low, high = NOISE_MULTIPLIER_RANGE
    if not low <= z <= high:
        raise ValueError(f"noise_multiplier must be in [{low:g}, {high:g}]; got {z!r}")


def round_components(event: GaussianRound, unit: Unit = "task") -> RoundModel:
    """Return the dominating pair of one round of ``event`` (derived in the module docstring)."""
    check_unit(unit)
    scheme = event.scheme
    z = float(event.noise_multiplier)
    check_noise(z)
    if unit == "participant":
        if not isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme):
            raise ValueError(
                "unit must be 'task' for single-stage schemes (they have no participants); "
                f"got {unit!r} with {type(scheme).__name__}"
            )
        cap = event.participant_cap
        if cap is None:
            raise ValueError(
                "max_tasks_per_participant must be set for participant-level accounting with a "
                "Poisson stage 2 (the server's cap on one participant's tasks per round); got None"
            )
        # Fixed-size stage 1: substitution of a participant moves the sum by up to 2 * cap * C.
        return RoundModel(1.0, scheme.participant_rate, z / (2.0 * cap), "add_remove")
    replace = event.neighbouring == REPLACE_ONE
    poisson_pair: Pair = "replace" if replace else "add_remove"
    if isinstance(scheme, TwoStagePoissonScheme):
        return RoundModel(scheme.participant_rate, float(scheme.task_rate), z, poisson_pair)
    if isinstance(scheme, FlatPoissonScheme):
        return RoundModel(1.0, float(scheme.rate), z, poisson_pair)
    if isinstance(scheme, TwoStageFixedScheme):
        weight, m, n = scheme.participant_rate, scheme.tasks_per_round, scheme.min_tasks
    elif isinstance(scheme, FixedSizeScheme):
        weight, m, n = 1.0, scheme.sample_size, scheme.population
    else:  # pragma: no cover - GaussianRound validates the scheme type
        raise AssertionError(f"unreachable scheme {scheme!r}")
    if replace:
        return RoundModel(weight, m / n, z / 2.0, "wor_replace", m, n)
    return RoundModel(weight, m / n, z / 2.0, "add_remove")


_Direction: TypeAlias = Literal["remove", "add", "replace"]


@functools.lru_cache(maxsize=512)
def _mechanism(direction: _Direction, sigma: float, rate: float) -> plm.GaussianPrivacyLoss:
    from dp_accounting.pld import privacy_loss_mechanism as plm

    return plm.GaussianPrivacyLoss(
        sigma, sensitivity=1.0, sampling_prob=rate, adjacency_type=_adjacency(direction)
    )


def _adjacency(direction: _Direction) -> plm.AdjacencyType:
    from dp_accounting.pld import privacy_loss_mechanism as plm

    return {
        "remove": plm.AdjacencyType.REMOVE,
        "add": plm.AdjacencyType.ADD,
        "replace": plm.AdjacencyType.REPLACE,
    }[direction]


def _inverse_loss(direction: _Direction, sigma: float, q: float, eps: Floats) -> Floats:
    """The output ``x`` at which the privacy loss equals ``eps`` (dp-accounting's conventions).

    Closed forms of ``GaussianPrivacyLoss.inverse_privacy_loss`` (sensitivity 1), vectorised:
    dp-accounting evaluates them one epsilon at a time, which dominated the cost of a PLD.
    """
    s2 = sigma * sigma
    if direction == "replace":
        if q == 1.0:
            return -eps * s2 / 2.0
        log_alpha = 0.5 / s2 + math.log1p(-q) - math.log(q)
        half = np.abs(eps) / 2.0
        log_sinh = half + np.log1p(-np.exp(-2.0 * half)) - math.log(2.0)
        la = log_alpha + log_sinh
        asinh = -np.sign(eps) * np.logaddexp(0.5 * np.logaddexp(0.0, 2.0 * la), la)
        return np.where(eps == 0.0, 0.0, s2 * (asinh - eps / 2.0))
    signed = eps if direction == "remove" else -eps
    # Loss without subsampling: log(1 + (e^eps - 1) / q) = eps + log(1 - (1 - q) e^-eps) - log q.
    plain = signed if q == 1.0 else signed + np.log1p(-(1.0 - q) * np.exp(-signed)) - math.log(q)
    if direction == "remove":
        return -0.5 - plain * s2
    return 0.5 + plain * s2


def _stage_deltas(direction: _Direction, sigma: float, q: float, eps: Floats) -> Floats:
    """Exact ``delta(eps)`` of one Gaussian pair (``GaussianPrivacyLoss.get_delta_for_epsilon``)."""
    mech = _mechanism(direction, sigma, q)
    out = np.zeros_like(eps)
    if q == 1.0 or direction == "replace":
        inside = np.ones(eps.shape, dtype=bool)
    elif direction == "add":
        inside = eps < -math.log1p(-q)  # above -log(1 - q) the add pair has delta 0
    else:
        inside = eps > math.log1p(-q)
        out[~inside] = -np.expm1(eps[~inside])  # below log(1 - q) the remove pair has 1 - e^eps
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        x = _inverse_loss(direction, sigma, q, eps[inside])
        upper = np.asarray(mech.mu_upper_cdf(x), dtype=np.float64)
        lower = np.asarray(mech.mu_lower_log_cdf(x), dtype=np.float64)
        out[inside] = upper - np.exp(eps[inside] + lower)
    return np.clip(out, 0.0, 1.0)


def _no_loss_deltas(eps: Floats) -> Floats:
    """``delta(eps)`` of a point mass at loss 0 (the unsampled branch): ``(1 - e^eps)_+``."""
    return -np.expm1(np.minimum(eps, 0.0))


def pair_curves(model: RoundModel) -> list[tuple[Callable[[Floats], Floats], float, float]]:
    """``[(delta(eps), lowest, highest loss)]``: one entry per PMF (two for add/remove)."""
    sigma, q, w = model.sigma, model.rate, model.weight

    def mixed(stage: Callable[[Floats], Floats]) -> Callable[[Floats], Floats]:
        if w >= 1.0:
            return stage
        return lambda eps: w * stage(eps) + (1.0 - w) * _no_loss_deltas(eps)

    def bounds(direction: _Direction) -> tuple[float, float]:
        b = _mechanism(direction, sigma, q).connect_dots_bounds()
        return float(b.epsilon_lower), float(b.epsilon_upper)

    if model.pair == "replace":
        lo, hi = bounds("replace")
        return [(mixed(lambda e: _stage_deltas("replace", sigma, q, e)), lo, hi)]
    if model.pair == "wor_replace":
        lo, hi = bounds("remove")
        top = max(hi, -lo)

        def symmetric(eps: Floats) -> Floats:
            # delta_remove above 0; the mirror image 1 - e^eps + e^eps delta_remove(-eps) below.
            pos = _stage_deltas("remove", sigma, q, np.abs(eps))
            neg = np.minimum(eps, 0.0)
            return np.where(eps >= 0.0, pos, -np.expm1(neg) + np.exp(neg) * pos)

        return [(mixed(symmetric), -top, top)]
    lo, hi = bounds("remove")
    curves = [(mixed(lambda e: _stage_deltas("remove", sigma, q, e)), lo, hi)]
    if q < 1.0:  # at q = 1 the add and remove PLDs of the Gaussian coincide
        lo, hi = bounds("add")
        curves.append((mixed(lambda e: _stage_deltas("add", sigma, q, e)), lo, hi))
    return curves
