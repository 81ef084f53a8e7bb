"""The floating-point residual of the release: the cell computation, the bound folded in.

server/fedmeta/server/noise.py releases ``round((S + std Z) / grid)`` computed in cells of the grid,
so that the
one inexact addition is of numbers under 2^16 whatever ``|S|``; ``float_residual`` folds the
remaining per-cell factor ``1 +- 2^-34`` into the reported guarantee (docs/privacy.md).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from fedmeta.server.noise import (
    RESIDUAL_PER_COORDINATE,
    NoiseSource,
    _on_grid,
    float_residual,
    release_grid,
)
from fedmeta.server.outputs import implemented_guarantee

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("scale", [0.0, 1.0, 2.0**20, 2.0**35])
def test_the_release_is_the_exact_cell_of_the_sum_plus_noise(scale: float) -> None:
    """Against exact rational arithmetic on the same draws: the cell of ``S + std Z`` exactly.

    A cell can differ only when the exact value lies within 2^-37 of a cell's edge: with 4,000
    draws the chance of one such value is about 2^-25.
    """
    std = 0.7
    grid = release_grid(std)
    sums = np.linspace(-scale, scale, 4000) + np.linspace(0, 1, 4000) * grid
    released, got_grid = _on_grid(sums, std, NoiseSource.insecure_for_tests(5, 1))
    z = NoiseSource.insecure_for_tests(5, 1).standard_normal(sums.size)
    assert got_grid == grid
    for s, zi, out in zip(sums, z, released, strict=True):
        exact = (Fraction(s) + Fraction(std) * Fraction(zi)) / Fraction(grid)
        cell = math.floor(exact + Fraction(1, 2))
        assert out == cell * grid or abs(exact - math.floor(exact) - Fraction(1, 2)) < 2**-37


def test_the_residual_only_grows_the_guarantee_by_the_stated_arithmetic() -> None:
    assert float_residual(0, 3.0, 1e-6) == (3.0, 1e-6)
    n = 1762 * 200  # the default sinusoid run: 1,761 parameters plus the count, 200 rounds
    eps, delta = float_residual(n, 8.0, 1e-5)
    r = RESIDUAL_PER_COORDINATE
    assert eps - 8.0 == pytest.approx(n * math.log((1 + r) / (1 - r)), rel=1e-9)
    assert eps - 8.0 == pytest.approx(4.1e-5, rel=0.01)
    assert delta / 1e-5 == pytest.approx((1 + r) ** n, rel=1e-9)  # the tail term is ~1e-33
    assert float_residual(2 * n, 8.0, 1e-5) > (eps, delta)  # more values released, more residual
    assert implemented_guarantee(8.0, 1e-5, n) == (eps, delta)
    with pytest.raises(ValueError, match="coordinates must be an integer >= 0"):
        float_residual(-1, 1.0, 1e-5)


def test_the_far_tail_is_drawn_exactly_and_finely() -> None:
    """Draws at |Z| >= 4.5 come from Marsaglia's exact tail, with a fine uniform (not numpy's)."""
    from scipy import stats

    from fedmeta.server.noise import TAIL_FROM, _fine_uniform, _tail

    rng = np.random.default_rng(3)
    raw = lambda: int(rng.integers(0, 2**64, dtype=np.uint64))  # noqa: E731
    tail = np.array([_tail(raw) for _ in range(4000)])
    truncated = stats.truncnorm(TAIL_FROM, np.inf)
    assert stats.kstest(tail, truncated.cdf).pvalue > 1e-4  # fails for a wrong law (p ~ 0)
    # Fine at every scale: a value under 2^-128 still has 52 significant bits.
    words = iter([0, 0, 1 << 40, (1 << 64) - 1])
    assert _fine_uniform(lambda: next(words)) == math.ldexp(2.0 - 2.0**-52, -(128 + 23 + 1))
    z = NoiseSource.insecure_for_tests(9).standard_normal(2_000_000)
    far = np.abs(z[np.abs(z) >= TAIL_FROM])
    assert 0 < far.size < 60 and np.isfinite(far).all()  # about 14 expected
