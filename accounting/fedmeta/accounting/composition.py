"""Per-round privacy loss of a ``GaussianRound``, composition over rounds, and planning.

Accountants
-----------
* **PLD** (privacy loss distributions; Koskela et al. 2020; Doroshenko, Ghazi, Kamath, Kumar,
  Manurangsi 2022 "Connect the dots", Algorithm 1): each round's dominating pair is discretised with
  dp-accounting's pessimistic connect-the-dots construction, whose hockey-stick curve lies on or
  above the exact one at every epsilon, so the reported epsilon errs on the safe (too large) side.
* **RDP** (Mironov 2017; Mironov, Talwar, Zhang 2019; Wang, Balle, Kasiviswanathan 2019): an
  independent, looser upper bound, reported as a cross-check.

The enforced value (``method="pld"``) is the *minimum* of the PLD and RDP epsilons: both are valid
upper bounds, so their minimum is one. Where the PLD is cheap it is the smaller; where the grid must
be coarsened (below) RDP may take over.

Dominating pairs per round (privacy-accounting note, section 2; docs/privacy.md)
---------------------------------------------------------------------------------
Notation: ``PG(q, s)`` is the Poisson-subsampled Gaussian pair at rate ``q`` and noise ``s`` (in
units of the sensitivity), ``MIX(w, X)`` the pair ``(1 - w) * [no loss] + w * X`` (same law under
both datasets on the first branch). Zhu, Dong, Wang (2022, "Optimal accounting of differential
privacy via characteristic function", Definition 7 and the composition theorem for dominating
pairs) make a pair that dominates every round *for every order* composable by product; every pair
below is of that kind.

``add_remove`` (add or remove one task; the default):

* two-stage, Poisson stage 2: ``MIX(q1, PG(q2, z))``; fixed stage 2: ``MIX(q1, PG(n2/min_tasks,
  z/2))`` (adding a task to a fixed-size sample is a substitution inside it: the clipped sum moves
  by ``2C``); flat Poisson ``PG(q, z)``; fixed-size ``PG(m/n, z/2)``. The mixture is joint
  convexity of the hockey-stick divergence over the common "participant not sampled" branch. The
  direction of a neighbouring pair (add or remove) is the same in every round, so the remove and
  add PLDs are composed separately and the larger epsilon is taken (dp-accounting's convention).

``replace_one`` (one task replaced by another; counts public). Write ``E_a = exp(a.Z - |a|^2/2)``
with ``Z`` standard normal; for any ``alpha >= 0`` and reference ``N(h)``,
``H_alpha((1-w)N(h) + wN(g) || (1-w)N(h) + wN(g')) = E[((1-w)(1-alpha) + w E_a - alpha w E_b)_+]``
with ``a = (g-h)/s``, ``b = (g'-h)/s``. ``E_a`` grows in convex order with ``|a|`` (a lognormal
martingale), and a sum is largest in convex order when its terms are comonotone (Dhaene et al.
2002, "The concept of comonotonicity in actuarial science and finance: theory", Theorem 7). Hence:

* Poisson sampling (flat, or stage 2): the other tasks' inclusions are independent of the replaced
  task's, so after joint convexity over them ``h = 0``, ``|g|, |g'| <= C`` and the supremum over
  every pair and every ``alpha`` is at ``g = -g'``, ``|g| = C``: dp-accounting's REPLACE pair
  ``(1-q) N(0) + q N(C)`` vs ``(1-q) N(0) + q N(-C)`` (``privacy_loss_mechanism``'s
  ``AdditiveNoisePrivacyLoss``), at noise ``z``. It is symmetric, so one PMF serves both orders.
  Two-stage: ``MIX(q1, REPLACE(q2, z))``; flat: ``REPLACE(q, z)``.
* Sampling without replacement (fixed-size, or fixed stage 2), sampling ``m`` of ``n``, ``gamma =
  m/n``: couple a sample without the replaced task as ``R + {y}`` and one with it as ``R + {x}``
  (Balle, Barthe, Gaboardi 2018, "Privacy amplification by subsampling", proof of Theorem 9). Then
  ``h`` is another *sampled* task's gradient and ``|g - h|`` reaches ``2C``: the realisable pairs
  include ``((1-gamma)N(0) + gamma N(2C), N(0))``, the remove pair of ``PG(gamma, z/2)``, which the
  pair ``REPLACE(gamma, z)`` does not dominate (it is too small by 65x at epsilon 3 for m=1, n=2,
  z=1). Conversely advanced joint convexity (Balle et al. 2018, Theorem 2) bounds every realisable
  pair by that remove pair for ``alpha >= 1``. The tight pair valid for *every* order is the
  symmetrisation ``min(f, f^-1)**`` of its trade-off function ``f`` (Dong, Roth, Su 2022, Theorem
  4.2 for sampling without replacement; its hockey-stick curve is ``delta(eps) = delta_remove(eps)``
  for ``eps >= 0`` and ``1 - e^eps + e^eps delta_remove(-eps)`` below 0). Composing the remove and
  add PLDs separately would not be a valid bound here: under replacement a round's pair can lie
  between the two (e.g. ``g = -g' = C``, ``h = 0``). Two-stage: ``MIX(q1, SYM(n2/min_tasks,
  z/2))``; fixed-size: ``SYM(m/n, z/2)``.

Participant level (either relation): ``PG(q1, z / (2k))`` for a cap of ``k`` tasks per participant
per round (substitution of a participant inside the fixed-size stage 1).

RDP cross-check: ``add_remove`` uses dp-accounting's Poisson-subsampled Gaussian RDP; replace-one
with Poisson sampling uses Mironov (2017), Proposition 11 (weak triangle inequality, p = q = 2)
through the removal of the task: ``R(alpha) <= (alpha - 1/2)/(alpha - 1) * R_ar(2 alpha) +
R_ar(2 alpha - 1)`` (dp-accounting has no Poisson replace-one RDP); replace-one without replacement
uses dp-accounting's ``SampledWithoutReplacementDpEvent`` (Wang, Balle, Kasiviswanathan 2019,
Theorem 27) with the noise relative to ``2C`` (dp-accounting issue #378). The mixture with the
unsampled branch is exact for disjoint branches and an upper bound otherwise (joint convexity of
``x^alpha``). A negative RDP value (numerical trouble) drops that order instead of reading as 0.

Ranges and bounded cost
-----------------------
Accepted: ``1 <= rounds <= MAX_ROUNDS_LIMIT`` (1e9) in any query; noise multiplier in
``NOISE_MULTIPLIER_RANGE`` ([1e-4, 1e6]); delta in (0, 1). Every query (``epsilon``,
``calibrate_noise_multiplier``, ``max_rounds``, both units, both relations) takes seconds and well
under 1 GB for rounds up to 1e9, epsilon up to 1e3 and noise multipliers 0.1 to 100 (see
docs/benchmarks.md). How, erring only on the safe side:

* A PLD never holds more than ``MAX_ROUND_BINS`` points for one round nor ``MAX_PLD_BINS`` for a
  composition. The grid starts at ``discretization`` (1e-4) and doubles until both fit, the
  composed size being computed *before* any allocation. A coarser pessimistic grid is still an upper
  bound, only a looser one.
* If even a grid of ``MAX_GRID`` does not fit (tiny noise, huge counts), the PLD is skipped and the
  RDP bound, always cheap, is the answer.
* The tails that a self-composition cuts off (a Chernoff bound, at most ``TAIL_MASS`` in all) are
  added to the probability of an infinite loss, as dp-accounting does.
* ``max_rounds`` starts from the RDP answer (feasible by construction) and is exact to the round
  under the enforced accountant; ``calibrate_noise_multiplier`` brackets with RDP, then refines.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    REPLACE_ONE,
    UNITS,
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    Neighbouring,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    Unit,
)

if TYPE_CHECKING:
    # dp-accounting and scipy load where they compute (about 1.5 s), not with the package: the
    # ``fedmeta`` command's registration and a participant import accounting names only.
    from dp_accounting import dp_event
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.pld import privacy_loss_mechanism as plm

Method: TypeAlias = Literal["pld", "rdp"]
METHODS: tuple[Method, ...] = ("pld", "rdp")
RoundGroups: TypeAlias = Sequence[tuple[GaussianRound, int]]
#: ``add_remove``: Poisson-subsampled Gaussian pair, remove and add PLDs; ``replace``: the symmetric
#: REPLACE pair of Poisson sampling; ``wor_replace``: the symmetrised pair of sampling without
#: replacement under replace-one.
Pair: TypeAlias = Literal["add_remove", "replace", "wor_replace"]
_Floats: TypeAlias = npt.NDArray[np.float64]

#: Finest PLD grid (the note's reference numbers use 1e-4).
DEFAULT_DISCRETIZATION = 1e-4
#: RDP orders: dp-accounting's default grid (``rdp_privacy_accountant.DEFAULT_RDP_ORDERS``, spelled
#: the same way so the floats are equal; a test compares), which the reference RDP numbers use.
RDP_ORDERS: tuple[float, ...] = tuple(
    float(a)
    for a in [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)
#: Most rounds in one query (a range of the accountant, see the module docstring).
MAX_ROUNDS_LIMIT = 10**9
#: Accepted noise multipliers (a range of the accountant).
NOISE_MULTIPLIER_RANGE: tuple[float, float] = (1e-4, 1e6)
#: Most grid points of one round's PLD, and of a composed PLD (about 8 B each, a few copies live).
MAX_ROUND_BINS = 2**18
MAX_PLD_BINS = 2**22
#: Coarsest PLD grid tried; beyond it the RDP bound alone is used.
MAX_GRID = 1.0
#: Probability mass a self-composition may cut from the tails (moved to an infinite loss).
TAIL_MASS = 1e-15

_PLD: TypeAlias = "pld_lib.PrivacyLossDistribution"


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def check_delta(delta: float) -> None:
    """Refuse a delta outside (0, 1), naming it."""
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be a number in (0, 1); got {delta!r}")


def check_unit(unit: object) -> None:
    """Refuse a privacy unit other than ``task`` or ``participant``."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}; got {unit!r}")


