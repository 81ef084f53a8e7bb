"""The example-level guarantee of sample-level DP-MAML over ``T`` rounds (issue 53); calibration.

Per round (``accounting.sample_level``): conditional on the example x being sampled, the round is
``mu``-GDP, i.e. dominated, for every order of the hockey-stick divergence, by the Gaussian pair
``(N(mu, 1), N(0, 1))`` (Dong, Roth, Su 2022, numbers as in arXiv:1905.02383: Proposition 2.12,
the primal-dual conversion, and Corollary 2.13, its closed form for ``mu``-GDP: ``mu``-GDP is
exactly the hockey-stick curve of that pair at every epsilon, negative ones included, the pair
being symmetric).

Amplification, single stage (``participants_per_round == participants``): x is included
independently of every other example with probability ``q = example_rate``, so the round is
dominated by the Poisson-subsampled pair of that Gaussian: remove ``((1-q) N(0,1) + q N(mu,1),
N(0,1))``, add the mirror (Zhu, Dong, Wang 2022, "Optimal accounting of differential privacy via
characteristic function", their result on Poisson subsampling of a dominating pair; composable by
product over rounds, their Theorem 10, adaptive composition of dominating pairs, in the numbering
of arXiv:2106.08567). That is dp-accounting's ``PoissonSampledDpEvent(q,
GaussianDpEvent(1/mu))``: the Poisson-subsampled Gaussian at noise multiplier ``1/mu``.

Two stages (``n1`` of ``P`` participants, then Poisson examples): the task-level argument of
docs/privacy.md ("Valid per-round bounds") carries over with the example as the unit. Removing x
does not change which participants can be sampled (the relation keeps participants fixed), so
stage 1 has the same law under both datasets and joint convexity over "x's participant not
sampled" (loss 0) gives the mixture ``(1 - q1) [no loss] + q1 PG(q2, 1/mu)``. Given that the
participant is sampled, x's coin is independent of every other example's, its siblings included,
which is all Poisson amplification needs; the siblings do reveal whether the participant was
sampled, which is why ``q1`` only weights the mixture and is not multiplied into the rate (Tombs et
al. 2022, Theorem 3, would use ``q1 q2``: not valid, docs/privacy.md, "Tombs et al. (2022),
Theorem 3, is not a valid bound for two-stage sampling").
Tight for the pair; the only slack is in ``mu``, the worst split and worst gradients for x.

Hence one sample-level round has exactly the dominating pair of the task-level
``GaussianRound(TwoStagePoissonScheme(P, n1, example_rate), 1/mu)`` (``FlatPoissonScheme`` for a
single stage): ``dominating_round``. Epsilon, delta, the round count and calibration reuse the
task-level accountant on it (pessimistic PLD, with the RDP bound of the same pair as the
cross-check, ``accounting.composition``): every approximation there errs towards a larger
epsilon. The RDP of the pair bounds the real round's RDP because a pair that dominates at every
hockey-stick order is a Blackwell garbling (Blackwell's theorem, as Dong, Roth, Su 2022 state it
for trade-off functions), and Renyi divergences obey data processing. That round is an accounting
device only: the ledger records the ``SampleLevelRound`` itself, never the task-level stand-in.
"""

from __future__ import annotations

import math

from fedmeta.accounting.calibration import calibrate_noise_multiplier, max_rounds
from fedmeta.accounting.composition import (
    DEFAULT_DISCRETIZATION,
    Method,
    check_rounds,
    epsilon,
    pld_delta,
)
from fedmeta.accounting.sample_level import (
    SampleLevelRound,
    dominating_round,
    effective_noise_multiplier,
)

# Defined beside the event (sample_level.py) so that composition can lower a recorded round.
__all__ = [
    "calibrate_sample_level",
    "dominating_round",
    "effective_noise_multiplier",
    "sample_level_delta",
    "sample_level_epsilon",
    "sample_level_max_rounds",
]


def _check_event(event: object) -> SampleLevelRound:
    if not isinstance(event, SampleLevelRound):
        raise ValueError(f"event must be a SampleLevelRound; got {event!r}")
    return event


def sample_level_epsilon(
    event: SampleLevelRound,
    rounds: int,
    delta: float,
    method: Method = "pld",
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Example-level epsilon at ``delta`` after ``rounds`` identical rounds of ``event``.

    ``method="pld"``: the enforced value (pessimistic PLD, or RDP where smaller; both upper bounds).
    ``method="rdp"``: the RDP bound of the same pair alone, the cross-check.
    """
    rounds = check_rounds("rounds", rounds, minimum=0)
    if rounds == 0:
        return 0.0
    return epsilon(
        [(dominating_round(event), rounds)], delta, method=method, discretization=discretization
    )


def sample_level_delta(
    event: SampleLevelRound,
    rounds: int,
    epsilon_value: float,
    *,
    discretization: float = DEFAULT_DISCRETIZATION,
) -> float:
    """Smallest delta (pessimistic PLD, or RDP if smaller) at ``epsilon_value`` after ``rounds``."""
    rounds = check_rounds("rounds", rounds, minimum=0)
    if rounds == 0:
        return 0.0
    return pld_delta(
        [(dominating_round(event), rounds)], epsilon_value, discretization=discretization
    )


def sample_level_max_rounds(
    event: SampleLevelRound, epsilon_budget: float, delta: float, method: Method = "pld"
) -> int:
    """Largest ``T`` with ``sample_level_epsilon(event, T, delta) <= epsilon_budget``, or 0."""
    return max_rounds(dominating_round(event), epsilon_budget, delta, method=method)


def calibrate_sample_level(
    event: SampleLevelRound,
    rounds: int,
    target_epsilon: float,
    delta: float,
    *,
    method: Method = "pld",
    relative_tolerance: float = 1e-3,
) -> SampleLevelRound:
    """``event`` with the least noise in each loop that meets the target (first order only).

    The task-level calibration finds the smallest feasible ``z_eff = 1/mu`` for the sampling; since
    first-order ``mu^2 = max(m^2 / z_out^2, m K / z_in^2)`` is a maximum, each loop can be set at
    its own threshold without raising ``mu``: ``z_out = m z_eff``, ``z_in = sqrt(m K) z_eff``. Both
    are rounded up by the calibration's own tolerance, so the result is feasible. Second order has
    no such split (the outer term carries the support appearances): refused.
    """
    _check_event(event)
    if event.order != "first":
        raise ValueError(
            "order must be 'first' to calibrate (second order couples both loops in the outer "
            f"release; choose z_in and z_out and check them with sample_level_epsilon); got "
            f"{event.order!r}"
        )
    base = dominating_round(event)
    z_eff = calibrate_noise_multiplier(
        base.scheme,
        rounds,
        target_epsilon,
        delta,
        method=method,
        relative_tolerance=relative_tolerance,
    )
    m, k = event.max_appearances, event.inner_steps
    # Multiplying by m and sqrt(m K) can round down in the last bit; nextafter keeps mu <= 1/z_eff.
    z_out = math.nextafter(m * z_eff, math.inf)
    z_in = math.nextafter(math.sqrt(m * k) * z_eff, math.inf)
    return SampleLevelRound(
        sampling=event.sampling,
        inner_noise_multiplier=z_in,
        outer_noise_multiplier=z_out,
        inner_steps=k,
        max_appearances=m,
        order=event.order,
    )
