"""Calibration: the smallest noise multiplier for a target epsilon, and the most rounds in a budget.

Both search over ``composition.epsilon`` (the enforced accountant): RDP brackets, then the PLD
refines (``composition``'s module docstring, "Calibration").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fedmeta.accounting.composition import (
    DEFAULT_DISCRETIZATION,
    MAX_ROUNDS_LIMIT,
    Method,
    RoundGroups,
    check_discretization,
    check_method,
    check_rounds,
    epsilon,
    groups_epsilon,
    model_groups,
)
from fedmeta.accounting.levels import lowered
from fedmeta.accounting.pairs import NOISE_MULTIPLIER_RANGE, ModelGroups, round_components
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    GaussianRound,
    Neighbouring,
    Unit,
    check_delta,
    check_unit,
)
from fedmeta.accounting.tuning_release import holds_release, release_affordable


def _check_target(name: str, value: object, *, allow_zero: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and not (value >= 0.0 if allow_zero else value > 0.0):  # type: ignore[operator]
        ok = False
    if not ok or math.isnan(float(value)):  # type: ignore[arg-type]
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a number {bound}; got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _check_calibration(
    rounds: int, target_epsilon: float, delta: float, unit: Unit, method: Method, tolerance: float
) -> tuple[int, float]:
    """:func:`calibrate_noise_multiplier`'s arguments checked: ``(rounds, target)``."""
    check_delta(delta)
    check_unit(unit)
    check_method(method)
    rounds = check_rounds("rounds", rounds, minimum=1)
    target = _check_target("target_epsilon", target_epsilon, allow_zero=False)
    if not math.isfinite(target):
        raise ValueError(f"target_epsilon must be a finite number > 0; got {target_epsilon!r}")
    if not (isinstance(tolerance, float) and 1e-9 <= tolerance < 1.0):
        raise ValueError(f"relative_tolerance must be in [1e-9, 1); got {tolerance!r}")
    return rounds, target


