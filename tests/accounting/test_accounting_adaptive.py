"""Adaptive clipping's accounting (fedmeta.accounting.adaptive) against independent values.

Oracles: hand values and mpmath for the split formula; for the claim that the joint release (noisy
gradient sum and noisy centred count) *is* one Gaussian round at the total ``z``, the exact
hockey-stick divergence of the two-dimensional release, integrated on a grid, against the
accountant's own delta for ``GaussianRound(scheme, z)`` (which must cover it, and tightly).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmeta.accounting import (
    GaussianRound,
    TwoStagePoissonScheme,
    combined_noise_multiplier,
    gradient_noise_multiplier,
    next_clip,
    noisy_fraction,
    pld_delta,
)

pytestmark = pytest.mark.unit


def _mp_split(z: float, sb: float) -> float:
    mpmath.mp.dps = 50
    return float((mpmath.mpf(z) ** -2 - (2 * mpmath.mpf(sb)) ** -2) ** mpmath.mpf(-0.5))


@pytest.mark.parametrize(
    ("z", "count_noise", "expected"),
    [
        (1.0, 1.0, 2 / math.sqrt(3)),  # (1 - 1/4)^(-1/2)
        (1.0, 5.0, 1 / math.sqrt(0.99)),  # Andrew et al.: m = 100 clients, s_b = m / 20
        (2.0, 1.25, 10 / 3),  # (1/4 - 4/25)^(-1/2) = (9/100)^(-1/2)
        (0.745, 80.0, None),  # issue 12's Omniglot z with s_b = E[lot] / 20 at E[lot] = 1600
    ],
)
def test_the_split_matches_hand_and_mpmath_values(
    z: float, count_noise: float, expected: float | None
) -> None:
    zg = gradient_noise_multiplier(z, count_noise)
    reference = _mp_split(z, count_noise)
    if expected is not None:
        assert reference == pytest.approx(expected, rel=1e-15)
    assert zg == pytest.approx(reference, rel=4e-16 * 8)
    assert zg >= reference * (1 - 1e-16)  # rounded up, never down
    assert combined_noise_multiplier(zg, count_noise) >= z  # the safe side, exactly in floats


@settings(max_examples=300, deadline=None)
@given(
    z=st.floats(min_value=1e-3, max_value=1e3),
    ratio=st.floats(min_value=1.0 + 1e-9, max_value=1e6),
)
def test_the_split_never_undershoots_the_total(z: float, ratio: float) -> None:
    sb = z / 2 * ratio
    zg = gradient_noise_multiplier(z, sb)
    assert zg >= z and combined_noise_multiplier(zg, sb) >= z
    assert combined_noise_multiplier(zg, sb) == pytest.approx(z, rel=1e-9)


def test_an_infeasible_split_names_the_count_noise() -> None:
    for sb in (0.5, 0.4):
        with pytest.raises(ValueError, match=r"count_noise must be > noise_multiplier / 2 = 0\.5"):
            gradient_noise_multiplier(1.0, sb)
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="count_noise"):
            gradient_noise_multiplier(1.0, bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------- the joint release is one round


def _grid(std: tuple[float, float], n: int = 1201) -> tuple[np.ndarray, np.ndarray, float]:
    """A 2-D grid over +-9 standard deviations around the means (0..1), and its cell area."""
    xs = np.linspace(-9 * std[0] - 1, 9 * std[0] + 1, n)
    ys = np.linspace(-9 * std[1] - 1, 9 * std[1] + 1, n)
    x, y = np.meshgrid(xs, ys, indexing="ij")
    return x, y, float((xs[1] - xs[0]) * (ys[1] - ys[0]))


def _density(x: np.ndarray, y: np.ndarray, mean: tuple[float, float], std: tuple[float, float]):
    return (
        np.exp(-0.5 * ((x - mean[0]) / std[0]) ** 2 - 0.5 * ((y - mean[1]) / std[1]) ** 2)
        / (2 * math.pi * std[0] * std[1])
    )  # fmt: skip


def _joint_delta(eps: float, q: float, shift: tuple[float, float], std: tuple[float, float],
                 replace: bool) -> float:  # fmt: skip
    """Exact delta(eps) of one round of the 2-D release, both orders (grid quadrature).

    add/remove: ``(1-q) N(0) + q N(shift)`` against ``N(0)``; replace-one: against ``(1-q) N(0) +
    q N(-shift)``. ``shift`` is the target task's contribution (clipped gradient, centred bit).
    """
    x, y, area = _grid(std)
    base = _density(x, y, (0.0, 0.0), std)
    p = (1 - q) * base + q * _density(x, y, shift, std)
    other = (-shift[0], -shift[1])
    r = (1 - q) * base + q * _density(x, y, other, std) if replace else base
    a = float(np.maximum(p - math.exp(eps) * r, 0).sum() * area)
    b = float(np.maximum(r - math.exp(eps) * p, 0).sum() * area)
    return max(a, b)


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_the_joint_release_is_exactly_the_gaussian_round_at_the_total_z(relation: str) -> None:
    """Andrew et al. (2021), Thm 1, with centred bits: gradient at z_grad, count at s_b = one z.

    z = 1, s_b = 0.75 (z_grad = 1.342), Poisson rate 0.3, C = 1. The task's contribution is
    (C, +-1/2) (its clipped gradient and centred bit); under replace-one the other task's is the
    opposite. The accountant's delta for GaussianRound(z) must cover the true delta (pessimistic
    PLD) and be tight (within 2%). An *uncentred* bit (shift 1) is not covered: the check has power.
    """
    z, sb, q = 1.0, 0.75, 0.3
    zg = gradient_noise_multiplier(z, sb)
    event = GaussianRound(TwoStagePoissonScheme(1, 1, q), z, neighbouring=relation)  # type: ignore[arg-type]
    replace = relation == "replace_one"
    for eps in (0.25, 0.75, 1.5):
        accountant = pld_delta([(event, 1)], eps)
        true = _joint_delta(eps, q, (1.0, 0.5), (zg, sb), replace)
        # Equal to ~1e-10 (the grid quadrature is accurate to ~1e-9 relative at 1201 points).
        assert true <= accountant * (1 + 1e-8), (eps, true, accountant)
        assert accountant <= true * 1.02 + 1e-6, (eps, true, accountant)
        if not replace:  # sum b_i: the count moves by 1, twice what the split assumes
            assert _joint_delta(eps, q, (1.0, 1.0), (zg, sb), False) > accountant * 1.2


# ----------------------------------------------------------------- the update rule


def test_the_fraction_uses_the_public_expected_lot_and_the_bound_moves_toward_the_target() -> None:
    assert noisy_fraction(0.0, 100.0) == 0.5 and noisy_fraction(40.0, 100.0) == pytest.approx(0.9)
    assert next_clip(1.0, 0.9, 0.5, 0.2) == pytest.approx(math.exp(-0.08))  # too many under: down
    assert next_clip(1.0, 0.1, 0.5, 0.2) == pytest.approx(math.exp(0.08))  # too few under: up
    assert next_clip(1.0, 0.5, 0.5, 0.2) == 1.0
    assert next_clip(1.0, -100.0, 0.5, 1.0, (0.1, 2.0)) == 2.0  # clamped to the bounds
    assert next_clip(1.0, 100.0, 0.5, 1.0, (0.1, 2.0)) == 0.1
    for bad in ((0.0, 0.5, 0.5, 0.2), (1.0, math.nan, 0.5, 0.2), (1.0, 0.5, 1.0, 0.2),
                (1.0, 0.5, 0.5, 0.0)):  # fmt: skip
        with pytest.raises(ValueError):
            next_clip(*bad)
    with pytest.raises(ValueError, match="expected_lot"):
        noisy_fraction(1.0, 0.0)
