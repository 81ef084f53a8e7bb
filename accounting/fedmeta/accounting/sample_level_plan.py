"""``fedmeta privacy plan --level sample``: search a sample-level design (issue 53) and rank it.

The candidates are every (participants per round ``n1``, example rate ``q``, rounds ``T``) of the
request's lists, at the request's fixed inner steps ``K`` and slot cap ``m``. Each is calibrated
to the budget by :func:`calibrate_sample_level` (first order: ``z_out = m z_eff``, ``z_in =
sqrt(m K) z_eff``), so every row meets the budget under the valid example-level bound
(``accounting.sample_level_bound``); its epsilon is recomputed at the calibrated multipliers.

**What it ranks** (docs/privacy.md, "Planning commands"): the task level's proxy for the outer
release, the noise standard deviation on the averaged outer gradient over ``sqrt(T)``,

    noise std = z_out * C_out / E[examples a round],   E[examples a round] = n1 * N * q

(``N`` examples a participant). The run divides the noisy sum by its public nominal query count,
a fixed fraction of ``E[examples a round]`` for a fixed task shape (ways, shots, query, and enough
tasks a pass to use every sampled example), so ranking by this lot ranks as the run's normaliser
would. The inner loop is not in the proxy: its noise on a support set's averaged gradient is
``z_in C_in / (ways x shots)`` whatever the lot, and it grows with ``q``, ``n1`` and ``T`` (less
amplification), which the outer proxy rewards. So a plan must cap it: rows whose calibrated
``z_in`` exceeds ``max_inner_noise_multiplier`` are not feasible (a note says so), as the task
level's compute caps are. The proxy ranks configurations; it does not predict accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

from fedmeta.accounting.checks import check_int, check_positive
from fedmeta.accounting.sample_level import ExampleSampling, SampleLevelRound
from fedmeta.accounting.sample_level_bound import calibrate_sample_level, sample_level_epsilon

__all__ = ["SamplePlan", "SamplePlanRequest", "SamplePlanRow", "plan_sample_level"]


@dataclass(frozen=True)
class SamplePlanRequest:
    """The budget, the federation's shape, the fixed loop constants and the candidate lists."""

    epsilon: float
    delta: float
    participants: int
    examples_per_participant: int
    inner_steps: int
    max_appearances: int
    example_rates: tuple[float, ...]
    participants_per_round: tuple[int, ...]
    rounds: tuple[int, ...]
    max_inner_noise_multiplier: float
    clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("epsilon", "max_inner_noise_multiplier", "clip"):
            check_positive(name, getattr(self, name))
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1); got {self.delta!r}")
        for name in ("participants", "examples_per_participant", "inner_steps", "max_appearances"):
            check_int(name, getattr(self, name), minimum=1)
        if not self.example_rates or not all(0 < q <= 1 for q in self.example_rates):
            raise ValueError(f"example_rates must be rates in (0, 1]; got {self.example_rates!r}")
        if not self.participants_per_round or not all(
            1 <= n1 <= self.participants for n1 in self.participants_per_round
        ):
            raise ValueError(f"participants_per_round must be in [1, {self.participants}]; got "
                             f"{self.participants_per_round!r}")  # fmt: skip
        if not self.rounds or not all(t >= 1 for t in self.rounds):
            raise ValueError(f"rounds must be integers >= 1; got {self.rounds!r}")


@dataclass(frozen=True)
class SamplePlanRow:
    """One feasible design: its calibrated round, rounds, lot, noise, proxy and valid epsilon."""

    event: SampleLevelRound
    rounds: int
    expected_examples: float
    noise_std: float
    proxy: float
    epsilon: float


@dataclass(frozen=True)
class SamplePlan:
    """The ranked rows (best first) and a note per candidate refused by the inner-noise cap."""

    request: SamplePlanRequest
    rows: tuple[SamplePlanRow, ...]
    notes: tuple[str, ...]


def plan_sample_level(request: SamplePlanRequest, top: int = 10) -> SamplePlan:
    """Calibrate every candidate, drop those over the inner-noise cap, rank by the proxy."""
    r = request
    ranked: list[tuple[float, SampleLevelRound, int, float, float]] = []
    notes = []
    for n1, rate, rounds in product(r.participants_per_round, r.example_rates, r.rounds):
        start = SampleLevelRound(ExampleSampling(r.participants, n1, rate), 1.0, 1.0,
                                 r.inner_steps, r.max_appearances)  # fmt: skip
        event = calibrate_sample_level(start, rounds, r.epsilon, r.delta)
        if event.inner_noise_multiplier > r.max_inner_noise_multiplier:
            z_in, cap = event.inner_noise_multiplier, r.max_inner_noise_multiplier
            notes.append(f"n1={n1}, q={rate:g}, T={rounds}: z_in {z_in:.4g} > "
                         f"--max-inner-noise-multiplier {cap:g}")  # fmt: skip
            continue
        lot = n1 * r.examples_per_participant * rate
        std = event.outer_noise_multiplier * r.clip / lot
        ranked.append((std / math.sqrt(rounds), event, rounds, lot, std))
    ranked.sort(key=lambda row: (row[0], row[2]))
    rows = tuple(
        SamplePlanRow(
            event, rounds, lot, std, proxy, sample_level_epsilon(event, rounds, r.delta)
        )  # fmt: skip
        for proxy, event, rounds, lot, std in ranked[:top]
    )
    return SamplePlan(request, rows, tuple(notes))