def _check_method(method: object) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")


def _check_rounds(name: str, value: object, *, minimum: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (minimum <= value <= MAX_ROUNDS_LIMIT)
    ):
        raise ValueError(
            f"{name} must be an integer in [{minimum}, {MAX_ROUNDS_LIMIT}]; got {value!r}"
        )
    return value


def _check_groups(rounds: RoundGroups) -> list[tuple[GaussianRound, int]]:
    """Merge identical rounds (so they compose by count) and validate counts and relation."""
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
    total = sum(merged.values())
    if total > MAX_ROUNDS_LIMIT:
        raise ValueError(f"round count must be at most {MAX_ROUNDS_LIMIT} in all; got {total}")
    relations = sorted({event.neighbouring for event in merged})
    if len(relations) > 1:
        # A guarantee is stated for one relation; composing rounds of two would state neither.
        raise ValueError(f"neighbouring must be the same for all rounds; got {relations}")
    return sorted(merged.items(), key=lambda kv: repr(kv[0]))


# --------------------------------------------------------------------------------------------------
# Per-round dominating pair
# --------------------------------------------------------------------------------------------------


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


def _check_noise(z: float) -> None:
    low, high = NOISE_MULTIPLIER_RANGE
    if not low <= z <= high:
        raise ValueError(f"noise_multiplier must be in [{low:g}, {high:g}]; got {z!r}")


