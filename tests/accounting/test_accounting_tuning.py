"""Private tuning's bound (accounting/fedmeta/accounting/tuning.py): closed forms and a library.

Papernot and Steinke (2022) state Theorem 2 for any base curve; its corollaries are closed forms we
re-derive here and check the code against, independently of how the code evaluates the theorem:

* Corollary 3, pure ``eps``-DP (``(lambda, eps)``-RDP at every order): letting ``lambda`` and
  ``lambda_hat`` grow, Theorem 2 gives ``eps + (1 + eta) eps = (2 + eta) eps``. With ``eta = 1``
  (geometric) that is ``3 eps``, the figure of Liu and Talwar (2019) for random stopping.
* Corollary 4, a ``rho``-zCDP base (``eps(lambda) = rho lambda``, the Gaussian mechanism with
  ``rho = 1 / (2 sigma^2)``): the ``lambda_hat`` term ``(1 + eta)((lh - 1) rho + log(1/gamma)/lh)``
  is smallest at ``lh* = sqrt(log(1/gamma) / rho)``, where it is ``(1 + eta)(2 sqrt(rho
  log(1/gamma)) - rho)``; so ``eps'(lambda) = rho (lambda - 1) + log(E[K]) / (lambda - 1) + 2 (1 +
  eta) sqrt(rho log(1/gamma)) - eta rho``, which falls then rises in ``lambda``, with its minimum
  ``2 sqrt(rho log E[K]) + 2 (1 + eta) sqrt(rho log(1/gamma)) - eta rho`` at ``lambda = 1 +
  sqrt(log(E[K]) / rho)``.
* Theorem 6 (Poisson) for the Gaussian with its exact ``delta_hat`` (Balle and Wang 2018, Theorem
  8): the code's ``delta_hat`` is the RDP conversion, an upper bound, so the code's value lies on
  or above the closed form, never below.

dp-accounting's ``RepeatAndSelectDpEvent`` implements the same theorems: an independent
implementation to agree with on a subsampled Gaussian.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedmeta.accounting import BudgetLedger, FlatPoissonScheme, GaussianRound, InsecureSeededSource
from fedmeta.accounting.rdp import RDP_ORDERS
from fedmeta.accounting.tuning import (
    Candidate,
    NegativeBinomialTrials,
    PoissonTrials,
    TuningRefused,
    TuningRun,
    check_tuning_fits,
    draw_candidate,
    draw_trials,
    repeated_rdp,
    rounds_rdp,
    tuning_epsilon,
    tuning_rdp,
)

pytestmark = pytest.mark.unit
ROUND = GaussianRound(FlatPoissonScheme(0.01), 1.1)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0])
def test_pure_dp_base_gives_two_plus_eta_times_epsilon_corollary_3(shape: float) -> None:
    eps = 0.7
    orders = [2.0, 10.0, 1e3, 1e6, 1e10]  # a pure-DP curve is flat; the largest order decides
    trials = NegativeBinomialTrials.from_mean(shape, 1000.0)
    out = repeated_rdp(trials, orders, [eps] * len(orders))
    assert out[-1] == pytest.approx((2.0 + shape) * eps, rel=1e-6)
    if shape == 1.0:
        assert out[-1] == pytest.approx(3.0 * eps, rel=1e-6)  # Liu and Talwar (2019): 3 eps


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("rho", [0.01, 0.1, 0.5])
def test_gaussian_base_matches_the_closed_form_corollary_4(shape: float, rho: float) -> None:
    trials = NegativeBinomialTrials.from_mean(shape, 10.0)
    log_g, log_k = math.log(1.0 / trials.gamma), math.log(trials.mean)
    assert rho <= log_g  # lh* >= 1
    orders = sorted({*RDP_ORDERS, math.sqrt(log_g / rho)})
    out = repeated_rdp(trials, orders, [rho * a for a in orders])
    turn = 1.0 + math.sqrt(log_k / rho)
    shift = 2.0 * (1.0 + shape) * math.sqrt(rho * log_g) - shape * rho
    lowest = 2.0 * math.sqrt(rho * log_k) + shift
    for a, value in zip(orders, out, strict=True):
        assert value >= lowest * (1 - 1e-12)  # never below the closed form's minimum
        if a > turn:
            assert value == pytest.approx(rho * (a - 1) + log_k / (a - 1) + shift, rel=1e-9)


def _gaussian_delta(sigma: float, eps: float) -> float:
    """The Gaussian mechanism's exact delta(eps) at sensitivity 1 (Balle and Wang 2018, Thm 8)."""
    a, b = 0.5 / sigma, eps * sigma
    return float(stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b))


