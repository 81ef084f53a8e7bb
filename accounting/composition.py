"""Per-round privacy loss of a ``GaussianRound``, composition over rounds, and planning.

Two accountants, both from dp-accounting:

* **PLD** (privacy loss distributions; Koskela et al. 2020, Doroshenko et al. 2022 "connect the
  dots"): tight up to discretisation. dp-accounting's ``pessimistic_estimate=True`` rounds every
  privacy loss *up* to the grid, so the reported epsilon errs on the safe (too large) side. This is
  the value that is enforced.
* **RDP** (Mironov 2017; Mironov, Talwar, Zhang 2019 for the Poisson-subsampled Gaussian): an
  independent, looser upper bound, reported as a cross-check. Converting RDP to (eps, delta) is
  always pessimistic.

Per-round dominating pairs (privacy-accounting note, section 2):

* two-stage schemes, task level: by joint convexity of the hockey-stick divergence over the common
  "participant not sampled" part, one round's PLD is the mixture
  ``(1 - q1) * (point mass at loss 0) + q1 * PLD_stage2``, where ``PLD_stage2`` is the
  Poisson-subsampled Gaussian at the stage-2 rate (``z/2`` if stage 2 has a fixed size). This holds
  in both the remove and the add direction: the unsampled branch has the same law under both
  datasets and is distinguishable (by the siblings) from the sampled branch, so its privacy loss is
  exactly 0. Only the innermost stage amplifies epsilon; the outer rate only scales delta within a
  round.
* two-stage schemes, participant level: Poisson-subsampled Gaussian at rate ``q1`` with the
  substitution form for a fixed-size stage 1, i.e. noise multiplier ``z / (2 k)`` for a cap of ``k``
  tasks per participant per round (sensitivity ``k C``, doubled by substitution).
* flat Poisson: the Poisson-subsampled Gaussian (rate ``q``, ``z``); fixed-size single stage: the
  same at rate ``m/n`` and ``z/2``.

Rounds are composed *by count*: each distinct round's PLD is built once and self-composed (an FFT
power, cost ~ independent of the count), groups of different rounds are composed together. Composing
one round at a time is quadratic and is never done.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from accounting.schemes import (
    UNITS,
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
)

Method: TypeAlias = Literal["pld", "rdp"]
METHODS: tuple[str, ...] = ("pld", "rdp")
RoundGroups: TypeAlias = Sequence[tuple[GaussianRound, int]]

#: PLD grid (the note's reference numbers use 1e-4). Finer is slower and only slightly smaller.
DEFAULT_DISCRETIZATION = 1e-4
#: RDP orders: dp-accounting's default grid, which the reference RDP numbers use.
RDP_ORDERS: tuple[float, ...] = tuple(rdp_lib.RdpAccountant().orders)
#: Upper limit of the round search in ``max_rounds`` (a guard, not a modelling assumption).
MAX_ROUNDS_LIMIT = 10**8

_PLD: TypeAlias = pld_lib.PrivacyLossDistribution


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _check_delta(delta: float) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be a number in (0, 1); got {delta!r}")


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}; got {unit!r}")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")


def _check_groups(rounds: RoundGroups) -> list[tuple[GaussianRound, int]]:
    """Merge identical rounds (so they compose by count) and validate the counts."""
    merged: dict[GaussianRound, int] = {}
    for item in rounds:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"rounds must be a sequence of (GaussianRound, count); got {item!r}")
        event, count = item
        if not isinstance(event, GaussianRound):
            raise ValueError(f"rounds entries must start with a GaussianRound; got {event!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"round count must be an integer >= 0; got {count!r}")
        if count:
            merged[event] = merged.get(event, 0) + count
    return sorted(merged.items(), key=lambda kv: repr(kv[0]))


# --------------------------------------------------------------------------------------------------
# Per-round mechanism: (mixture weight, stage rate, effective noise multiplier)
# --------------------------------------------------------------------------------------------------


def round_components(event: GaussianRound, unit: str = "task") -> tuple[float, float, float]:
    """Return ``(w, q, sigma)``: one round is ``(1-w) * [no loss] + w * PoissonGaussian(q, sigma)``.

    ``sigma`` is the noise standard deviation in units of the (add/remove) sensitivity. See the
    module docstring and the privacy-accounting note, section 2, for the derivation of each case.
    """
    _check_unit(unit)
    if event.neighbouring != "add_remove":
        # Never account a relation this module does not model as if it were add/remove.
        raise ValueError(f"neighbouring must be 'add_remove' here; got {event.neighbouring!r}")
    scheme = event.scheme
    z = float(event.noise_multiplier)
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
        return 1.0, scheme.participant_rate, z / (2.0 * cap)
    if isinstance(scheme, TwoStagePoissonScheme):
        return scheme.participant_rate, float(scheme.task_rate), z
    if isinstance(scheme, TwoStageFixedScheme):
        return scheme.participant_rate, scheme.task_rate, z / 2.0
    if isinstance(scheme, FlatPoissonScheme):
        return 1.0, float(scheme.rate), z
    if isinstance(scheme, FixedSizeScheme):
        return 1.0, scheme.rate, z / 2.0
    raise AssertionError(f"unreachable scheme {scheme!r}")  # pragma: no cover


# --------------------------------------------------------------------------------------------------
# PLD
# --------------------------------------------------------------------------------------------------


#: Below this noise (in sensitivity units) the PLD grid is coarsened (see ``_grid``).
_SMALL_SIGMA = 0.5


def _grid(sigma: float, discretization: float) -> float:
    """Grid for a stage with noise ``sigma``.

    The privacy-loss range grows like ``1 / sigma^2``, so at a fixed grid a tiny ``sigma`` (e.g.
    participant level, ``z / (2 k)``) needs millions of bins and minutes per composition. Below
    ``sigma = 0.5`` the grid is scaled by ``(0.5 / sigma)^2``: dp-accounting's pessimistic rounding
    keeps every grid an upper bound, so this errs only on the safe (larger epsilon) side. The
    reference numbers (sigma >= 0.5) use the base grid unchanged.
    """
    if sigma >= _SMALL_SIGMA:
        return discretization
    return discretization * (_SMALL_SIGMA / sigma) ** 2


@functools.lru_cache(maxsize=256)
def _pld_one_round(weight: float, rate: float, sigma: float, discretization: float) -> _PLD:
    stage = pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        sensitivity=1.0,
        pessimistic_estimate=True,
        value_discretization_interval=_grid(sigma, discretization),
        sampling_prob=rate,
    )
    if weight >= 1.0:
        return stage
    # (1 - w) * delta_0 + w * PLD_stage: dp-accounting's mixture of PMFs, in both directions. The
    # point mass at loss 0 lies exactly on the grid, so the mixture adds no discretisation error.
    identity = pld_lib.identity(value_discretization_interval=_grid(sigma, discretization))
    return stage.compute_mixture(identity, weight)


def round_pld(
    event: GaussianRound, unit: str = "task", *, discretization: float = DEFAULT_DISCRETIZATION
) -> _PLD:
    """Return the (pessimistic) PLD of one round, cached per distinct round."""
    w, q, sigma = round_components(event, unit)
    return _pld_one_round(w, q, sigma, discretization)


# Composed PMFs can hold millions of probabilities: keep only a few.
@functools.lru_cache(maxsize=8)
def _composed_group(
    weight: float, rate: float, sigma: float, count: int, discretization: float
) -> _PLD:
    base = _pld_one_round(weight, rate, sigma, discretization)
    return base if count == 1 else base.self_compose(count)


def composed_pld(
    rounds: RoundGroups, unit: str = "task", *, discretization: float = DEFAULT_DISCRETIZATION
) -> _PLD | None:
    """PLD of all rounds: identical rounds self-composed by count, then the groups composed.

    Returns ``None`` when there are no rounds (epsilon 0). Each group's composition is cached, so a
    ledger that keeps spending one kind of round recomputes only that group.
    """
    groups = _check_groups(rounds)
    result: _PLD | None = None
    for event, count in groups:
        w, q, sigma = round_components(event, unit)
        part = _composed_group(w, q, sigma, count, discretization)
        result = part if result is None else result.compose(part)
    return result


def _pld_epsilon(rounds: RoundGroups, delta: float, unit: str, discretization: float) -> float:
    pld = composed_pld(rounds, unit, discretization=discretization)
    if pld is None:
        return 0.0
    return max(0.0, float(pld.get_epsilon_for_delta(delta)))


def pld_delta(
    rounds: RoundGroups,
    epsilon_value: float,
    unit: str = "task",
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Smallest delta (pessimistic PLD) such that the composed rounds are (epsilon, delta)-DP."""
    pld = composed_pld(rounds, unit, discretization=discretization)
    if pld is None:
        return 0.0
    return float(pld.get_delta_for_epsilon(epsilon_value))