def round_components(event: GaussianRound, unit: Unit = "task") -> RoundModel:
    """Return the dominating pair of one round of ``event`` (derived in the module docstring)."""
    check_unit(unit)
    scheme = event.scheme
    z = float(event.noise_multiplier)
    _check_noise(z)
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


# --------------------------------------------------------------------------------------------------
# Hockey-stick curves of the pairs, vectorised
# --------------------------------------------------------------------------------------------------

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


def _inverse_loss(direction: _Direction, sigma: float, q: float, eps: _Floats) -> _Floats:
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


def _stage_deltas(direction: _Direction, sigma: float, q: float, eps: _Floats) -> _Floats:
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


def _no_loss_deltas(eps: _Floats) -> _Floats:
    """``delta(eps)`` of a point mass at loss 0 (the unsampled branch): ``(1 - e^eps)_+``."""
    return -np.expm1(np.minimum(eps, 0.0))


def _pair_curves(model: RoundModel) -> list[tuple[Callable[[_Floats], _Floats], float, float]]:
    """``[(delta(eps), lowest, highest loss)]``: one entry per PMF (two for add/remove)."""
    sigma, q, w = model.sigma, model.rate, model.weight

    def mixed(stage: Callable[[_Floats], _Floats]) -> Callable[[_Floats], _Floats]:
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

        def symmetric(eps: _Floats) -> _Floats:
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


# --------------------------------------------------------------------------------------------------
# PLD: discretisation, self-composition with a size known in advance, grid planning
# --------------------------------------------------------------------------------------------------


class _Pmf(NamedTuple):
    """A PLD probability mass function: ``probs[i]`` at loss ``(lower + i) * grid``.

    ``rounding`` is the part of ``infinity_mass`` that covers floating-point rounding in the FFTs
    that built ``probs`` (see ``_fft_error``): already included, kept apart so tests can read it.
    """

    lower: int
    probs: _Floats
    infinity_mass: float
    rounding: float = 0.0


# FFT rounding, bounded and rounded the pessimistic way.
#
# The FFT leaves every probability off by rounding, of either sign; a negative error in the tail
# would lower delta below the exact composition's and so break "errs only on the safe side" (it
# did, by 3e-8 relative in epsilon at delta 1e-9, on a CPU whose numpy uses other instructions for
# exp/log). The bound: for any weights w in [0, 1] (a hockey-stick functional at any epsilon, or
# the weights a later composition puts on each point), |sum_j w_j (computed_j - exact_j)| is at
# most ``||dY||_2 + kappa ||Y||_2`` (full spectra, numpy's unnormalised DFT): Cauchy-Schwarz with
# ``||w||_2 <= sqrt(N)`` and Parseval, ``||IDFT(dY) / N||_2 = ||dY||_2 / sqrt(N)``, for an error
# ``dY`` in the spectrum, and the inverse transform's own normwise error. ``kappa`` bounds an FFT's
# error: normwise ``||fl(DFT x) - DFT x||_2 <= kappa ||DFT x||_2`` (Higham 2002, "Accuracy and
# Stability of Numerical Algorithms", 2nd ed., Theorem 24.2: ``log2(N) eta``, ``eta = mu +
# gamma_4 (sqrt 2 + mu)``, about 6.7 u a radix-2 stage), and componentwise ``|fl(DFT x)_k - (DFT
# x)_k| <= kappa ||x||_1`` (the same induction over the stages, each output a sum over a disjoint
# subsequence). We allow 8 u a stage, two stages more than log2 N (a real transform is a half-length
# complex one plus a pass), and a factor 2 for the radix-3 and -5 stages of a 5-smooth length: the
# bound errs large. It is added to the probability of an infinite loss, which raises delta at
# every epsilon by at least the possible shortfall.
_UNIT_ROUNDOFF = float(np.finfo(np.float64).eps) / 2