@pytest.mark.parametrize("mean", [1.0, 10.0, 1000.0])
def test_poisson_gaussian_lies_on_or_above_theorem_6_with_the_exact_delta(mean: float) -> None:
    sigma = 2.0
    orders = np.asarray(RDP_ORDERS)
    out = repeated_rdp(PoissonTrials(mean), orders, orders / (2 * sigma**2))
    exact = [a / (2 * sigma**2) + mean * _gaussian_delta(sigma, math.log1p(1 / (a - 1)))
             + math.log(mean) / (a - 1) for a in orders]  # fmt: skip
    # The code uses min over larger orders too (monotonicity), so compare with the same envelope.
    envelope = np.minimum.accumulate(np.asarray(exact)[::-1])[::-1]
    assert np.all(out >= envelope * (1 - 1e-9))
    assert np.any(out > np.asarray(exact))  # the conversion's slack: it errs high


def _dp_accounting(run: TuningRun, shape: float, delta: float) -> float:
    (cand,) = run.candidates
    scheme = cand.event.scheme
    assert isinstance(scheme, FlatPoissonScheme)
    step = dp_event.PoissonSampledDpEvent(scheme.rate, dp_event.GaussianDpEvent(1.1))
    event = dp_event.RepeatAndSelectDpEvent(
        dp_event.SelfComposedDpEvent(step, cand.rounds), run.trials.mean, shape
    )
    accountant = rdp_lib.RdpAccountant(orders=list(RDP_ORDERS))
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(("trials", "shape"), [
    (NegativeBinomialTrials.from_mean(1.0, 10.0), 1.0),
    (NegativeBinomialTrials.from_mean(0.5, 10.0), 0.5),
    (NegativeBinomialTrials.from_mean(0.0, 30.0), 0.0),
    (PoissonTrials(10.0), math.inf),
])  # fmt: skip
def test_agrees_with_dp_accountings_repeat_and_select(trials: object, shape: float) -> None:
    run = TuningRun((Candidate("a", ROUND, 500),), trials)  # type: ignore[arg-type]
    ours = tuning_epsilon(run, 1e-6)
    assert ours == pytest.approx(_dp_accounting(run, shape, 1e-6), rel=1e-6)
    # K = 1 almost surely (geometric, gamma -> 1) is one run; more trials cost more than one run.
    one = tuning_epsilon(TuningRun(run.candidates, NegativeBinomialTrials(1.0, 1 - 1e-9)), 1e-6)
    single, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), rounds_rdp([(ROUND, 500)]), 1e-6)
    assert one == pytest.approx(float(single), rel=1e-3)
    assert single < ours


def test_several_candidates_cost_the_most_expensive_one() -> None:
    cheap, dear = Candidate("cheap", ROUND, 100), Candidate("dear", ROUND, 800)
    trials = PoissonTrials(5.0)
    both = tuning_epsilon(TuningRun((cheap, dear), trials), 1e-6)
    assert both == tuning_epsilon(TuningRun((dear,), trials), 1e-6)
    assert both > tuning_epsilon(TuningRun((cheap,), trials), 1e-6)


