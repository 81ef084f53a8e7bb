"""The base run of Papernot and Steinke's (2022) tuning experiment: DP-SGD on MNIST (section 5).

60 epochs of 60,000 records at minibatch 256, Poisson sampled, noise multiplier 1.1, delta 1e-5.
The paper states epochs; the step count ``ceil(60 * 60000 / 256) = 14063`` is ours, rounded up
(errs high), and it reproduces the RDP curve published with the paper's Figure 7
(test_accounting_tuning_figure7.py). Shared by the tuner's tests at the paper's setting.
"""

from __future__ import annotations

import math

from fedmeta.accounting import FlatPoissonScheme, GaussianRound

RATE, SIGMA, DELTA = 256 / 60000, 1.1, 1e-5
STEPS = math.ceil(60 * 60000 / 256)


def mnist_round() -> GaussianRound:
    """One DP-SGD step of the base run as the ledger's round event."""
    return GaussianRound(FlatPoissonScheme(RATE), SIGMA)