def _fft_error(length: int) -> float:
    """``kappa`` above for an FFT of ``length`` points (relative, see the comment above)."""
    stages = math.ceil(math.log2(max(length, 2))) + 2
    return 2.0 * stages * 8.0 * _UNIT_ROUNDOFF


def _power_rounding(
    spectrum: _Floats, powered: _Floats, count: int, kappa: float, mass: float
) -> float:
    """Bound on the delta error of ``irfft(spectrum ** count)`` (half spectra, see above).

    ``spectrum`` is the computed ``rfft`` of a PMF of total absolute mass ``mass``: each coefficient
    is within ``d = kappa * mass`` of the exact one, both of modulus at most ``m = |computed| + d``,
    so their ``count``-th powers differ by at most ``count m^(count-1) d`` (mean value theorem).
    The polar power itself (``exp(count log|z|)``, ``exp(i count arg z)``) carries a relative
    error of at most ``(count (|log|z|| + pi) + 2) 8u`` (numpy's exp/log are within 4 ulp on every
    instruction set it dispatches to; each is counted twice). A coefficient of a half spectrum
    stands for at most two of the full one: the factor sqrt(2) on each 2-norm.
    """
    d = kappa * mass
    magnitude = np.abs(spectrum)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        moved = count * np.exp((count - 1) * np.log(magnitude + d)) * d
        log_magnitude = np.where(magnitude > 0.0, np.abs(np.log(magnitude)), 0.0)
    relative = (count * (log_magnitude + math.pi) + 2.0) * 8.0 * _UNIT_ROUNDOFF
    evaluated = np.abs(powered) * relative
    spectrum_error = math.sqrt(2.0) * float(np.linalg.norm(moved + evaluated))
    inverse_error = kappa * math.sqrt(2.0) * float(np.linalg.norm(powered))
    return spectrum_error + inverse_error


#: dp-accounting's tolerance for a hockey-stick curve that rises by rounding error.
_DELTA_DIFF_TOLERANCE = 1e-12


def _connect_dots(grid: float, k_lo: int, deltas: _Floats) -> _Pmf:
    """The pessimistic connect-the-dots PMF with ``delta(k * grid) = deltas[k - k_lo]``.

    Doroshenko et al. (2022), Algorithm 1, for equally spaced epsilons, exactly as dp-accounting's
    ``create_pmf_pessimistic_connect_dots_fixed_gap`` (a test checks they agree bit for bit),
    without its detour through a dictionary. ``delta`` is convex in ``e^eps``, so the PMF's curve,
    linear in ``e^eps`` between grid points, lies above the exact one; ``delta`` at the last point
    becomes the probability of an infinite loss.
    """
    if np.any(deltas < 0.0) or np.any(deltas > 1.0):
        raise ValueError("deltas must lie in [0, 1] (a bug in a hockey-stick curve)")
    if deltas.size == 1:
        return _Pmf(k_lo, np.array([1.0 - deltas[0]]), float(deltas[0]))
    if np.any(np.diff(deltas) > _DELTA_DIFF_TOLERANCE):
        raise ValueError("deltas must be non-increasing (a bug in a hockey-stick curve)")
    deltas = np.minimum.accumulate(deltas)
    diffs = np.diff(deltas)
    probs = np.empty_like(deltas)
    probs[0] = 1.0 - deltas[0] + diffs[0] / math.expm1(grid)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(grid)) / math.expm1(grid)
    probs[-1] = diffs[-1] / math.expm1(-grid)
    return _Pmf(k_lo, np.maximum(0.0, probs), float(deltas[-1]))


def _grid_range(lo: float, hi: float, grid: float) -> tuple[int, int]:
    # The point 0 must be on the grid: it carries the unsampled branch of a mixture.
    return math.floor(min(lo, 0.0) / grid), math.ceil(max(hi, 0.0) / grid)


@functools.lru_cache(maxsize=64)
def _span(model: RoundModel) -> float:
    """Widest loss range of the model's PMFs (sets the number of grid points of one round)."""
    return max(max(hi, 0.0) - min(lo, 0.0) for _, lo, hi in _pair_curves(model))


@functools.lru_cache(maxsize=16)
def _round_pmfs(model: RoundModel, grid: float) -> tuple[_Pmf, ...]:
    """Connect-the-dots PMFs of one round on ``grid`` (remove[, add] or the symmetric one)."""
    out = []
    for curve, lo, hi in _pair_curves(model):
        k_lo, k_hi = _grid_range(lo, hi, grid)
        eps = np.arange(k_lo, k_hi + 1, dtype=np.float64) * grid
        out.append(_connect_dots(grid, k_lo, curve(eps)))
    return tuple(out)