# --------------------------------------------------------------------------------------------------
# RDP
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _rdp_one_round(weight: float, rate: float, sigma: float) -> tuple[float, ...]:
    """RDP curve of one round over ``RDP_ORDERS``.

    Stage: dp-accounting's Poisson-subsampled Gaussian RDP (Mironov, Talwar, Zhang 2019), valid in
    both directions. Mixture with a point mass (disjoint, equal under both datasets): for any pair,
    ``E_Q[(P/Q)^a] = (1 - w) + w E_Q2[(P2/Q2)^a]``, hence
    ``RDP(a) = log(1 - w + w exp((a - 1) RDP2(a))) / (a - 1)`` -- exact, and monotone in ``RDP2``,
    so an upper bound on ``RDP2`` gives an upper bound.
    """
    accountant = rdp_lib.RdpAccountant(orders=list(RDP_ORDERS))
    # dp-accounting logs (via absl) when a fractional order's series does not converge and then sets
    # that order to inf, i.e. drops it: conservative, so the warning is only noise for our users.
    absl_logger = logging.getLogger("absl")
    previous = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        accountant.compose(dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(sigma)))
    finally:
        absl_logger.setLevel(previous)
    stage = np.asarray(accountant.rdp, dtype=np.float64)
    if weight >= 1.0:
        return tuple(float(x) for x in stage)
    orders = np.asarray(RDP_ORDERS, dtype=np.float64)
    out = []
    for order, value in zip(orders, stage, strict=True):
        if math.isinf(value):
            out.append(math.inf)
            continue
        # log(1 - w + w e^x) computed stably: logaddexp(log(1 - w), log(w) + x).
        x = (order - 1.0) * value
        out.append(float(np.logaddexp(math.log1p(-weight), math.log(weight) + x) / (order - 1.0)))
    return tuple(out)