@settings(max_examples=15, deadline=None)
@given(st.floats(1.0, 200.0), st.floats(1.0, 200.0), st.sampled_from([0.0, 1.0, math.inf]))
def test_more_trials_never_cost_less(m1: float, m2: float, shape: float) -> None:
    def eps(mean: float) -> float:
        trials = (PoissonTrials(mean) if shape == math.inf
                  else NegativeBinomialTrials.from_mean(shape, max(mean, 1.0 + 1e-6)))  # fmt: skip
        return tuning_epsilon(TuningRun((Candidate("a", ROUND, 200),), trials), 1e-6)

    lo, hi = sorted((m1, m2))
    assert eps(lo) <= eps(hi) * (1 + 1e-12)


def test_a_tuning_run_composes_with_the_runs_before_it_in_the_ledger(tmp_path: Path) -> None:
    dear = GaussianRound(FlatPoissonScheme(0.05), 1.0)
    run = TuningRun((Candidate("a", ROUND, 300), Candidate("b", ROUND, 600)), PoissonTrials(4.0))
    fresh = tuning_epsilon(run, 1e-6)
    with BudgetLedger.open(tmp_path / "ledger.db", "fed", 8.0, 1e-6) as ledger:
        for i in range(3):
            ledger.spend(dear, "earlier-run", i)
        groups = ledger.exposures().groups
        after = tuning_epsilon(run, 1e-6, groups)
        before = ledger.epsilon(method="rdp")
    assert after > fresh and after > before
    total = tuning_rdp(run) + rounds_rdp([(dear, 3)])  # RDP adds (Mironov 2017, Proposition 1)
    expected, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), total, 1e-6)
    assert after == pytest.approx(float(expected), rel=1e-12)
    # A run that fits a fresh ledger is refused after the earlier spends, before any trial.
    budget = 2.9  # fresh 2.29, after the ledger's runs 3.13, candidate a alone after them 2.82
    assert fresh < budget < after
    assert check_tuning_fits(run, budget, 1e-6).epsilon_after == pytest.approx(fresh)
    with pytest.raises(TuningRefused) as refused:
        check_tuning_fits(run, budget, 1e-6, groups)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("tuning refused before any trial: 2 candidates")
    assert "what fits: candidates a alone" in line and "mean of at most" in line


def test_the_refusal_says_when_nothing_fits() -> None:
    run = TuningRun((Candidate("a", ROUND, 300),), NegativeBinomialTrials.from_mean(1.0, 5.0))
    with pytest.raises(TuningRefused, match="no candidate alone.*no mean number of trials"):
        check_tuning_fits(run, 0.01, 1e-6)


@pytest.mark.parametrize("trials", [PoissonTrials(3.0), NegativeBinomialTrials.from_mean(1.0, 3.0),
                                    NegativeBinomialTrials.from_mean(0.0, 3.0),
                                    NegativeBinomialTrials.from_mean(2.0, 3.0)])  # fmt: skip
def test_the_number_of_trials_follows_its_law(trials: object) -> None:
    source = InsecureSeededSource(11, stream="tuning-test")
    draws = np.asarray([draw_trials(trials, source) for _ in range(4000)])  # type: ignore[arg-type]
    assert draws.min() >= (0 if isinstance(trials, PoissonTrials) else 1)
    sd = draws.std() / math.sqrt(len(draws))
    assert abs(draws.mean() - trials.mean) < 6 * sd  # type: ignore[attr-defined]
    assert {draw_candidate(3, source) for _ in range(200)} == {0, 1, 2}


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="mean must be a finite number >= 1"):
        PoissonTrials(0.5)
    with pytest.raises(ValueError, match="shape must be a finite number >= 0"):
        NegativeBinomialTrials(-1.0, 0.5)
    with pytest.raises(ValueError, match="gamma must be a finite number in"):
        NegativeBinomialTrials(1.0, 1.0)
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        Candidate("a", ROUND, 0)
    with pytest.raises(ValueError, match="candidates must be a non-empty tuple"):
        TuningRun((), PoissonTrials(2.0))
    with pytest.raises(ValueError, match="orders and trial must be 1-D"):
        repeated_rdp(PoissonTrials(2.0), [2.0, 3.0], [1.0])