def _log_mgf(log_probs: _Floats, index: _Floats, theta: float) -> float:
    """``log sum_k p_k e^(theta k)`` from ``log p``: the moment generating function of the index."""
    exponent = log_probs + theta * index
    top = float(exponent.max())
    # Terms below e^-700 of the largest are raised to it: no subnormal arithmetic (very slow), and
    # the sum can only grow, so the window can only widen, which is safe.
    return top + math.log(float(np.exp(np.maximum(exponent - top, -700.0)).sum()))


def _tail_window(probs: _Floats, count: int) -> tuple[int, int]:
    """Indices ``[lo, hi]`` of the ``count``-fold sum outside which at most ``TAIL_MASS`` lies.

    Chernoff: ``P(S >= t) <= exp(count * log M(theta) - theta t)`` for ``theta > 0`` (and the mirror
    for the lower tail), ``M`` the moment generating function of one round's index: dp-accounting's
    bound, at orders around the Gaussian optimum as well as two of dp-accounting's, so the window is
    rarely wider than dp-accounting's. Each tail is cut at ``TAIL_MASS / 2``.
    """
    support = np.flatnonzero(probs > 0.0)
    if support.size == 0:
        return 0, 0
    lo, hi = count * int(support[0]), count * int(support[-1])
    if count == 1 or lo == hi:
        return lo, hi
    index = support.astype(np.float64)
    weights = probs[support]
    log_probs = np.log(weights)
    mass = float(weights.sum())
    mean = float(index @ weights) / mass
    var = float(((index - mean) ** 2) @ weights) / mass
    log_2_over_tail = math.log(2.0 / TAIL_MASS)
    scale = math.sqrt(2.0 * log_2_over_tail / (count * var)) if var > 0 else 1.0 / probs.size
    thetas = [scale * f for f in (0.5, 0.8, 1.0, 1.25, 2.0)] + [1 / probs.size, 20 / probs.size]
    for theta in thetas:
        for sign in (1.0, -1.0):
            log_mgf = _log_mgf(log_probs, index, sign * theta)
            bound = (count * log_mgf + log_2_over_tail) / (sign * theta)
            if not math.isfinite(bound):
                continue
            if sign > 0:
                hi = min(hi, math.ceil(bound))
            else:
                lo = max(lo, math.floor(bound))
    return lo, max(lo, hi)


@functools.lru_cache(maxsize=256)
def _window(model: RoundModel, grid: float, direction: int, count: int) -> tuple[int, int]:
    return _tail_window(_round_pmfs(model, grid)[direction].probs, count)


def _self_compose(pmf: _Pmf, count: int, window: tuple[int, int]) -> _Pmf:
    """``count``-fold composition by one FFT power (cost independent of ``count``).

    The ``window`` comes from ``_tail_window`` before anything is allocated; the cyclic FFT folds
    the (at most ``TAIL_MASS``) mass outside it back in, and ``TAIL_MASS`` is added to the infinite
    loss to cover both: the result errs on the safe side, as dp-accounting's ``self_compose``.
    """
    from scipy import fft

    if count == 1:
        return pmf
    lo, hi = window
    length = fft.next_fast_len(max(hi - lo + 1, pmf.probs.size), real=True)
    kappa = _fft_error(length)
    spectrum = fft.rfft(pmf.probs, length)
    # z**count in polar form, several times faster than complex power and as accurate: both carry
    # a relative error of about count * 1e-16, bounded in _power_rounding and added to delta.
    with np.errstate(divide="ignore"):
        log_magnitude = np.log(np.abs(spectrum))
    powered = np.exp(count * log_magnitude + 1j * (count * np.angle(spectrum)))
    del log_magnitude
    mass = float(np.abs(pmf.probs).sum())
    rounding = _power_rounding(spectrum, powered, count, kappa, mass)
    del spectrum
    full = fft.irfft(powered, length)
    del powered
    probs = np.take(full, np.arange(lo, hi + 1) % length)
    # The input's own rounding is inside its infinity_mass, composed with it here.
    infinity = TAIL_MASS + rounding - math.expm1(count * math.log1p(-pmf.infinity_mass))
    return _Pmf(count * pmf.lower + lo, probs, min(1.0, infinity), rounding + count * pmf.rounding)


