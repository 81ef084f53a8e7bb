"""Hypothesis properties of the accountant, and the empirical audit with its negative controls."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedmeta.accounting import (
    FixedSizeScheme,
    GaussianRound,
    InsecureSeededSource,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    TwoStageSampler,
    calibrate_noise_multiplier,
    epsilon,
    max_rounds,
    tombs2022_published_epsilon,
)

GRID = 1e-3  # coarser PLD grid keeps property tests fast; still a pessimistic (valid) bound
FAST = settings(max_examples=8, deadline=None, derandomize=True)
rates = st.sampled_from([0.05, 0.1, 0.2, 0.5])
zs = st.sampled_from([0.8, 1.0, 1.5, 2.0])


def eps(q1: float, q2: float, z: float, t: int, method: str = "pld") -> float:
    scheme = TwoStagePoissonScheme(100, round(100 * q1), q2)
    return epsilon([(GaussianRound(scheme, z), t)], 1e-5, method=method, discretization=GRID)


@pytest.mark.unit
@FAST
@given(q1=rates, q2=rates, z=zs, t=st.integers(1, 40), extra=st.integers(1, 40))
def test_monotone_in_rounds_and_pld_below_rdp(
    q1: float, q2: float, z: float, t: int, extra: int
) -> None:
    base = eps(q1, q2, z, t)
    assert base <= eps(q1, q2, z, t + extra) + 1e-9
    assert base <= eps(q1, q2, z, t, "rdp") + 1e-9


@pytest.mark.unit
@FAST
@given(q1=rates, q2=rates, z=zs, t=st.integers(1, 30))
def test_monotone_in_rates_and_noise(q1: float, q2: float, z: float, t: int) -> None:
    base = eps(q1, q2, z, t)
    assert base <= eps(min(1.0, 2 * q1), q2, z, t) + 1e-9
    assert base <= eps(q1, min(1.0, 2 * q2), z, t) + 1e-9
    assert base >= eps(q1, q2, 1.5 * z, t) - 1e-9


@pytest.mark.integration
@settings(max_examples=4, deadline=None, derandomize=True)
@given(q2=rates, t=st.integers(5, 50), target=st.sampled_from([1.0, 2.0, 4.0]))
def test_calibrate_and_max_rounds_are_inverse_to_epsilon(q2: float, t: int, target: float) -> None:
    scheme = TwoStagePoissonScheme(100, 10, q2)
    z = calibrate_noise_multiplier(
        scheme, t, target, 1e-5, discretization=GRID, relative_tolerance=1e-2
    )
    assert epsilon([(GaussianRound(scheme, z), t)], 1e-5, discretization=GRID) <= target
    assert epsilon([(GaussianRound(scheme, z * 0.98), t)], 1e-5, discretization=GRID) > target
    event = GaussianRound(scheme, z)
    rounds = max_rounds(event, target, 1e-5, discretization=GRID)
    assert rounds >= t
    assert epsilon([(event, rounds)], 1e-5, discretization=GRID) <= target
    assert epsilon([(event, rounds + 1)], 1e-5, discretization=GRID) > target


# ------------------------------------------------------------------------------------ audit
#
# The real per-round path (TwoStageSampler -> clip -> sum -> Gaussian noise) runs many times on
# worst-case neighbouring datasets D (with the target task) and D' (without). A test fixed in
# advance
# (output in a window above THRESHOLD) gives a Clopper-Pearson lower bound on epsilon:
#     eps >= log((TPR_lower - delta) / FPR_upper).
# It must stay below the accountant, and exceed both negative controls (Theorem 3; fixed-size
# sampling with an unhalved z), which shows the audit has the power to catch a wrong accountant.

C, Z, DELTA = 1.0, 1.0, 1e-5


def clip(g: np.ndarray) -> np.ndarray:
    """Per-task clipping to L2 norm C (1-D gradients)."""
    norms = np.abs(g)
    return g * np.minimum(1.0, C / np.maximum(norms, 1e-12))


def run_rounds(
    scheme: TwoStageFixedScheme, grads: dict[str, np.ndarray], trials: int, seed: int
) -> np.ndarray:
    clipped = {pid: clip(g) for pid, g in grads.items()}
    counts = {pid: len(g) for pid, g in grads.items()}
    sums = np.empty(trials)
    for i in range(trials):
        # As a test-mode run does: a fresh seeded (insecure) source per round, no saved state.
        sampler = TwoStageSampler(scheme, InsecureSeededSource(seed, stream=i))
        picked = sampler.sample(counts)
        sums[i] = sum(float(clipped[pid][tasks].sum()) for pid, tasks in picked.items())
    noise = np.random.default_rng(seed + 1).normal(0.0, Z * C, size=trials)
    return sums + noise


def audit_lower_bound(
    with_target: np.ndarray, without: np.ndarray, low: float, high: float
) -> float:
    n = len(with_target)
    tp = int(np.count_nonzero((with_target > low) & (with_target < high)))
    fp = int(np.count_nonzero((without > low) & (without < high)))
    tpr_lo = stats.beta.ppf(0.025, tp, n - tp + 1) if tp else 0.0
    fpr_hi = stats.beta.ppf(0.975, fp + 1, n - fp)
    if tpr_lo <= DELTA:
        return 0.0
    return math.log((tpr_lo - DELTA) / fpr_hi)


def two_stage_audit(trials: int, seed: int) -> tuple[float, GaussianRound]:
    # 4 participants, 2 per round; 8 of 16 tasks. The target participant's 15 siblings have
    # gradient -3 (clipped to -1) and the target +3 (clipped to +1); the others' tasks are +1.
    # Sum: participant unsampled -> 16; sampled -> 0 without the target, 2 with it.
    scheme = TwoStageFixedScheme(
        participants=4, participants_per_round=2, tasks_per_round=8, min_tasks=16
    )
    others = {f"p{i}": np.full(16, 1.0) for i in range(1, 4)}
    d = {"t": np.array([3.0] + [-3.0] * 15), **others}
    d_prime = {"t": np.full(15, -3.0), **others}
    # min_tasks only enters the accounting; D' is the hypothetical neighbour with one task fewer.
    scheme_prime = TwoStageFixedScheme(4, 2, 8, 15)
    out_d = run_rounds(scheme, d, trials, seed)
    out_dp = run_rounds(scheme_prime, d_prime, trials, seed + 100)
    return audit_lower_bound(out_d, out_dp, 4.0, 9.0), GaussianRound(scheme, Z)


def fixed_size_audit(trials: int, seed: int) -> tuple[float, GaussianRound]:
    # Single stage, 1 of 2 tasks (the two-stage sampler with one participant): target +1, other -1.
    scheme = TwoStageFixedScheme(
        participants=1, participants_per_round=1, tasks_per_round=1, min_tasks=2
    )
    out_d = run_rounds(scheme, {"t": np.array([2.0, -2.0])}, trials, seed)
    out_dp = run_rounds(
        TwoStageFixedScheme(1, 1, 1, 1), {"t": np.array([-2.0])}, trials, seed + 100
    )
    return audit_lower_bound(out_d, out_dp, 2.5, np.inf), GaussianRound(FixedSizeScheme(1, 2), Z)


def check_audit(trials: int, seed: int) -> None:
    lb, event = two_stage_audit(trials, seed)
    accountant = epsilon([(event, 1)], DELTA)
    theorem3 = tombs2022_published_epsilon(event, 1, DELTA)
    assert lb < accountant, (lb, accountant)
    assert lb > theorem3 + 0.5, (lb, theorem3)  # negative control 1 caught, with margin

    lb, event = fixed_size_audit(trials, seed)
    accountant = epsilon([(event, 1)], DELTA)
    unhalved = epsilon([(GaussianRound(FlatPoissonFromFixed(event), Z), 1)], DELTA)
    assert lb < accountant, (lb, accountant)
    assert lb > unhalved + 0.25, (lb, unhalved)  # negative control 2 caught, with margin


def FlatPoissonFromFixed(event: GaussianRound):  # noqa: N802
    """Negative control: fixed-size m of n accounted as Poisson at m/n with z unhalved."""
    from fedmeta.accounting import FlatPoissonScheme

    scheme = event.scheme
    assert isinstance(scheme, FixedSizeScheme)
    return FlatPoissonScheme(scheme.rate)


@pytest.mark.integration
def test_audit_reduced_with_negative_controls() -> None:
    check_audit(trials=60_000, seed=20261122)


@pytest.mark.slow
def test_audit_full_with_negative_controls() -> None:
    check_audit(trials=1_000_000, seed=7)
