"""The tuner's bound at the setting of Papernot and Steinke's (2022) own experiment, recomputed.

What the paper gives, and what this test can check (issue 42, item 2):

* Its only numbers stated in text for a tuning experiment are the settings of its learning-rate
  search (section 5, "Experimental evaluation", the search plotted in its Figure 7): DP-SGD on
  MNIST, 60 epochs, minibatch 256 (of 60,000, Poisson sampled: ``q = 256 / 60000``), clipping
  norm 1, noise multiplier 1.1, delta 1e-5, ``K`` from the truncated negative binomial (logarithmic
  ``eta = 0``, geometric ``eta = 1``, ``eta = 0.5``) and Poisson laws of several means. The
  privacy values themselves are given only as plots (accuracy against the search's epsilon), which
  cannot be read to a tolerance worth testing; so the settings are reproduced and our values are
  checked against an **independent computation of the theorems**, not against numbers read off a
  figure: Theorem 2 evaluated directly below (numpy over dp-accounting's base curve, with ``gamma``
  solved by scipy's ``brentq`` from scipy's own laws, not by our bisection), and dp-accounting's
  ``RepeatAndSelectDpEvent`` (Google's implementation of the same paper, a second author's
  library). The figure's plotted points themselves, recomputed from the inputs published with the
  paper, are checked in test_accounting_tuning_figure7.py. The closed-form corollaries (3: ``(2 +
  eta) eps`` for pure DP, the Liu and Talwar figure ``3 eps`` at ``eta = 1``; 4: a Gaussian base)
  are checked in test_accounting_tuning.py.
* 60 epochs of 60,000 records at 256 a batch: ``ceil(60 * 60000 / 256) = 14063`` steps (the paper
  states epochs; the step count is ours, rounded up, which errs high).

Tolerances are the tests' arguments: ``CURVE_REL`` for two evaluations of one formula in floating
point, ``LIBRARY_REL`` for dp-accounting's own ``gamma`` search against ours.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import optimize, stats
from tests.accounting.mnist_dpsgd import DELTA, RATE, SIGMA, STEPS, mnist_round

from fedmeta.accounting.rdp import RDP_ORDERS
from fedmeta.accounting.tuning import (
    Candidate,
    NegativeBinomialTrials,
    PoissonTrials,
    TuningRun,
    tuning_epsilon,
    tuning_rdp,
)

pytestmark = pytest.mark.unit
CURVE_REL, LIBRARY_REL = 1e-6, 1e-3
ORDERS = np.asarray(RDP_ORDERS)


def _base() -> npt.NDArray[np.float64]:
    """DP-SGD's RDP curve at the paper's setting, by dp-accounting (not our round pairs)."""
    step = dp_event.PoissonSampledDpEvent(RATE, dp_event.GaussianDpEvent(SIGMA))
    accountant = rdp_lib.RdpAccountant(orders=list(RDP_ORDERS))
    accountant.compose(dp_event.SelfComposedDpEvent(step, STEPS))
    return np.asarray(accountant._rdp, dtype=np.float64)


def _tnb_mean(eta: float, gamma: float) -> float:
    """E[K] of the negative binomial truncated to K >= 1, from scipy's untruncated laws."""
    if eta == 0.0:
        return float(stats.logser(1.0 - gamma).mean())
    law = stats.nbinom(eta, gamma)
    return float(law.mean() / (1.0 - law.pmf(0)))


def _gamma(eta: float, mean: float) -> float:
    return float(optimize.brentq(lambda g: _tnb_mean(eta, g) - mean, 1e-12, 1 - 1e-12,
                                 xtol=1e-15, rtol=1e-14))  # fmt: skip


def _theorem2(eps: npt.NDArray[np.float64], eta: float, mean: float) -> npt.NDArray[np.float64]:
    """Theorem 2 at every order of the grid, the best ``lambda_hat`` among 1 and the grid."""
    gamma = _gamma(eta, mean)
    hats = [(1.0 - 1.0 / lh) * e + math.log(1.0 / gamma) / lh for lh, e in zip(ORDERS, eps,
                                                                               strict=True)]
    best = min([*hats, math.log(1.0 / gamma)])  # lambda_hat = 1: the first term vanishes
    raw = eps + (1.0 + eta) * best + math.log(mean) / (ORDERS - 1.0)
    return np.minimum.accumulate(raw[::-1])[::-1]  # RDP grows with the order


def _run(trials: object) -> TuningRun:
    return TuningRun((Candidate("mnist-dpsgd", mnist_round(), STEPS),), trials)  # type: ignore[arg-type]


@pytest.mark.parametrize("rel", [CURVE_REL])
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mean", [2.0, 10.0, 100.0])
def test_theorem2_at_the_papers_mnist_setting_matches_a_direct_evaluation(
    eta: float, mean: float, rel: float
) -> None:
    ours = tuning_rdp(_run(NegativeBinomialTrials.from_mean(eta, mean)))
    direct = _theorem2(_base(), eta, mean)
    assert np.allclose(ours, direct, rtol=rel, atol=0.0)
    mine, _ = rdp_lib.compute_epsilon(ORDERS, direct, DELTA)
    assert tuning_epsilon(_run(NegativeBinomialTrials.from_mean(eta, mean)), DELTA) == (
        pytest.approx(float(mine), rel=rel))


@pytest.mark.parametrize("rel", [LIBRARY_REL])
@pytest.mark.parametrize(("shape", "mean"), [
    (0.0, 10.0), (1.0, 10.0), (0.5, 100.0), (math.inf, 10.0), (math.inf, 100.0),
])  # fmt: skip
def test_the_papers_mnist_setting_agrees_with_dp_accounting(
    shape: float, mean: float, rel: float
) -> None:
    trials = PoissonTrials(mean) if math.isinf(shape) else NegativeBinomialTrials.from_mean(
        shape, mean)  # fmt: skip
    step = dp_event.PoissonSampledDpEvent(RATE, dp_event.GaussianDpEvent(SIGMA))
    event = dp_event.RepeatAndSelectDpEvent(dp_event.SelfComposedDpEvent(step, STEPS), mean, shape)
    accountant = rdp_lib.RdpAccountant(orders=list(RDP_ORDERS))
    accountant.compose(event)
    assert tuning_epsilon(_run(trials), DELTA) == pytest.approx(
        float(accountant.get_epsilon(DELTA)), rel=rel)


def test_tuning_costs_more_than_one_run_and_less_than_composing_the_mean_number() -> None:
    """The paper's point (section 1): a random count costs far less than composing its mean."""
    base = _base()
    one, _ = rdp_lib.compute_epsilon(ORDERS, base, DELTA)
    composed, _ = rdp_lib.compute_epsilon(ORDERS, 10 * base, DELTA)
    tuned = tuning_epsilon(_run(NegativeBinomialTrials.from_mean(1.0, 10.0)), DELTA)
    assert float(one) < tuned < float(composed)