def _compose(a: _Pmf, b: _Pmf) -> _Pmf:
    """Two different PMFs composed (convolution), tails cut as dp-accounting's ``compose``.

    At most ``TAIL_MASS / 2`` is cut from each end: the low end's mass moves up onto the first kept
    point and the high end's to an infinite loss, both on the safe side.
    """
    from scipy import signal

    probs = signal.fftconvolve(a.probs, b.probs)
    rounding = _convolution_rounding(a.probs, b.probs, probs.size)
    infinity = a.infinity_mass + b.infinity_mass - a.infinity_mass * b.infinity_mass + rounding
    head = np.cumsum(probs)
    tail = np.cumsum(probs[::-1])
    left = int(np.argmax(head > TAIL_MASS / 2)) if head[-1] > TAIL_MASS / 2 else probs.size
    right = probs.size - (int(np.argmax(tail > TAIL_MASS / 2)) if tail[-1] > TAIL_MASS / 2 else 0)
    right = max(right, left + 1)
    kept = probs[left:right].copy()
    kept[0] += probs[:left].sum()
    infinity = min(1.0, infinity + float(probs[right:].sum()))
    return _Pmf(a.lower + b.lower + left, kept, infinity, a.rounding + b.rounding + rounding)


def _convolution_rounding(a: _Floats, b: _Floats, size: int) -> float:
    """Bound on the delta error of ``fftconvolve(a, b)`` (see the comment above ``_fft_error``).

    With ``A``, ``B`` the exact full spectra (length ``L >= size``), each computed coefficient is
    within ``d_a = kappa ||a||_1`` (``d_b``), ``|A_k| <= ||a||_1``, ``||A||_2 = sqrt(L) ||a||_2``:
    ``||dY||_2 <= sqrt(L) (d_b ||a||_2 + d_a ||b||_2 + d_a d_b) + 2u ||Y||_2`` and ``||Y||_2 <=
    sqrt(L) ||a||_1 ||b||_2``. The inputs' own errors are carried by their ``rounding`` (a
    composition puts weights in [0, 1] on them, times the other's mass, at most 1).
    """
    from scipy import fft

    length = fft.next_fast_len(size, real=True)
    kappa = _fft_error(length)
    l1_a, l1_b = float(np.abs(a).sum()), float(np.abs(b).sum())
    l2_a, l2_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    d_a, d_b = kappa * l1_a, kappa * l1_b
    y_norm = math.sqrt(length) * min(l1_a * l2_b, l1_b * l2_a)
    spectrum_error = math.sqrt(length) * (d_b * l2_a + d_a * l2_b + d_a * d_b)
    return spectrum_error + (2.0 * _UNIT_ROUNDOFF + kappa) * y_norm


def _epsilon_for_delta(pmf: _Pmf, grid: float, delta: float) -> float:
    """Smallest epsilon >= 0 with ``delta(epsilon) <= delta`` for one PMF, vectorised and stable.

    Between two grid losses ``delta(eps) = P(inf) + U - e^eps L`` with ``U`` and ``L`` the sums of
    ``P`` and ``e^-loss P`` over the losses above ``eps``: the root in the first interval where
    ``delta`` drops below the target is ``log(P(inf) + U - delta) - log(L)`` (dp-accounting's
    ``_get_epsilon_for_delta``, which walks down the losses one at a time). ``log L`` is formed as
    ``-loss_k + log(P_k + S_k)`` with ``S`` a discounted suffix sum (a first-order filter), so no
    ``e^-loss`` is ever formed: losses above 709 would overflow it, and dp-accounting then answers
    infinity. Negative probabilities (FFT rounding) count as 0, which can only raise delta.
    """
    from scipy import signal

    if pmf.infinity_mass > delta:
        return math.inf
    probs = np.maximum(pmf.probs, 0.0)
    size = probs.size
    losses = (pmf.lower + np.arange(size)) * grid
    # above[k] = sum of P over losses > loss_k; tilt[k] = sum_{j > k} P_j e^-(loss_j - loss_k).
    above = np.concatenate((np.cumsum(probs[::-1])[::-1][1:], [0.0]))
    shifted = np.concatenate((probs[1:], [0.0]))
    tilt = signal.lfilter([math.exp(-grid)], [1.0, -math.exp(-grid)], shifted[::-1])[::-1]
    deltas = pmf.infinity_mass + above - tilt  # delta(loss_k), exact on the grid
    below = np.flatnonzero(deltas <= delta)
    k = int(below[0]) if below.size else size - 1
    # Root in [loss_(k-1), loss_k): the losses above it are loss_k, loss_(k+1), ...
    mass_upper = pmf.infinity_mass + probs[k] + above[k]
    log_mass_lower = -float(losses[k]) + math.log(max(probs[k] + tilt[k], 1e-300))
    if mass_upper <= delta:
        return 0.0
    return max(0.0, math.log(mass_upper - delta) - log_mass_lower)


def _delta_for_epsilon(pmf: _Pmf, grid: float, epsilon_value: float) -> float:
    """``delta(epsilon) = P(inf) + sum over losses above epsilon of (1 - e^(eps - loss)) P``."""
    losses = (pmf.lower + np.arange(pmf.probs.size)) * grid
    above = losses > epsilon_value
    probs = np.maximum(pmf.probs[above], 0.0)  # FFT noise below 0 counts as 0: only raises delta
    return pmf.infinity_mass + float(-np.expm1(epsilon_value - losses[above]) @ probs)


