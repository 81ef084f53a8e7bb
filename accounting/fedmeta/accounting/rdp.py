"""The RDP cross-check: each round's RDP curve over dp-accounting's orders, composed and converted.

An independent, looser upper bound (``composition``'s module docstring, "RDP cross-check");
dp-accounting is imported where a curve is computed.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from fedmeta.accounting.pairs import Floats, ModelGroups, RoundModel

if TYPE_CHECKING:
    # dp-accounting and scipy load where they compute (about 1.5 s), not with the package: the
    # ``fedmeta`` command's registration and a participant import accounting names only.
    from dp_accounting import dp_event


#: RDP orders: dp-accounting's default grid (``rdp_privacy_accountant.DEFAULT_RDP_ORDERS``, spelled
#: the same way so the floats are equal; a test compares), which the reference RDP numbers use.
RDP_ORDERS: tuple[float, ...] = tuple(
    float(a)
    for a in [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)


def _sanitize(values: npt.ArrayLike) -> Floats:
    # dp-accounting turns a negative RDP value (numerical trouble) into epsilon 0: optimistic. An
    # order with a negative or NaN value is dropped instead (its bound becomes infinite).
    arr = np.asarray(values, dtype=np.float64)
    return np.where(np.isnan(arr) | (arr < 0.0), np.inf, arr)


def _rdp_of(event: dp_event.DpEvent, orders: Sequence[float], *, replace: bool = False) -> Floats:
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    relation = rdp_lib.NeighborRel.REPLACE_ONE if replace else rdp_lib.NeighborRel.ADD_OR_REMOVE_ONE
    accountant = rdp_lib.RdpAccountant(orders=list(orders), neighboring_relation=relation)
    # dp-accounting logs (via absl) when a fractional order's series does not converge and then sets
    # that order to inf, i.e. drops it: conservative, so the warning is only noise for our users.
    absl_logger = logging.getLogger("absl")
    previous = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            accountant.compose(event)
        return _sanitize(accountant._rdp)  # noqa: SLF001 - the curve, not only its epsilon
    except (OverflowError, FloatingPointError):
        return np.full(len(orders), np.inf)  # extreme noise: no finite bound, never a wrong one
    finally:
        absl_logger.setLevel(previous)


#: Orders for the without-replacement RDP bound (Wang et al. 2019, Theorem 27, computed exactly up
#: to order 256 at a cost growing like order^2; above 256 dp-accounting switches to a Stirling
#: approximation whose direction is not documented, so those orders are not used). The other
#: orders of RDP_ORDERS are dropped (set to infinity), which only loosens the bound.
_WOR_ORDERS = frozenset(
    a for a in RDP_ORDERS if a < 2 or (a.is_integer() and (a <= 64 or a == 128))
)


def _stage_rdp(model: RoundModel) -> Floats:
    from dp_accounting import dp_event

    orders = np.asarray(RDP_ORDERS)
    gaussian = dp_event.GaussianDpEvent(model.sigma)
    if model.pair == "add_remove":
        return _rdp_of(dp_event.PoissonSampledDpEvent(model.rate, gaussian), RDP_ORDERS)
    if model.pair == "replace":
        # Mironov (2017), Proposition 11 with p = q = 2, through the dataset without the task.
        poisson = dp_event.PoissonSampledDpEvent(model.rate, gaussian)
        at_2a = _rdp_of(poisson, tuple(2.0 * orders))
        at_2a_1 = _rdp_of(poisson, tuple(2.0 * orders - 1.0))
        return np.asarray((orders - 0.5) / (orders - 1.0) * at_2a + at_2a_1, dtype=np.float64)
    assert model.sample_size is not None and model.population is not None
    kept = [a for a in RDP_ORDERS if a in _WOR_ORDERS]
    wor = dp_event.SampledWithoutReplacementDpEvent(model.population, model.sample_size, gaussian)
    values = dict(zip(kept, _rdp_of(wor, kept, replace=True), strict=True))
    return np.asarray([values.get(a, np.inf) for a in RDP_ORDERS], dtype=np.float64)


@functools.lru_cache(maxsize=256)
def rdp_curve(model: RoundModel) -> tuple[float, ...]:
    """RDP of one round over ``RDP_ORDERS`` (module docstring: RDP cross-check).

    Mixture with the unsampled branch: ``E_Q[(P/Q)^a] <= (1 - w) + w E_Q2[(P2/Q2)^a]`` (joint
    convexity of ``x^a``; equality for disjoint branches), so
    ``RDP(a) <= log(1 - w + w exp((a - 1) RDP2(a))) / (a - 1)``, monotone in ``RDP2``.
    """
    stage = _stage_rdp(model)
    w = model.weight
    if w >= 1.0:
        return tuple(float(x) for x in stage)
    orders = np.asarray(RDP_ORDERS)
    with np.errstate(over="ignore", invalid="ignore"):
        mixed = np.logaddexp(math.log1p(-w), math.log(w) + (orders - 1.0) * stage) / (orders - 1.0)
    return tuple(float(x) for x in np.where(np.isinf(stage), np.inf, mixed))


def _rdp_total(groups: ModelGroups) -> Floats:
    total = np.zeros(len(RDP_ORDERS))
    for model, count in groups:
        total = total + count * np.asarray(rdp_curve(model))
    return total


def rdp_epsilon(groups: ModelGroups, delta: float) -> float:
    """The RDP epsilon at ``delta`` of all groups composed (0 for none, inf for no finite bound)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not groups:
        return 0.0
    total = _rdp_total(groups)
    if np.all(np.isinf(total)):
        return math.inf
    eps, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), total, delta)
    return float(eps)


def rdp_delta(groups: ModelGroups, epsilon_value: float) -> float:
    """The RDP delta at ``epsilon_value`` of all groups composed (0 for none, 1 for no bound)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not groups:
        return 0.0
    total = _rdp_total(groups)
    if np.all(np.isinf(total)):
        return 1.0
    delta, _ = rdp_lib.compute_delta(np.asarray(RDP_ORDERS), total, epsilon_value)
    return float(delta)
