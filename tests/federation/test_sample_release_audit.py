"""The sample-level release path audited on a worst-case example, with negative controls (issue 53).

One participant; D holds the canary query example (tests/federation/sample_release_audit.py: its
gradient is far over the clip, so clipped it is ``-C_out`` in each of its ``m = 2`` query slots),
D' holds nothing. Each trial is one real sample-level round (slots, noisy inner loop, per-example
rows, the server's re-check, the outer noise); the Clopper-Pearson lower bound of the test "the
release falls in the window" (tests/federation/release_audit.py ``lower_bound``) must stay below
the accountant's epsilon for the recorded ``SampleLevelRound`` and catch each control by at least
20% of what the control claims:

* **clip skipped** (the participant's outer clip and the server's re-check both off): the canary's
  rows reach the sum unclipped. With only the participant's clip skipped, the server's re-check
  alone keeps the round within its epsilon (the defence the task level has).
* **noise halved** (the server's noise source draws half the claimed standard deviation).
* **m ignored** (an accountant that counts one slot per example, ``m = 1``): refuted by the honest
  path itself, since the canary really fills two slots.

The round is ``z_out = 4``, ``C_out = 1``, ``m = 2``, ``z_in = 1000`` (the inner loop is not what
this audit observes), so ``mu = m / z_out = 0.5``: epsilon 0.919 at delta 1e-2, the delta of every
check here (as the task level's halved-noise check, for power). Windows and trial counts were fixed
in advance from the closed form (D: ``N(-2, 4^2)``, D': ``N(0, 4^2)``) by a power analysis (the
0.1% quantile of the lower bound over simulated counts): at 6,000 trials, noise halved 1.47 against
a bar of 1.10 (window below -4.5) and m ignored 0.52 against 0.43 (window below -6); the skipped
clip is caught by more than a whole epsilon at 400 trials. Measured (one run of the slow test, a
2-core machine, 7 minutes): honest 0.63 and 0.68 in the tail window, below 0.919; m ignored
refuted, 0.68 against 0.43; noise halved caught, 1.67 against 1.10.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmeta.accounting import epsilon
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.accounting.sample_level_bound import sample_level_epsilon
from fedmeta.server.noise import NoiseSource

from .release_audit import HalvedNoise, lower_bound, reclipping_disabled
from .sample_release_audit import CANARY, event, released

DELTA = 1e-2
CAUGHT = 1.2  # a control is caught when the audit exceeds its claim by 20% (issue 18)
ROUND = event(2, 4.0)
FAR = (-math.inf, -20.0)  # the unclipped canary's sum sits near -4000
NEAR, TAIL = (-math.inf, -4.5), (-math.inf, -6.0)
SKIPPED = 1e12  # the participant's clip, far above any gradient here: effectively none


def eps(round_event: SampleLevelRound) -> float:
    return sample_level_epsilon(round_event, 1, DELTA)


def _pair(trials: int, *, noise: type[NoiseSource] = NoiseSource,
          participant_clip: float | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    with_canary = released(ROUND, [CANARY], trials, noise.create(),
                           participant_clip=participant_clip)  # fmt: skip
    return with_canary, released(ROUND, [], trials, noise.create())


@pytest.mark.integration
def test_a_skipped_clip_is_caught_and_the_servers_recheck_alone_holds() -> None:
    claim = eps(ROUND)
    assert claim == pytest.approx(0.919, abs=2e-3)  # mu = 0.5 at delta 1e-2 (closed form)
    d, d_prime = _pair(400, participant_clip=SKIPPED)
    # The participant skipped its clip; the server re-clipped every row to C_out.
    defended = lower_bound(d, d_prime, FAR, DELTA)
    assert defended < claim and float(np.median(d)) > -20
    with reclipping_disabled():
        open_d, _ = _pair(400, participant_clip=SKIPPED)
    skipped = lower_bound(open_d, d_prime, FAR, DELTA)
    assert skipped > CAUGHT * claim, (skipped, claim)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_release_path_audit_catches_halved_noise_and_an_accountant_ignoring_m() -> None:
    claim = eps(ROUND)
    d, d_prime = _pair(6_000)
    honest, tail = lower_bound(d, d_prime, NEAR, DELTA), lower_bound(d, d_prime, TAIL, DELTA)
    assert honest < claim and tail < claim, (honest, tail, claim)
    # An accountant that counts each example once a round: mu = 1 / z_out. The honest path
    # refutes it (the canary fills two slots).
    one_slot = epsilon([(ROUND.__class__(ROUND.sampling, 1000.0, 4.0, 1, 1), 1)], DELTA)
    assert tail > CAUGHT * one_slot, (tail, one_slot)
    halved_d, halved_d_prime = _pair(6_000, noise=HalvedNoise)
    halved = lower_bound(halved_d, halved_d_prime, NEAR, DELTA)
    assert halved > CAUGHT * claim, (halved, claim)
    print({"honest": round(honest, 3), "tail": round(tail, 3), "one slot claim":
           round(one_slot, 3), "halved": round(halved, 3), "claim": round(claim, 3)})