ModelGroups: TypeAlias = tuple[tuple[RoundModel, int], ...]


@functools.lru_cache(maxsize=256)
def _window_size(model: RoundModel, grid: float, count: int) -> int:
    """Grid points of the composed PMFs of ``count`` rounds of ``model`` (all directions)."""
    sizes = []
    for direction in range(len(_round_pmfs(model, grid))):
        lo, hi = _window(model, grid, direction, count)
        sizes.append(hi - lo + 1)
    return sum(sizes)


def _plan_grid(groups: ModelGroups, base: float) -> float | None:
    """The finest grid ``base * 2**k`` on which every PLD fits the size limits, or None.

    Sizes scale like ``1 / grid``, so one jump by the measured excess usually suffices.
    """
    k = 0
    for model, _ in groups:
        excess = _span(model) / (base * MAX_ROUND_BINS)
        if excess > 1.0:
            k = max(k, math.ceil(math.log2(excess)))
    while True:
        grid = base * 2.0**k
        if grid > MAX_GRID:
            return None
        # Composing two groups convolves them: the result has the sum of their sizes.
        total = sum(_window_size(model, grid, count) for model, count in groups)
        if total <= MAX_PLD_BINS:
            return grid
        k += max(1, math.ceil(math.log2(total / MAX_PLD_BINS)))


@functools.lru_cache(maxsize=4)
def _composed_on(groups: ModelGroups, grid: float) -> tuple[_Pmf, ...]:
    """The composed PMFs on ``grid``: one (symmetric) or two (remove, add)."""
    result: tuple[_Pmf, ...] = ()
    for model, count in groups:
        parts = tuple(
            _self_compose(pmf, count, _window(model, grid, direction, count))
            for direction, pmf in enumerate(_round_pmfs(model, grid))
        )
        if not result:
            result = parts
        elif len(result) == 1 and len(parts) == 1:
            result = (_compose(result[0], parts[0]),)
        else:  # a symmetric PMF serves as both directions
            result = (
                _compose(result[0], parts[0]),
                _compose(result[-1], parts[-1]),
            )
    return result


def _model_groups(rounds: RoundGroups, unit: Unit) -> ModelGroups:
    """Validated groups as ``(RoundModel, count)``, rounds with the same pair merged."""
    merged: dict[RoundModel, int] = {}
    for event, count in _check_groups(rounds):
        model = round_components(event, unit)
        merged[model] = merged.get(model, 0) + count
    return tuple(sorted(merged.items(), key=lambda kv: repr(kv[0])))


def _pld_parts(groups: ModelGroups, discretization: float) -> tuple[tuple[_Pmf, ...], float] | None:
    """The composed PMFs and their grid (the finest that fits), or None when none fits."""
    grid = _plan_grid(groups, discretization)
    return None if grid is None else (_composed_on(groups, grid), grid)


def _check_discretization(discretization: float) -> None:
    if not (isinstance(discretization, float) and 0.0 < discretization <= MAX_GRID):
        raise ValueError(
            f"discretization must be a float in (0, {MAX_GRID}]; got {discretization!r}"
        )


def round_pld(
    event: GaussianRound, unit: Unit = "task", *, discretization: float = DEFAULT_DISCRETIZATION
) -> _PLD:
    """The pessimistic PLD of one round, on ``discretization`` or the finest coarser grid that fits.

    Raises ValueError when no grid up to ``MAX_GRID`` fits (tiny noise): use ``epsilon``.
    """
    return _require(composed_pld([(event, 1)], unit, discretization=discretization))


def composed_pld(
    rounds: RoundGroups, unit: Unit = "task", *, discretization: float = DEFAULT_DISCRETIZATION
) -> _PLD | None:
    """PLD of all rounds (identical rounds self-composed by count), or None for no rounds.

    A dp-accounting ``PrivacyLossDistribution`` (pessimistic). Raises ValueError when no grid up to
    ``MAX_GRID`` fits the size limits (use ``epsilon``, which then answers with RDP).
    """
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    _check_discretization(discretization)
    groups = _model_groups(rounds, unit)
    if not groups:
        return None
    found = _pld_parts(groups, discretization)
    if found is None:
        return _require(None)
    parts, grid = found
    pmfs = [pld_pmf.DensePLDPmf(grid, p.lower, p.probs, p.infinity_mass, True) for p in parts]
    return pld_lib.PrivacyLossDistribution(pmfs[0], pmfs[1] if len(pmfs) > 1 else None)


def _require(pld: _PLD | None) -> _PLD:
    if pld is None:
        raise ValueError(
            f"rounds need a PLD grid coarser than {MAX_GRID} to stay within {MAX_PLD_BINS} points "
            "(tiny noise or very many rounds); epsilon() answers with the RDP bound instead"
        )
    return pld


# --------------------------------------------------------------------------------------------------
# RDP
# --------------------------------------------------------------------------------------------------


