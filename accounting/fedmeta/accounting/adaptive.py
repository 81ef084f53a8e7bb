"""Adaptive clipping whose cost is accounted: the noise split and the geometric clip update.

Andrew, Thakkar, McMahan, Ramaswamy (2021), "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021, Algorithm 1 and Theorem 1. Every round, next to the clipped gradient sum,
each sampled task reports one bit ``b = [||g|| <= C_t]`` (its *pre-clip* norm against the round's
bound) and the server releases the noisy count of the lot's bits. The bound then moves
geometrically toward the ``gamma`` quantile of the task norms.

The joint release and its accounting
------------------------------------
A round releases, from the one sampled lot ``S``,

    sum_{i in S} clip_C(g_i) + N(0, (z_grad C)^2 I)    and    sum_{i in S} (b_i - 1/2) + N(0, s_b^2)

(fedmeta releases the *centred* count, Andrew et al.'s Section 3.1 device, and the server turns it
into the fraction ``b~ = count~ / E[lot] + 1/2`` with the *public* expected lot: post-processing).
Divide the gradient coordinates by ``z_grad C`` and the count by ``s_b``: the pair is one Gaussian
mechanism with unit noise in ``d + 1`` dimensions in which each task contributes the vector
``(clip_C(g) / (z_grad C), (b - 1/2) / s_b)``, of norm at most

    sqrt(z_grad^-2 + (2 s_b)^-2) = 1 / z,   z = (z_grad^-2 + (2 s_b)^-2)^(-1/2)        (Theorem 1)

which is exactly the norm bound ``C / (z C)`` of a plain round at noise multiplier ``z``. Every
dominating pair in ``accounting.composition`` is a pair of (subsampled) isotropic Gaussians that
depends on the contributions only through such a norm bound, so the joint release is accounted
exactly (not approximately) by ``GaussianRound(scheme, z)``, for every scheme and unit:

* ``add_remove``, Poisson stage 2 (or flat Poisson): adding a task adds a vector of norm at most
  ``1/z`` (``|b - 1/2| = 1/2``, the count's sensitivity is 1/2 because the bits are centred; an
  uncentred count would have sensitivity 1 and give ``(z_grad^-2 + s_b^-2)^(-1/2)`` instead).
* ``add_remove`` with a fixed-size stage 2, and ``replace_one`` (any scheme): one task's vector is
  swapped for another's. The gradient sum moves by up to ``2C`` and the count by up to **1** (a bit
  0 replaced by a bit 1): both sensitivities double, their ratio is unchanged, and the difference
  has whitened norm at most ``2/z``, which is what the accountant's ``z/2`` pairs and REPLACE pairs
  (contributions ``v``, ``-v`` of norm ``1/z``: a bit ``b`` against ``1 - b``) assume.
* participant level (a participant substituted in the fixed-size stage 1, at most ``k`` tasks):
  gradient ``2kC``, count ``k``; again the same ratio, so the same ``z``.

The worst cases are attained (a task with pre-clip norm exactly ``C`` has ``b = 1`` and a clipped
norm ``C``; one above ``C`` has ``b = 0`` and clipped norm ``C``), so the accounting is tight, and
the only approximation is floating point: :func:`gradient_noise_multiplier` rounds ``z_grad`` *up*
until the combined multiplier is at least ``z``, so it errs on the safe side. The bit is reported
by the participant and cannot be checked by the server; the bound needs only that it is 0 or 1,
which the protocol enforces. Released clip bounds are functions of the released counts only.

This module is pure (standard library only), like the rest of ``accounting``.
"""

from __future__ import annotations

import math

from fedmeta.accounting.checks import check_positive

#: Andrew et al.'s default count noise: ``s_b = E[lot] / 20`` (their Section 4).
DEFAULT_COUNT_NOISE_FRACTION = 1.0 / 20.0


def combined_noise_multiplier(gradient_noise_multiplier: float, count_noise: float) -> float:
    """``z = (z_grad^-2 + (2 s_b)^-2)^(-1/2)``: one Gaussian mechanism for a round's two releases.

    Andrew et al. (2021), Theorem 1, with centred bits (module docstring):
    ``gradient_noise_multiplier`` is ``z_grad`` relative to the clip bound, ``count_noise`` the
    standard deviation ``s_b`` of the noise on the count of bits, in tasks.
    """
    zg = check_positive("gradient_noise_multiplier", gradient_noise_multiplier)
    sb = check_positive("count_noise", count_noise)
    return float((zg**-2 + (2.0 * sb) ** -2) ** -0.5)


def gradient_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """``z_grad = (z^-2 - (2 s_b)^-2)^(-1/2)``: the gradient's share of a total multiplier ``z``.

    Inverts :func:`combined_noise_multiplier`: with this ``z_grad`` on the gradient sum and
    ``count_noise`` on the centred count, the round is accounted as one Gaussian round at ``z``.
    Feasible only when ``2 s_b > z`` (the count alone must not cost more than the whole budget of
    a round); otherwise a ``ValueError`` names ``count_noise``. The result is rounded up (by ulps)
    until ``combined_noise_multiplier(z_grad, s_b) >= z``: the floating-point error errs on the
    side of more noise.
    """
    z = check_positive("noise_multiplier", noise_multiplier)
    sb = check_positive("count_noise", count_noise)
    spare = z**-2 - (2.0 * sb) ** -2
    if not spare > 0.0:
        raise ValueError(
            f"count_noise must be > noise_multiplier / 2 = {z / 2:g} (the count alone would spend "
            f"the whole round's noise); got {sb:g}"
        )
    zg = float(spare**-0.5)
    while combined_noise_multiplier(zg, sb) < z:
        zg = math.nextafter(zg, math.inf)
    return zg


def noisy_fraction(noisy_centred_count: float, expected_lot: float) -> float:
    """Andrew et al.'s ``b~``: the released centred count over the *public* expected lot, plus 1/2.

    Never the realised number of tasks: that is private under add/remove (Opacus issue #571). Its
    expectation is the fraction of tasks under the bound when ``expected_lot`` is the expected
    number of tasks received. Post-processing of the release.
    """
    if not math.isfinite(noisy_centred_count):
        raise ValueError(f"noisy_centred_count must be finite; got {noisy_centred_count!r}")
    return float(noisy_centred_count) / check_positive("expected_lot", expected_lot) + 0.5


def next_clip(
    clip: float,
    fraction: float,
    target_quantile: float,
    learning_rate: float,
    bounds: tuple[float, float] = (0.0, math.inf),
) -> float:
    """``C_{t+1} = C_t exp(-eta (b~ - gamma))``, clamped to ``bounds``: Andrew et al., Algorithm 1.

    Geometric update of the bound toward the ``gamma = target_quantile`` quantile of the task norms:
    when more than a ``gamma`` share of the tasks is under the bound it shrinks, otherwise it grows.
    A function of the released ``fraction`` and public constants only (post-processing).
    """
    c = check_positive("clip", clip)
    if not (isinstance(target_quantile, int | float) and 0.0 < target_quantile < 1.0):
        raise ValueError(f"target_quantile must be in (0, 1); got {target_quantile!r}")
    eta = check_positive("learning_rate", learning_rate)
    if not math.isfinite(fraction):
        raise ValueError(f"fraction must be finite; got {fraction!r}")
    low, high = bounds
    if not (0.0 <= low < high):
        raise ValueError(f"bounds must satisfy 0 <= low < high; got {bounds!r}")
    updated = c * math.exp(-eta * (fraction - target_quantile))
    return min(max(updated, low), high) if updated > 0 else max(low, math.ulp(0.0))
