"""The PLD engine: pessimistic PMFs of a round's pairs, self-composed by one FFT power, and read.

Connect-the-dots discretisation, tail windows, FFT composition with its rounding bounded and added
to delta, and epsilon/delta of a PMF (``composition``'s module docstring has the mathematics).
scipy is imported where an FFT runs.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from fedmeta.accounting.pairs import Floats, ModelGroups, RoundModel, pair_curves

#: Most grid points of one round's PLD, and of a composed PLD (about 8 B each, a few copies live).
MAX_ROUND_BINS = 2**18


MAX_PLD_BINS = 2**22


#: Coarsest PLD grid tried; beyond it the RDP bound alone is used.
MAX_GRID = 1.0


#: Probability mass a self-composition may cut from the tails (moved to an infinite loss).
TAIL_MASS = 1e-15


class _Pmf(NamedTuple):
    """A PLD probability mass function: ``probs[i]`` at loss ``(lower + i) * grid``.

    ``rounding`` is the part of ``infinity_mass`` that covers floating-point rounding in the FFTs
    that built ``probs`` (see ``_fft_error``): already included, kept apart so tests can read it.
    """

    lower: int
    probs: Floats
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
    spectrum: Floats, powered: Floats, count: int, kappa: float, mass: float
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


def _connect_dots(grid: float, k_lo: int, deltas: Floats) -> _Pmf:
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
    return max(max(hi, 0.0) - min(lo, 0.0) for _, lo, hi in pair_curves(model))


@functools.lru_cache(maxsize=16)
def _round_pmfs(model: RoundModel, grid: float) -> tuple[_Pmf, ...]:
    """Connect-the-dots PMFs of one round on ``grid`` (remove[, add] or the symmetric one)."""
    out = []
    for curve, lo, hi in pair_curves(model):
        k_lo, k_hi = _grid_range(lo, hi, grid)
        eps = np.arange(k_lo, k_hi + 1, dtype=np.float64) * grid
        out.append(_connect_dots(grid, k_lo, curve(eps)))
    return tuple(out)


def _log_mgf(log_probs: Floats, index: Floats, theta: float) -> float:
    """``log sum_k p_k e^(theta k)`` from ``log p``: the moment generating function of the index."""
    exponent = log_probs + theta * index
    top = float(exponent.max())
    # Terms below e^-700 of the largest are raised to it: no subnormal arithmetic (very slow), and
    # the sum can only grow, so the window can only widen, which is safe.
    return top + math.log(float(np.exp(np.maximum(exponent - top, -700.0)).sum()))


def _tail_window(probs: Floats, count: int) -> tuple[int, int]:
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


def _convolution_rounding(a: Floats, b: Floats, size: int) -> float:
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


def epsilon_for_delta(pmf: _Pmf, grid: float, delta: float) -> float:
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


def delta_for_epsilon(pmf: _Pmf, grid: float, epsilon_value: float) -> float:
    """``delta(epsilon) = P(inf) + sum over losses above epsilon of (1 - e^(eps - loss)) P``."""
    losses = (pmf.lower + np.arange(pmf.probs.size)) * grid
    above = losses > epsilon_value
    probs = np.maximum(pmf.probs[above], 0.0)  # FFT noise below 0 counts as 0: only raises delta
    return pmf.infinity_mass + float(-np.expm1(epsilon_value - losses[above]) @ probs)


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


def pld_parts(groups: ModelGroups, discretization: float) -> tuple[tuple[_Pmf, ...], float] | None:
    """The composed PMFs and their grid (the finest that fits), or None when none fits."""
    grid = _plan_grid(groups, discretization)
    return None if grid is None else (_composed_on(groups, grid), grid)
