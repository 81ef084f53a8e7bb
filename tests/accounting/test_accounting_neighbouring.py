"""The neighbouring relation: replace-one dominating pairs, quadrature oracles, RDP cross-checks.

The one-round oracles integrate the output density of the *real mechanism* on an explicit
worst-case pair of datasets (scipy quad), not the accountant's formula: the accountant must never
be below them and, where the pair is the worst case, must match them to the PLD discretisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import integrate, stats

from fedmeta.accounting import (
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    calibrate_noise_multiplier,
    epsilon,
    max_rounds,
    participant_level_note,
    pld_delta,
    round_components,
)
from fedmeta.accounting.pairs import RoundModel
from fedmeta.accounting.rdp import RDP_ORDERS, rdp_curve

Density = Callable[[float], float]
ADD, REPLACE = "add_remove", "replace_one"
EPSILONS = (0.25, 1.00003, 2.0)  # on and between grid points


def hockey_stick(p: Density, q: Density, eps: float, lo: float, hi: float) -> float:
    """max over both orders of the integral of (p - e^eps q)_+ (the relation is symmetric)."""
    a = math.exp(eps)
    values = []
    for x, y in ((p, q), (q, p)):
        value, err = integrate.quad(
            lambda t, x=x, y=y: max(0.0, x(t) - a * y(t)),
            lo,
            hi,
            limit=1000,
            epsabs=1e-15,
            epsrel=1e-12,
        )
        assert err < 1e-11
        values.append(value)
    return max(values)


def gaussian_mixture(components: list[tuple[float, float]], sigma: float) -> Density:
    """Density of sum_i w_i N(mu_i, sigma^2) for components [(w_i, mu_i)]."""
    weights = np.array([w for w, _ in components])
    means = np.array([m for _, m in components])
    return lambda t: float(weights @ stats.norm.pdf(t, loc=means, scale=sigma))


def accountant(event: GaussianRound, eps: float) -> float:
    return pld_delta([(event, 1)], eps)


def assert_tight_and_never_below(value: float, exact: float) -> None:
    # The slack is the quadrature's accuracy (1e-9 relative); on the grid the PLD equals the
    # exact value, between grid points it is above it.
    assert value >= exact * (1 - 1e-9) - 1e-13, (value, exact)
    assert value <= exact * 1.01 + 1e-9, (value, exact)  # within the 1e-4 grid's pessimism


# ----------------------------------------------------------------------------- round models


@pytest.mark.unit
def test_rdp_orders_are_dp_accountings_default_grid() -> None:
    """RDP_ORDERS is spelled out (dp-accounting loads when it computes); the floats are its own."""
    assert RDP_ORDERS == tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("scheme", "relation", "expected"),
    [
        (FlatPoissonScheme(0.2), ADD, RoundModel(1.0, 0.2, 2.0, "add_remove")),
        (FlatPoissonScheme(0.2), REPLACE, RoundModel(1.0, 0.2, 2.0, "replace")),
        (TwoStagePoissonScheme(10, 2, 0.3), REPLACE, RoundModel(0.2, 0.3, 2.0, "replace")),
        (FixedSizeScheme(2, 8), ADD, RoundModel(1.0, 0.25, 1.0, "add_remove")),
        (FixedSizeScheme(2, 8), REPLACE, RoundModel(1.0, 0.25, 1.0, "wor_replace", 2, 8)),
        (
            TwoStageFixedScheme(10, 5, 3, 12),
            REPLACE,
            RoundModel(0.5, 0.25, 1.0, "wor_replace", 3, 12),
        ),
    ],
)
def test_round_components_per_relation(scheme: object, relation: str, expected: RoundModel) -> None:
    assert round_components(GaussianRound(scheme, 2.0, None, relation)) == expected  # type: ignore[arg-type]


@pytest.mark.unit
def test_participant_level_is_the_same_under_both_relations() -> None:
    scheme = TwoStageFixedScheme(10, 5, 3, 12)
    models = {
        round_components(GaussianRound(scheme, 2.0, 4, r), "participant") for r in (ADD, REPLACE)
    }
    assert models == {RoundModel(1.0, 0.5, 0.25, "add_remove")}


@pytest.mark.unit
def test_rounds_of_two_relations_are_not_composed() -> None:
    flat = FlatPoissonScheme(0.1)
    rounds = [(GaussianRound(flat, 1.0), 3), (GaussianRound(flat, 1.0, None, REPLACE), 2)]
    with pytest.raises(ValueError, match="neighbouring must be the same for all rounds"):
        epsilon(rounds, 1e-5)
    with pytest.raises(ValueError, match="neighbouring must be the same"):
        max_rounds(GaussianRound(flat, 1.0, None, REPLACE), 5.0, 1e-5, prior=rounds[:1])


# --------------------------------------------------------------------- one-round oracles


@pytest.mark.unit
@pytest.mark.parametrize("eps", EPSILONS)
def test_flat_poisson_replace_one_matches_quadrature(eps: float) -> None:
    # Target task +C in D, -C in D'; the other tasks' inclusions are independent and cancel out
    # (clipped gradient 0), so the output is the REPLACE pair itself.
    q, z = 0.2, 1.0
    p = gaussian_mixture([(1 - q, 0.0), (q, 1.0)], z)
    p_prime = gaussian_mixture([(1 - q, 0.0), (q, -1.0)], z)
    exact = hockey_stick(p, p_prime, eps, -12, 12)
    assert_tight_and_never_below(
        accountant(GaussianRound(FlatPoissonScheme(q), z, None, REPLACE), eps), exact
    )
    # The add/remove accountant is below this replace-one delta: it is not a replace-one bound.
    assert accountant(GaussianRound(FlatPoissonScheme(q), z), eps) < exact


@pytest.mark.unit
@pytest.mark.parametrize("eps", EPSILONS)
def test_two_stage_poisson_replace_one_matches_quadrature(eps: float) -> None:
    # P = 2, n1 = 1. Participant t: the target (+C / -C) and 199 siblings with gradient 0.
    # Participant u: 200 tasks with +C, so its branch sits near 200 * q2 = 20 C, far from t's.
    q2, z, m = 0.1, 1.0, 200
    u_branch = [(0.5 * stats.binom.pmf(j, m, q2), float(j)) for j in range(m + 1)]
    p = gaussian_mixture([(0.5 * (1 - q2), 0.0), (0.5 * q2, 1.0), *u_branch], z)
    p_prime = gaussian_mixture([(0.5 * (1 - q2), 0.0), (0.5 * q2, -1.0), *u_branch], z)
    exact = hockey_stick(p, p_prime, eps, -12, 60)
    scheme = TwoStagePoissonScheme(2, 1, q2)
    assert_tight_and_never_below(accountant(GaussianRound(scheme, z, None, REPLACE), eps), exact)


@pytest.mark.unit
@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize(("m", "n"), [(1, 2), (2, 5)])
def test_fixed_size_replace_one_matches_quadrature(eps: float, m: int, n: int) -> None:
    # D: target +C, the n - 1 others -C; D': target replaced by -C. The sum of the m sampled
    # gradients is -mC + 2C [target sampled]: the replaced gradient differs from the co-sampled
    # ones by 2C, which the REPLACE pair at noise z (the tempting "no z/2") misses.
    z, gamma = 1.0, m / n
    p = gaussian_mixture([(1 - gamma, -m), (gamma, -m + 2.0)], z)
    p_prime = gaussian_mixture([(1.0, -float(m))], z)
    exact = hockey_stick(p, p_prime, eps, -m - 12, 14)
    event = GaussianRound(FixedSizeScheme(m, n), z, None, REPLACE)
    assert_tight_and_never_below(accountant(event, eps), exact)
    naive = pld_lib.from_gaussian_mechanism(
        z,
        sampling_prob=gamma,
        neighboring_relation=pld_lib.NeighborRel.REPLACE_ONE,
    ).get_delta_for_epsilon(eps)
    assert naive < exact  # REPLACE-PLD(m/n, z) would be optimistic: not a bound


@pytest.mark.unit
@pytest.mark.parametrize("eps", EPSILONS)
def test_two_stage_fixed_replace_one_matches_quadrature(eps: float) -> None:
    # P = 2, n1 = 1; n2 = 5 of 10 tasks. Participant t: target +C (-C in D'), siblings -C, so its
    # branch is -5C + 2C [target sampled]; participant u: all +C, its branch at +5C (8 sigma away).
    z, n2, tasks = 1.0, 5, 10
    gamma = n2 / tasks
    p = gaussian_mixture([(0.5 * (1 - gamma), -5.0), (0.5 * gamma, -3.0), (0.5, 5.0)], z)
    p_prime = gaussian_mixture([(0.5, -5.0), (0.5, 5.0)], z)
    exact = hockey_stick(p, p_prime, eps, -20, 20)
    event = GaussianRound(TwoStageFixedScheme(2, 1, n2, tasks), z, None, REPLACE)
    assert_tight_and_never_below(accountant(event, eps), exact)


# -------------------------------------------------------------- why these pairs dominate


@pytest.mark.unit
def test_replace_pair_dominates_every_pair_of_clipped_gradients_in_2d() -> None:
    # Poisson sampling, replace-one: for gradients g, g' with |g|, |g'| <= C in the plane, the
    # hockey-stick divergence of (1-q)N(0) + qN(g) vs (1-q)N(0) + qN(g') is largest at g = -g',
    # |g| = C (the convex-order argument of accounting.composition), for every order alpha.
    xs = np.linspace(-8.0, 8.0, 641)
    step = xs[1] - xs[0]
    grid_x, grid_y = np.meshgrid(xs, xs, indexing="ij")

    def density(mean: tuple[float, float]) -> np.ndarray:
        d2 = (grid_x - mean[0]) ** 2 + (grid_y - mean[1]) ** 2
        return np.exp(-d2 / 2.0) / (2.0 * math.pi)

    base = density((0.0, 0.0))
    for q in (0.1, 0.6):
        for alpha in (0.6, 1.0, 2.5):

            def h(
                g: tuple[float, float], g2: tuple[float, float], q: float = q, alpha: float = alpha
            ) -> float:
                p = (1 - q) * base + q * density(g)
                p2 = (1 - q) * base + q * density(g2)
                return float(np.maximum(p - alpha * p2, 0.0).sum() * step * step)

            antipodal = h((1.0, 0.0), (-1.0, 0.0))
            for r1, r2, angle in [
                (1, 1, 2.0),
                (1, 0, 0.0),
                (0.5, 1, 3.1),
                (1, 1, 1.0),
                (1, 0.3, 3.14),
            ]:
                other = (r2 * math.cos(angle), r2 * math.sin(angle))
                assert h((float(r1), 0.0), other) <= antipodal + 1e-9


@pytest.mark.unit
def test_without_replacement_pair_is_above_both_directions_and_the_antipodal_pair() -> None:
    # Fixed-size m of n under replace-one: the symmetrised pair must compose above every pair a
    # round can realise: the remove and add pairs at 2C (z/2) and the antipodal pair (+C / -C with
    # a zero co-sampled gradient) at z. dp-accounting composes those as oracles.
    m, n, z, rounds, delta = 1, 4, 2.0, 40, 1e-5
    gamma = m / n
    ours = epsilon([(GaussianRound(FixedSizeScheme(m, n), z, None, REPLACE), rounds)], delta)
    both_directions = pld_lib.from_gaussian_mechanism(z / 2, sampling_prob=gamma)
    antipodal = pld_lib.from_gaussian_mechanism(
        z, sampling_prob=gamma, neighboring_relation=pld_lib.NeighborRel.REPLACE_ONE
    )
    oracles = [
        pld.self_compose(rounds).get_epsilon_for_delta(delta)
        for pld in (both_directions, antipodal)
    ]
    assert ours >= max(oracles) - 1e-9
    assert ours <= 1.25 * max(oracles)  # and not wildly above the best lower reference


# --------------------------------------------------------------------------- RDP cross-check


def log_gaussian_mixture(components: list[tuple[float, float]], sigma: float) -> Density:
    """Log-density of sum_i w_i N(mu_i, sigma^2) (no underflow in the far tails)."""
    log_w = np.log([w for w, _ in components])
    means = np.array([m for _, m in components])
    return lambda t: float(np.logaddexp.reduce(log_w + stats.norm.logpdf(t, means, sigma)))


def renyi(log_p: Density, log_q: Density, order: float, lo: float, hi: float) -> float:
    """D_order(P || Q) by quadrature of exp(order log p + (1 - order) log q)."""
    value, _ = integrate.quad(
        lambda t: math.exp(order * log_p(t) + (1 - order) * log_q(t)), lo, hi, limit=400
    )
    return math.log(value) / (order - 1)


@pytest.mark.unit
@pytest.mark.parametrize("order", [2.0, 4.0, 8.0])
def test_replace_one_rdp_bounds_are_above_the_realised_renyi_divergence(order: float) -> None:
    index = RDP_ORDERS.index(order)
    q, z = 0.2, 1.0
    # Poisson: the REPLACE pair (realised by the flat Poisson oracle above), both orders.
    p = log_gaussian_mixture([(1 - q, 0.0), (q, 1.0)], z)
    p_prime = log_gaussian_mixture([(1 - q, 0.0), (q, -1.0)], z)
    realised = renyi(p, p_prime, order, -20, 25)
    bound = rdp_curve(round_components(GaussianRound(FlatPoissonScheme(q), z, None, REPLACE)))
    assert bound[index] >= realised
    # Without replacement: the remove pair at 2C (realised by the fixed-size oracle above).
    m, n = 1, 5
    p = log_gaussian_mixture([(1 - m / n, 0.0), (m / n, 2.0)], z)
    p_prime = log_gaussian_mixture([(1.0, 0.0)], z)
    wor = rdp_curve(round_components(GaussianRound(FixedSizeScheme(m, n), z, None, REPLACE)))
    for x, y in ((p, p_prime), (p_prime, p)):
        assert wor[index] >= renyi(x, y, order, -20, 40)


@pytest.mark.unit
@pytest.mark.parametrize(
    "scheme",
    [
        FlatPoissonScheme(0.05),
        TwoStagePoissonScheme(20, 4, 0.2),
        FixedSizeScheme(3, 40),
        TwoStageFixedScheme(20, 4, 2, 10),
    ],
)
def test_replace_one_pld_below_rdp_and_above_add_remove(scheme: object) -> None:
    rounds, delta = 200, 1e-5
    replace = [(GaussianRound(scheme, 1.5, None, REPLACE), rounds)]  # type: ignore[arg-type]
    add_remove = [(GaussianRound(scheme, 1.5), rounds)]  # type: ignore[arg-type]
    pld = epsilon(replace, delta, discretization=1e-3)
    assert pld <= epsilon(replace, delta, method="rdp")
    # Each replace-one pair dominates its scheme's add/remove pair (module docstring); the slack
    # covers the two discretisations.
    assert pld >= epsilon(add_remove, delta, discretization=1e-3) * (1 - 1e-3)


@pytest.mark.unit
def test_replace_one_calibrate_and_max_rounds_are_inverse_to_epsilon() -> None:
    scheme = TwoStageFixedScheme(100, 10, 5, 50)
    z = calibrate_noise_multiplier(
        scheme, 200, 4.0, 1e-5, neighbouring=REPLACE, discretization=1e-3, relative_tolerance=1e-2
    )
    event = GaussianRound(scheme, z, None, REPLACE)
    assert epsilon([(event, 200)], 1e-5, discretization=1e-3) <= 4.0
    lower = GaussianRound(scheme, z * 0.99, None, REPLACE)
    assert epsilon([(lower, 200)], 1e-5, discretization=1e-3) > 4.0
    rounds = max_rounds(event, 4.0, 1e-5, discretization=1e-3)
    assert rounds >= 200
    assert epsilon([(event, rounds)], 1e-5, discretization=1e-3) <= 4.0
    assert epsilon([(event, rounds + 1)], 1e-5, discretization=1e-3) > 4.0


# ------------------------------------------------------------- participant-level caveat


@pytest.mark.unit
def test_participant_level_note_is_defined_once() -> None:
    poisson = TwoStagePoissonScheme(10, 2, 0.5)
    for cap in (None, 40):  # the server passes the largest count: valid, still not meaningful
        note = participant_level_note(GaussianRound(poisson, 1.0, cap))
        assert note is not None and "sampling.stage2=fixed" in note
        assert note.startswith("not meaningful")
    assert participant_level_note(GaussianRound(TwoStageFixedScheme(10, 2, 3, 5), 1.0)) is None
    single = participant_level_note(GaussianRound(FlatPoissonScheme(0.1), 1.0))
    assert single is not None and "no participants" in single
    with pytest.raises(ValueError, match="event must be a GaussianRound"):
        participant_level_note("round")  # type: ignore[arg-type]