def _rdp_epsilon(rounds: RoundGroups, delta: float, unit: str) -> float:
    groups = _check_groups(rounds)
    if not groups:
        return 0.0
    total = np.zeros(len(RDP_ORDERS))
    for event, count in groups:
        w, q, sigma = round_components(event, unit)
        total = total + count * np.asarray(_rdp_one_round(w, q, sigma))
    eps, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), total, delta)
    return float(eps)


# --------------------------------------------------------------------------------------------------
# Public: epsilon
# --------------------------------------------------------------------------------------------------


def epsilon(
    rounds: RoundGroups,
    delta: float,
    unit: str = "task",
    method: str = "pld",
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Return epsilon at ``delta`` after ``rounds``, a list of ``(GaussianRound, count)``.

    ``method="pld"`` is the tight value fedmeta enforces (pessimistic discretisation: never below
    the exact value of the dominating pair); ``method="rdp"`` is the looser independent cross-check.
    """
    _check_delta(delta)
    _check_unit(unit)
    _check_method(method)
    if method == "rdp":
        return _rdp_epsilon(rounds, delta, unit)
    return _pld_epsilon(rounds, delta, unit, discretization)


def tombs2022_published_epsilon(
    event: GaussianRound,
    rounds: int,
    delta: float,
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """AS PUBLISHED, NOT A VALID GUARANTEE: Tombs et al. (2022), Theorem 3, for a two-stage scheme.

    Theorem 3 claims two-stage sampling amplifies like Poisson sampling at ``eta``, the largest
    inclusion probability of a task (``eta = q1 * n2 / min_i |T_i|`` or ``q1 * q2``), with the
    Gaussian's sensitivity ``C`` (``z`` unhalved). The privacy-accounting note (section 1) gives a
    one-round dataset where the true delta is ~1e4 times larger. This number is reported beside the
    valid one for comparison and is never used to enforce a budget.
    """
    _check_delta(delta)
    scheme = event.scheme
    if not isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme):
        raise ValueError(
            "scheme must be two-stage for the Tombs et al. (2022) Theorem-3 value; "
            f"got {type(scheme).__name__}"
        )
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0; got {rounds!r}")
    if rounds == 0:
        return 0.0
    pld = _composed_group(
        1.0,
        scheme.largest_inclusion_probability,
        float(event.noise_multiplier),
        rounds,
        discretization,
    )
    return max(0.0, float(pld.get_epsilon_for_delta(delta)))


# --------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------


def calibrate_noise_multiplier(
    scheme: Any,
    rounds: int,
    target_epsilon: float,
    delta: float,
    unit: str = "task",
    *,
    max_tasks_per_participant: int | None = None,
    method: str = "pld",
    relative_tolerance: float = 1e-3,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Smallest noise multiplier ``z`` (to ``relative_tolerance``, rounded up) with eps <= target.

    Bisection that always returns the upper, *feasible* end of the bracket: the result meets the
    target under the chosen accountant, and ``z * (1 - relative_tolerance)`` may not.
    """
    _check_delta(delta)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1; got {rounds!r}")
    if not (
        isinstance(target_epsilon, int | float)
        and math.isfinite(target_epsilon)
        and target_epsilon > 0
    ):
        raise ValueError(f"target_epsilon must be a finite number > 0; got {target_epsilon!r}")
    if not 0 < relative_tolerance < 1:
        raise ValueError(f"relative_tolerance must be in (0, 1); got {relative_tolerance!r}")

    def eps_at(z: float, how: str) -> float:
        event = GaussianRound(scheme, z, max_tasks_per_participant)
        return epsilon([(event, rounds)], delta, unit, how, discretization=discretization)

    # Bracket with the cheap RDP accountant first (PLD <= RDP, so an RDP-feasible z is a good upper
    # end), then refine with the requested accountant. Every bracket end is *checked*, never
    # assumed.
    lo, hi = 1e-3, 1.0
    while eps_at(hi, "rdp") > target_epsilon:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise ValueError(
                f"target_epsilon {target_epsilon} is not reachable with noise multiplier <= 1e6"
            )
    if method == "pld":
        # The PLD-feasible z is at most the RDP-feasible one; find a PLD-infeasible lower end.
        lo = hi / 2.0
        while lo > 1e-3 and eps_at(lo, "pld") <= target_epsilon:
            hi, lo = lo, lo / 2.0
        if eps_at(hi, "pld") > target_epsilon:  # only if PLD exceeded RDP; keep searching upwards
            while eps_at(hi, "pld") > target_epsilon:
                lo, hi = hi, hi * 2.0
    while (hi - lo) > relative_tolerance * hi:
        mid = 0.5 * (lo + hi)
        if eps_at(mid, method) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def max_rounds(
    event: GaussianRound,
    epsilon_budget: float,
    delta: float,
    unit: str = "task",
    *,
    prior: RoundGroups = (),
    method: str = "pld",
    limit: int = MAX_ROUNDS_LIMIT,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> int:
    """Largest ``T`` such that ``prior`` plus ``T`` copies of ``event`` stays within the budget.

    Exact to the round under the chosen accountant: a galloping search then a bisection that keeps
    the last *feasible* value (the DP-MAML line's off-by-one kept the last probe). Assumes epsilon
    is non-decreasing in ``T``, which holds for these accountants. Returns 0 if not even one round
    fits, and ``limit`` if ``limit`` rounds fit.
    """
    _check_delta(delta)
    if not (isinstance(epsilon_budget, int | float) and epsilon_budget >= 0):
        raise ValueError(f"epsilon_budget must be a number >= 0; got {epsilon_budget!r}")
    prior_groups = _check_groups(prior)
    other = [(e, c) for e, c in prior_groups if e != event]
    already = sum(c for e, c in prior_groups if e == event)

    cache: dict[int, float] = {}

    def eps_of(extra: int) -> float:
        if extra not in cache:
            groups = [*other, (event, already + extra)] if already + extra else other
            cache[extra] = epsilon(groups, delta, unit, method, discretization=discretization)
        return cache[extra]

    def feasible(extra: int) -> bool:
        return eps_of(extra) <= epsilon_budget

    if not feasible(0):
        return 0
    # 1. A feasible lower end: the cheap RDP answer (PLD <= RDP, so it is PLD-feasible in practice;
    #    it is checked, not assumed).
    lo = 0
    if method == "pld":
        guess = max_rounds(
            event,
            epsilon_budget,
            delta,
            unit,
            prior=prior,
            method="rdp",
            limit=limit,
        )
        if guess >= 1 and feasible(guess):
            lo = guess

    # 2. An infeasible upper end. Epsilon grows at least like sqrt(T) once it is non-trivial, so
    #    scaling by (budget / eps)^2 usually overshoots in one step; otherwise keep galloping.
    def extrapolate(t: int) -> int:
        eps_now = eps_of(t)
        factor = (epsilon_budget / eps_now) ** 2 if eps_now > 0 else 4.0
        return min(limit, max(t + 1, int(math.ceil(t * min(max(factor, 1.1), 4.0)))))

    hi = extrapolate(lo) if lo else 1
    while feasible(hi):
        lo = hi
        if hi >= limit:
            return limit
        hi = extrapolate(hi)
    # 3. Invariant: lo feasible, hi infeasible. Interpolate (regula falsi) and probe the neighbour
    #    of each interpolated point, which ends the search in a few evaluations when the curve is
    #    smooth; after two interpolations that failed to halve the bracket, bisect, so the worst
    #    case stays logarithmic.
    slow_steps = 0
    while hi - lo > 1:
        bisect_next = slow_steps >= 2
        width = hi - lo
        if bisect_next:
            mid = (lo + hi) // 2
        else:
            e_lo, e_hi = eps_of(lo), eps_of(hi)
            frac = (epsilon_budget - e_lo) / (e_hi - e_lo) if e_hi > e_lo else 0.5
            mid = lo + int(round(frac * (hi - lo)))
        mid = min(max(mid, lo + 1), hi - 1)
        if feasible(mid):
            lo = mid
            if mid + 1 < hi and not feasible(mid + 1):
                hi = mid + 1
        else:
            hi = mid
            if mid - 1 > lo:
                if feasible(mid - 1):
                    lo = mid - 1
                else:
                    hi = mid - 1
        slow_steps = 0 if (bisect_next or (hi - lo) * 2 <= width) else slow_steps + 1
    return lo


def epsilon_curve(
    event: GaussianRound, rounds: Iterable[int], delta: float, unit: str = "task"
) -> list[tuple[int, float]]:
    """``[(T, eps_PLD(T))]`` for a few ``T`` (each a single self-composition)."""
    return [(t, epsilon([(event, t)], delta, unit)) for t in rounds]
