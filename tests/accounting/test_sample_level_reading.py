"""DP-MAML's own accounting of its sample-level setting (not a guarantee) beside the valid bound."""

from __future__ import annotations

import math

import pytest

from fedmeta.accounting.dpmaml_reading import dpmaml_moments_epsilon, dpmaml_per_update_epsilon
from fedmeta.accounting.sample_level import ExampleSampling, SampleLevelRound
from fedmeta.accounting.sample_level_bound import sample_level_epsilon

DELTA = 1e-5


# DP-MAML's sample-level setting (Section 6.4): z = 1, lots of 10 of 400,000 tasks, 100 epochs of
# 4,000 tasks = 40,000 updates, delta 1e-5; it reports epsilon 1.18.
@pytest.mark.unit
def test_dpmaml_reading_as_published_and_the_valid_bound_beside_it() -> None:
    # Abadi et al.'s Lemma 3 over the moments it allows (lambda <= ln(1/q) = 10.6 at z = 1) gives
    # 1.152 (at lambda = 10: (4e4 * 6.25e-10 * 110 + ln 1e5) / 10); the paper prints 1.18.
    published = dpmaml_moments_epsilon(10, 400_000, 1.0, 40_000, DELTA)
    assert published == pytest.approx(
        (4e4 * (2.5e-5) ** 2 / (1 - 2.5e-5) * 110 + math.log(1e5)) / 10, rel=1e-12
    )
    assert published == pytest.approx(1.1516, abs=1e-4)
    per_update = dpmaml_per_update_epsilon(10, 400_000, 1.0, 40_000, DELTA)
    assert per_update == pytest.approx(0.0259, abs=5e-4)
    # The most favourable valid setting that can fill 10 5-way 1-shot tasks with one query per
    # class from DP-MAML's ~23,040 training drawings: 100 examples a round, m = 1, K = 1.
    valid = sample_level_epsilon(
        SampleLevelRound(ExampleSampling(1, 1, 100 / 23_040), 1.0, 1.0, 1, 1), 40_000, DELTA
    )
    assert valid == pytest.approx(5.17, abs=0.01) and valid > 4 * published
    with pytest.raises(ValueError, match="Lemma 3"):
        dpmaml_moments_epsilon(10, 400_000, 0.9, 40_000, DELTA)