def calibrate_noise_multiplier(
    scheme: Any,
    rounds: int,
    target_epsilon: float,
    delta: float,
    unit: Unit = "task",
    *,
    max_tasks_per_participant: int | None = None,
    neighbouring: Neighbouring = ADD_REMOVE,
    method: Method = "pld",
    relative_tolerance: float = 1e-3,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Smallest noise multiplier ``z`` (to ``relative_tolerance``, rounded up) with eps <= target.

    Returns the upper, *feasible* end of the final bracket: the result meets the target under the
    chosen accountant, and ``z * (1 - relative_tolerance)`` may not. Searches
    ``NOISE_MULTIPLIER_RANGE`` and says so when the answer lies outside it.
    """
    rounds, target = _check_calibration(
        rounds, target_epsilon, delta, unit, method, relative_tolerance
    )

    def eps_at(z: float, how: Method) -> float:
        event = GaussianRound(scheme, z, max_tasks_per_participant, neighbouring)
        return epsilon([(event, rounds)], delta, unit, how, discretization=discretization)

    low, high = NOISE_MULTIPLIER_RANGE
    if eps_at(high, method) > target:
        raise ValueError(
            f"target_epsilon must be reachable with a noise multiplier <= {high:g} (the "
            f"accountant's range); got {target:g}"
        )
    if eps_at(low, method) <= target:
        raise ValueError(
            f"target_epsilon must be below the epsilon of the smallest supported noise multiplier "
            f"{low:g}, which already meets it; got {target:g}"
        )
    # 1. Cheap RDP bracket, bisected in log z: an RDP-feasible z is feasible under either method
    #    (the enforced epsilon is never above RDP), and eps_rdp(low) > target as checked above.
    lo, hi = low, high
    e_rdp = {lo: math.inf, hi: 0.0}
    stop = relative_tolerance if method == "rdp" else 0.2
    while hi - lo > stop * hi:
        mid = math.sqrt(lo * hi)
        e_rdp[mid] = eps_at(mid, "rdp")
        lo, hi = (lo, mid) if e_rdp[mid] <= target else (mid, hi)
    if method == "rdp":
        return hi
    # 2. The PLD answer is at most hi. First guess: move from hi along the RDP curve's log-log
    #    slope to where the PLD value would reach the target; then refine.
    e_hi = eps_at(hi, method)
    slope = -1.0
    if 0.0 < e_rdp[hi] < math.inf and 0.0 < e_rdp[lo] < math.inf and e_rdp[lo] > e_rdp[hi]:
        slope = math.log(e_rdp[lo] / e_rdp[hi]) / math.log(lo / hi)
    guess = hi * math.exp(math.log(target / max(e_hi, 1e-300)) / slope) if e_hi > 0 else low
    guess = max(low, min(guess, hi * (1.0 - relative_tolerance)))
    return _refine_noise(
        lambda z: eps_at(z, method), target, guess, hi, e_hi, low, relative_tolerance
    )


def _refine_noise(
    eps_at: Callable[[float], float],
    target: float,
    lo: float,
    hi: float,
    e_hi: float,
    floor: float,
    tolerance: float,
) -> float:
    """Smallest feasible ``z`` to ``tolerance``, given eps(hi) <= target < eps(floor).

    Works on ``g(z) = log(eps(z) / target)``, decreasing in ``log z``. While ``lo`` is feasible the
    bracket is extended downwards along the secant; then Illinois-modified regula falsi (a secant
    step that never leaves the bracket and halves a stale end's weight), which converges
    superlinearly on these smooth curves. When the secant predicts the root within ``tolerance`` of
    ``hi``, one probe just below ``hi`` closes the bracket. Returns ``hi``, always feasible.
    """

    def g(z: float) -> float:
        e = eps_at(z)
        return math.inf if e == math.inf else math.log(max(e, 1e-300) / target)

    g_hi = math.log(max(e_hi, 1e-300) / target) if e_hi < math.inf else math.inf
    g_lo = g(lo)
    while g_lo <= 0.0:  # lo is feasible too: step down along the secant, by 10% up to 16x
        flat = not (math.isfinite(g_lo) and math.isfinite(g_hi)) or g_lo <= g_hi
        guess = lo / 2.0 if flat else math.exp(_secant(math.log(lo), math.log(hi), g_lo, g_hi))
        new = max(floor, lo / 16.0, min(guess * (1.0 - tolerance), lo * 0.9))
        hi, g_hi, lo = lo, g_lo, new
        g_lo = g(lo)
    last = 0  # +1 if the last step moved hi, -1 if it moved lo (Illinois bookkeeping)
    while hi - lo > tolerance * hi:
        u = _secant(math.log(lo), math.log(hi), g_lo, g_hi)
        z = min(max(math.exp(u), lo + 0.01 * (hi - lo)), hi - 0.01 * (hi - lo))
        if z > hi * (1.0 - tolerance):  # the root is within tolerance of hi: try to close
            z = max(hi * (1.0 - 0.99 * tolerance), lo + 0.5 * (hi - lo))
        gz = g(z)
        if gz <= 0.0:
            hi, g_hi = z, gz
            if last == 1:
                g_lo /= 2.0  # lo kept twice: pull the secant towards it
            last = 1
        else:
            lo, g_lo = z, gz
            if last == -1:
                g_hi /= 2.0
            last = -1
    return hi


def _secant(u_lo: float, u_hi: float, g_lo: float, g_hi: float) -> float:
    """Zero of the line through ``(u_lo, g_lo)`` and ``(u_hi, g_hi)``; the midpoint if undefined."""
    if not (math.isfinite(g_lo) and math.isfinite(g_hi)) or g_lo == g_hi:
        return 0.5 * (u_lo + u_hi)
    return u_hi - g_hi * (u_hi - u_lo) / (g_hi - g_lo)


def max_rounds(
    event: GaussianRound | SampleLevelRound,
    epsilon_budget: float,
    delta: float,
    unit: Unit = "task",
    *,
    prior: RoundGroups = (),
    method: Method = "pld",
    limit: int = MAX_ROUNDS_LIMIT,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> int:
    """Largest ``T`` such that ``prior`` plus ``T`` copies of ``event`` stays within the budget.

    Exact to the round under the chosen accountant: the result is a *feasible* value whose
    successor was checked infeasible (never the last probe). The cheap RDP answer is the starting
    point (feasible under the enforced accountant, which is never above RDP); then a galloping
    search and a safeguarded interpolation. Returns 0 if not even one round fits, and ``limit`` if
    ``limit`` rounds fit.
    """
    check_delta(delta)
    check_unit(unit)
    check_method(method)
    check_discretization(discretization)
    budget = _check_target("epsilon_budget", epsilon_budget, allow_zero=True)
    if not isinstance(event, GaussianRound | SampleLevelRound):
        raise ValueError(f"event must be a GaussianRound or a SampleLevelRound; got {event!r}")
    limit = check_rounds("limit", limit, minimum=0)
    base = model_groups([*prior, (event, 1)], unit)  # validates prior, relation, level, event
    model = round_components(lowered(event), unit)  # sample level: its dominating pair
    already = sum(c for m, c in base) - 1
    limit = min(limit, MAX_ROUNDS_LIMIT - already)

    def groups_at(extra: int) -> ModelGroups:
        merged = dict(base)
        merged[model] -= 1
        merged[model] += extra
        return tuple(sorted(((m, c) for m, c in merged.items() if c), key=lambda kv: repr(kv[0])))

    cache: dict[tuple[int, Method], float] = {}

    def eps_of(extra: int, how: Method) -> float:
        if (extra, how) not in cache:
            cache[(extra, how)] = groups_epsilon(groups_at(extra), delta, how, discretization)
        return cache[(extra, how)]

    if eps_of(0, method) > budget:
        return 0
    # 1. RDP (cheap at any T): largest feasible count by galloping then bisection.
    lo, hi = 0, 1
    while hi <= limit and eps_of(hi, "rdp") <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps_of(mid, "rdp") <= budget else (lo, mid)
    if method == "rdp" or lo >= limit or eps_of(lo + 1, method) > budget:
        return lo
    return _gallop_and_interpolate(lambda t: eps_of(t, method), budget, lo + 1, limit)


def _gallop_and_interpolate(
    eps_of: Callable[[int], float], budget: float, lo: int, limit: int
) -> int:
    """Largest feasible count at or above the feasible ``lo``, up to ``limit``.

    Epsilon grows like a power of T (between sqrt(T) and T), so the search works in
    ``(log T, log eps)``: a gallop along the secant (slope 1/2 until two points are known) until
    infeasible, then Illinois-modified regula falsi on the integers, which converges superlinearly
    and never leaves the bracket. Invariant: ``lo`` feasible, ``hi`` infeasible; the result is
    ``lo`` with ``hi == lo + 1``.
    """

    def g(t: int) -> float:
        e = eps_of(t)
        return math.inf if e == math.inf else math.log(max(e, 1e-300) / budget)

    bracket = _gallop(g, lo, limit)
    return limit if bracket is None else _illinois(g, *bracket)


_Bracket = tuple[int, float, int, float]


def _gallop(g: Callable[[int], float], lo: int, limit: int) -> _Bracket | None:
    """``(lo, g(lo), hi, g(hi))`` with ``g(lo) <= 0 < g(hi)``; None if ``limit`` is feasible."""
    g_lo, prev = g(lo), None
    while True:
        if prev is not None and prev[1] < g_lo < 0.0:
            slope = (g_lo - prev[1]) / math.log(lo / prev[0])
        else:
            slope = 0.5
        step = math.exp(-g_lo / max(slope, 0.05)) * 1.05 if g_lo < 0.0 else 2.0
        hi = min(limit, max(lo + 1, math.ceil(lo * min(max(step, 1.01), 16.0))))
        g_hi = g(hi)
        if g_hi > 0.0:
            return lo, g_lo, hi, g_hi
        if hi >= limit:
            return None
        prev, lo, g_lo = (lo, g_lo), hi, g_hi


def _illinois(g: Callable[[int], float], lo: int, g_lo: float, hi: int, g_hi: float) -> int:
    """Shrink the integer bracket to ``hi == lo + 1`` (regula falsi in ``log T``, Illinois rule)."""
    last = 0
    while hi - lo > 1:
        if hi - lo <= 4 or not (math.isfinite(g_lo) and math.isfinite(g_hi)) or g_lo == g_hi:
            mid = (lo + hi) // 2
        else:
            u_lo, u_hi = math.log(lo), math.log(hi)
            mid = round(math.exp(u_lo + g_lo * (u_hi - u_lo) / (g_lo - g_hi)))
        mid = min(max(mid, lo + 1), hi - 1)
        g_mid = g(mid)
        if g_mid <= 0.0:
            lo, g_lo = mid, g_mid
            if last == 1:
                g_hi /= 2.0  # hi kept twice: pull the secant towards it (Illinois)
            last = 1
        else:
            hi, g_hi = mid, g_mid
            if last == -1:
                g_lo /= 2.0
            last = -1
    return lo


def affordable_rounds(
    groups: RoundGroups,
    event: GaussianRound | SampleLevelRound,
    epsilon_budget: float,
    delta: float,
    unit: Unit = "task",
) -> int:
    """How many more rounds like ``event`` fit in the budget after ``groups`` (exact under PLD).

    Pure: the answer depends only on the arguments, so a value computed for one ledger position
    can never be reported for another. A PLD search: seconds, up to minutes for two-stage mixtures.
    After a tuning release (an RDP curve only, tuning_release.py) the search composes by RDP
    instead (errs high).
    """
    if holds_release(groups):
        return release_affordable(groups, event, epsilon_budget, delta, unit)
    return max_rounds(
        event, epsilon_budget, delta, unit, prior=tuple(groups), limit=MAX_ROUNDS_LIMIT
    )