def _sanitize(values: npt.ArrayLike) -> _Floats:
    # dp-accounting turns a negative RDP value (numerical trouble) into epsilon 0: optimistic. An
    # order with a negative or NaN value is dropped instead (its bound becomes infinite).
    arr = np.asarray(values, dtype=np.float64)
    return np.where(np.isnan(arr) | (arr < 0.0), np.inf, arr)


def _rdp_of(event: dp_event.DpEvent, orders: Sequence[float], *, replace: bool = False) -> _Floats:
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


def _stage_rdp(model: RoundModel) -> _Floats:
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
def _rdp_curve(model: RoundModel) -> tuple[float, ...]:
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


def _rdp_total(groups: ModelGroups) -> _Floats:
    total = np.zeros(len(RDP_ORDERS))
    for model, count in groups:
        total = total + count * np.asarray(_rdp_curve(model))
    return total


def _rdp_epsilon(groups: ModelGroups, delta: float) -> float:
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not groups:
        return 0.0
    total = _rdp_total(groups)
    if np.all(np.isinf(total)):
        return math.inf
    eps, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), total, delta)
    return float(eps)


def _rdp_delta(groups: ModelGroups, epsilon_value: float) -> float:
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not groups:
        return 0.0
    total = _rdp_total(groups)
    if np.all(np.isinf(total)):
        return 1.0
    delta, _ = rdp_lib.compute_delta(np.asarray(RDP_ORDERS), total, epsilon_value)
    return float(delta)


# --------------------------------------------------------------------------------------------------
# Public: epsilon and delta
# --------------------------------------------------------------------------------------------------


def _groups_epsilon(
    groups: ModelGroups, delta: float, method: Method, discretization: float
) -> float:
    if not groups:
        return 0.0
    rdp = _rdp_epsilon(groups, delta)
    if method == "rdp":
        return rdp
    found = _pld_parts(groups, discretization)
    if found is None:
        return rdp
    parts, grid = found
    pld_eps = max(_epsilon_for_delta(part, grid, delta) for part in parts)
    return min(max(0.0, pld_eps), rdp)


def epsilon(
    rounds: RoundGroups,
    delta: float,
    unit: Unit = "task",
    method: Method = "pld",
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Return epsilon at ``delta`` after ``rounds``, a list of ``(GaussianRound, count)``.

    ``method="pld"`` is the value fedmeta enforces: the pessimistic PLD on the finest grid within
    the size limits, or the RDP bound where that is smaller (both are upper bounds).
    ``method="rdp"`` is the RDP bound alone, the looser independent cross-check. May be ``inf``
    (no finite bound).
    """
    check_delta(delta)
    check_unit(unit)
    _check_method(method)
    _check_discretization(discretization)
    return _groups_epsilon(_model_groups(rounds, unit), delta, method, discretization)


def pld_delta(
    rounds: RoundGroups,
    epsilon_value: float,
    unit: Unit = "task",
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Smallest delta (pessimistic PLD, or RDP where smaller) with the rounds (eps, delta)-DP."""
    check_unit(unit)
    _check_discretization(discretization)
    if not (isinstance(epsilon_value, int | float) and epsilon_value >= 0):
        raise ValueError(f"epsilon_value must be a number >= 0; got {epsilon_value!r}")
    groups = _model_groups(rounds, unit)
    if not groups:
        return 0.0
    rdp = _rdp_delta(groups, float(epsilon_value))
    found = _pld_parts(groups, discretization)
    if found is None:
        return rdp
    parts, grid = found
    return min(rdp, max(_delta_for_epsilon(part, grid, float(epsilon_value)) for part in parts))


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
    valid one for comparison and is never used to enforce a budget (add/remove form, whatever the
    event's relation: it is the published statement).
    """
    check_delta(delta)
    scheme = event.scheme
    if not isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme):
        raise ValueError(
            "scheme must be two-stage for the Tombs et al. (2022) Theorem-3 value; "
            f"got {type(scheme).__name__}"
        )
    rounds = _check_rounds("rounds", rounds, minimum=0)
    if rounds == 0:
        return 0.0
    _check_noise(float(event.noise_multiplier))
    model = RoundModel(
        1.0, scheme.largest_inclusion_probability, float(event.noise_multiplier), "add_remove"
    )
    return _groups_epsilon(((model, rounds),), delta, "pld", discretization)


# --------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------


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
    _check_method(method)
    rounds = _check_rounds("rounds", rounds, minimum=1)
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
    event: GaussianRound,
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
    _check_method(method)
    _check_discretization(discretization)
    budget = _check_target("epsilon_budget", epsilon_budget, allow_zero=True)
    if not isinstance(event, GaussianRound):
        raise ValueError(f"event must be a GaussianRound; got {event!r}")
    limit = _check_rounds("limit", limit, minimum=0)
    base = _model_groups([*prior, (event, 1)], unit)  # validates prior, relation and the event
    model = round_components(event, unit)
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
            cache[(extra, how)] = _groups_epsilon(groups_at(extra), delta, how, discretization)
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
