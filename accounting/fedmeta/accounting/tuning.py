"""Private hyperparameter tuning: a random number of trials on private data, only the best released.

Setting (Papernot and Steinke 2022, "Hyperparameter tuning with Renyi differential privacy", ICLR
2022; Liu and Talwar 2019, "Private selection from private candidates", for the geometric case).
A *trial* ``Q`` picks one of the candidate configurations uniformly at random (a choice independent
of the data) and runs it: a private training run of that candidate's rounds, then the score of its
noisy model on the server's validation classes, which no participant owns (post-processing). The
tuner ``A`` draws the number of trials ``K`` from a public distribution with a CSPRNG, runs ``K``
independent trials and releases the best one alone. The bound holds for that output only: ``K``,
the other trials' models, their scores, which trial won and anything timed by them stay private.

Bounds, in RDP at every order ``lambda > 1``, for ``Q`` that is ``(lambda, eps(lambda))``-RDP:

* **Truncated negative binomial** ``D_{eta, gamma}`` (``eta >= 0`` here: 0 is the logarithmic
  distribution, 1 the geometric), Papernot and Steinke 2022, **Theorem 2**::

      eps'(lambda) = eps(lambda) + (1 + eta) (1 - 1/lh) eps(lh) + (1 + eta) log(1/gamma) / lh
                     + log(E[K]) / (lambda - 1)            for any lh ("lambda hat") >= 1.

  We take the smallest value over ``lh = 1`` (where the first term vanishes: ``eps(1)``, the KL
  divergence, is finite wherever the curve is finite at some order, RDP growing with the order) and
  the orders of the grid: each is an allowed ``lh``, so the result is at least the infimum over all
  ``lh`` (errs high, never low).
* **Poisson** ``K ~ Poisson(mu)``, **Theorem 6**: if ``Q`` is also ``(eps_hat, delta_hat)``-DP
  with ``exp(eps_hat) <= 1 + 1/(lambda - 1)``::

      eps'(lambda) = eps(lambda) + mu delta_hat + log(mu) / (lambda - 1).

  Taken at ``eps_hat = log(1 + 1/(lambda - 1))``, with ``delta_hat`` the RDP-to-DP conversion of
  ``Q``'s own curve (dp-accounting's ``compute_delta``), an upper bound on ``Q``'s delta (errs
  high). ``mu >= 1`` is required here (as dp-accounting does); with ``K = 0`` nothing is released.

Both are then tightened by the monotonicity of RDP in the order (a value at ``lambda'`` bounds every
``lambda <= lambda'``). ``Q`` with several candidates is a data-independent mixture of them; Renyi
divergence is jointly quasi-convex (van Erven and Harremoes 2014, Theorem 13), so ``Q``'s RDP is at
most the pointwise maximum of the candidates' curves, each ``rounds x`` its round's RDP
(``accounting.composition``: the same per-round dominating pairs the ledger composes).

**Composition with the data's earlier runs.** RDP composes by addition (Mironov 2017, Proposition
1): the prior rounds' RDP plus the tuner's, converted once to epsilon at the ledger's delta with
dp-accounting's ``compute_epsilon`` (an upper bound). For a budget the maximum over the ledger's
participant groups is taken, as the ledger does. The ledger itself enforces PLD epsilons of
Gaussian rounds and has no record kind for a tuning release yet: see docs/privacy.md.

**Drawing K.** Inverse-CDF sampling (scipy.stats) at a uniform with 53 random bits from the
``RandomSource`` (the OS CSPRNG in service): the realised law of ``K`` is within about ``2**-52`` in
total variation of the analysed one, which adds at most ``(1 + e^eps) 2**-52`` to delta (an error
that could err low, and is nine orders of magnitude below any delta a budget uses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import stats

from fedmeta.accounting.randomness import RandomSource
from fedmeta.accounting.rdp import RDP_ORDERS
from fedmeta.accounting.schemes import GaussianRound, Unit
from fedmeta.accounting.tuning_release import Recorded, TuningRelease, recorded_rdp

_Floats: TypeAlias = npt.NDArray[np.float64]
#: Earlier spends of a participant group: rounds, and tuning releases (tuning_release.py).
RoundGroups: TypeAlias = Sequence[tuple[Recorded, int]]
#: Bits of the uniform each draw of ``K`` uses.
_UNIFORM_BITS = 53


def _finite_at_least(name: str, value: object, low: float, *, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}; "
                         f"got {value!r}")  # fmt: skip
    if value < low or (strict and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}; "
                         f"got {value!r}")  # fmt: skip
    return float(value)


@dataclass(frozen=True)
class PoissonTrials:
    """``K ~ Poisson(mean)`` trials (Theorem 6); ``K = 0`` releases nothing."""

    mean: float

    def __post_init__(self) -> None:
        _finite_at_least("mean", self.mean, 1.0)


def _tnb_mean(shape: float, gamma: float) -> float:
    """``E[K]`` of the truncated negative binomial ``D_{shape, gamma}`` (the paper's section 2)."""
    if shape == 0.0:  # the logarithmic distribution
        return (1.0 / gamma - 1.0) / math.log(1.0 / gamma)
    return float(shape * (1.0 - gamma) / (gamma * (1.0 - gamma**shape)))


@dataclass(frozen=True)
class NegativeBinomialTrials:
    """``K ~ D_{shape, gamma}``, the negative binomial truncated to ``K >= 1`` (Theorem 2).

    ``P(K = k)`` is proportional to ``binom(k + shape - 1, k) (1 - gamma)^k`` for ``k >= 1``
    (``shape = 0``: to ``(1 - gamma)^k / k``, the logarithmic distribution).
    """

    shape: float
    gamma: float

    def __post_init__(self) -> None:
        _finite_at_least("shape", self.shape, 0.0)
        gamma = _finite_at_least("gamma", self.gamma, 0.0, strict=True)
        if gamma >= 1.0:
            raise ValueError(f"gamma must be a finite number in (0, 1); got {self.gamma!r}")

    @property
    def mean(self) -> float:
        """``E[K]``."""
        return _tnb_mean(self.shape, self.gamma)

    @classmethod
    def from_mean(cls, shape: float, mean: float) -> NegativeBinomialTrials:
        """The distribution of this shape whose mean is ``mean`` (``gamma`` by bisection).

        ``E[K]`` falls as ``gamma`` grows; the bisection keeps the smaller end, whose mean is at
        least ``mean``: the accountant and the sampler both use the returned ``gamma``.
        """
        _finite_at_least("shape", shape, 0.0)
        if _finite_at_least("mean", mean, 1.0, strict=True) > 1e12:
            raise ValueError(f"mean must be at most 1e12; got {mean!r}")
        lo, hi = 0.0, 1.0
        for _ in range(200):  # halves [lo, hi] down to float resolution
            mid = 0.5 * (lo + hi)
            if _tnb_mean(shape, mid) >= mean:
                lo = mid
            else:
                hi = mid
        return cls(float(shape), lo if lo > 0.0 else hi)


Trials: TypeAlias = PoissonTrials | NegativeBinomialTrials


def repeated_rdp(
    trials: Trials, orders: Sequence[float] | _Floats, trial: Sequence[float] | _Floats
) -> _Floats:
    """The tuner's RDP curve from one trial's (``trial[i]`` at ``orders[i]``): Theorems 2 and 6.

    Orders at or below 1 get infinity (the theorems need ``lambda > 1``); an infinite trial value
    stays infinite.
    """
    a = np.asarray(orders, dtype=np.float64)
    eps = np.asarray(trial, dtype=np.float64)
    if a.shape != eps.shape or a.ndim != 1:
        raise ValueError(f"orders and trial must be 1-D of one length; got {a.shape}, {eps.shape}")
    if np.any(np.isnan(eps)) or np.any(eps < 0.0):
        raise ValueError("trial must hold RDP values >= 0 (inf allowed)")
    out = np.full(a.shape, np.inf)
    above = a > 1.0
    log_mean = math.log(trials.mean)
    if isinstance(trials, NegativeBinomialTrials):
        with np.errstate(invalid="ignore"):
            hat = (1.0 - 1.0 / a) * eps + math.log(1.0 / trials.gamma) / a
        best_hat = float(np.min(np.where(a >= 1.0, hat, np.inf)))
        if np.any(np.isfinite(eps[above])):
            # lh = 1: (1 - 1/1) eps(1) = 0, as eps(1) <= eps(lambda) < inf (RDP grows with order).
            best_hat = min(best_hat, math.log(1.0 / trials.gamma))
        out[above] = eps[above] + (1.0 + trials.shape) * best_hat + log_mean / (a[above] - 1.0)
    else:
        for i in np.flatnonzero(above):
            eps_hat = math.log1p(1.0 / (a[i] - 1.0))
            delta_hat = _delta_of(a, eps, eps_hat)
            out[i] = eps[i] + trials.mean * delta_hat + log_mean / (a[i] - 1.0)
    # Monotonicity of RDP in the order: the value at a larger order bounds every smaller one.
    return np.minimum.accumulate(out[::-1])[::-1]


def _delta_of(orders: _Floats, rdp: _Floats, epsilon_value: float) -> float:
    """Delta at ``epsilon_value`` of an RDP curve (dp-accounting's conversion: an upper bound)."""
    if np.all(np.isinf(rdp)):
        return 1.0
    delta, _ = rdp_lib.compute_delta(orders, rdp, epsilon_value)
    return float(delta)


def rounds_rdp(rounds: RoundGroups, unit: Unit = "task") -> _Floats:
    """RDP over ``RDP_ORDERS`` of ``rounds`` and tuning releases, summed (composed)."""
    return recorded_rdp(list(rounds), unit)


@dataclass(frozen=True)
class Candidate:
    """One candidate configuration of a tuning run: its round's event and how many rounds."""

    label: str
    event: GaussianRound
    rounds: int

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"label must be a non-empty string; got {self.label!r}")
        if not isinstance(self.event, GaussianRound):
            raise ValueError(f"event must be a GaussianRound; got {self.event!r}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1; got {self.rounds!r}")


@dataclass(frozen=True)
class TuningRun:
    """A tuning run: its candidates, the law of its number of trials, the accounting unit."""

    candidates: tuple[Candidate, ...]
    trials: Trials
    unit: Unit = "task"

    def __post_init__(self) -> None:
        if not self.candidates or not all(isinstance(c, Candidate) for c in self.candidates):
            raise ValueError(f"candidates must be a non-empty tuple of Candidate; got "
                             f"{self.candidates!r}")  # fmt: skip
        if len({c.event.neighbouring for c in self.candidates}) > 1:
            raise ValueError("candidates must share one neighbouring relation; a guarantee is "
                             "stated for one")  # fmt: skip
        if not isinstance(self.trials, PoissonTrials | NegativeBinomialTrials):
            raise ValueError(f"trials must be PoissonTrials or NegativeBinomialTrials; got "
                             f"{self.trials!r}")  # fmt: skip


def trial_rdp(run: TuningRun) -> _Floats:
    """RDP of one trial: the pointwise maximum over the candidates (joint quasi-convexity)."""
    curves = [rounds_rdp([(c.event, c.rounds)], run.unit) for c in run.candidates]
    return np.asarray(np.max(np.vstack(curves), axis=0), dtype=np.float64)


def tuning_rdp(run: TuningRun) -> _Floats:
    """RDP over ``RDP_ORDERS`` of the whole tuning run (its best trial released)."""
    return repeated_rdp(run.trials, RDP_ORDERS, trial_rdp(run))


def tuning_epsilon(run: TuningRun, delta: float, prior: Sequence[RoundGroups] = ((),)) -> float:
    """Epsilon at ``delta`` of the tuning run after each of ``prior``'s groups of rounds: the max.

    ``prior``: the ledger's participant groups (``BudgetLedger.exposures().groups``), each a list
    of ``(GaussianRound, count)``; the default is a fresh ledger. RDP composition, then conversion.
    """
    if not (isinstance(delta, float | int) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be a number in (0, 1); got {delta!r}")
    tuner = tuning_rdp(run)
    worst = 0.0
    for group in prior or ((),):
        total = tuner + recorded_rdp(list(group), run.unit)
        if np.all(np.isinf(total)):
            return math.inf
        eps, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), total, float(delta))
        worst = max(worst, float(eps))
    return worst


def draw_trials(trials: Trials, source: RandomSource) -> int:
    """``K`` drawn from ``trials`` with ``source``'s bits (inverse CDF; the module docstring)."""
    u = (source.randbelow(2**_UNIFORM_BITS) + 1) / (2**_UNIFORM_BITS + 1)  # in (0, 1)
    if isinstance(trials, PoissonTrials):
        return int(stats.poisson.ppf(u, trials.mean))
    if trials.shape == 0.0:
        return int(stats.logser.ppf(u, 1.0 - trials.gamma))
    law = stats.nbinom(trials.shape, trials.gamma)
    at_zero = float(law.cdf(0))
    return max(1, int(law.ppf(at_zero + u * (1.0 - at_zero))))


def draw_candidate(count: int, source: RandomSource) -> int:
    """The index of one of ``count`` candidates, uniform (the trial's data-independent choice)."""
    return source.randbelow(count)


# ------------------------------------------------------------------------- the check before trials


class TuningRefused(ValueError):
    """The tuning run would exceed the data's budget; refused before any trial, nothing spent."""


@dataclass(frozen=True)
class TuningCost:
    """What a tuning run costs after the data's earlier runs, checked against its budget."""

    epsilon_before: float
    epsilon_after: float
    epsilon_budget: float
    delta: float


def check_tuning_fits(
    run: TuningRun, epsilon_budget: float, delta: float, prior: Sequence[RoundGroups] = ((),)
) -> TuningCost:
    """The tuning run's cost, or :class:`TuningRefused` in one line saying what would fit.

    Call before the first trial: every candidate may be drawn, so all of them must fit. What fits
    is stated as the candidates that fit alone with the same law of trials, and the largest mean
    number of trials with which all of them fit (same shape), if any.
    """
    budget = _finite_at_least("epsilon_budget", epsilon_budget, 0.0, strict=True)
    before = _epsilon_of_groups(prior, delta, run.unit)
    after = tuning_epsilon(run, delta, prior)
    if after <= budget:
        return TuningCost(before, after, budget, delta)
    alone = [c.label for c in run.candidates
             if tuning_epsilon(_with(run, (c,)), delta, prior) <= budget]  # fmt: skip
    mean = _largest_mean(run, budget, delta, prior)
    fits = [f"candidates {', '.join(alone)} alone with the same trials" if alone else
            "no candidate alone with the same trials"]  # fmt: skip
    fits.append(f"all {len(run.candidates)} with a mean of at most {mean:.3g} trials"
                if mean is not None else "no mean number of trials with all of them")  # fmt: skip
    raise TuningRefused(
        f"tuning refused before any trial: {len(run.candidates)} candidates with a mean of "
        f"{run.trials.mean:.3g} trials would take the data's epsilon from {before:.4g} to "
        f"{after:.4g} > budget {budget:g} (delta {delta:g}, {run.unit} level, RDP); what fits: "
        + "; ".join(fits)
    )


def _with(run: TuningRun, candidates: tuple[Candidate, ...], trials: Trials | None = None
          ) -> TuningRun:  # fmt: skip
    return TuningRun(candidates, trials or run.trials, run.unit)


def _epsilon_of_groups(prior: Sequence[RoundGroups], delta: float, unit: Unit) -> float:
    """The prior rounds' epsilon (RDP, the maximum over groups), the tuner's starting point."""
    worst = 0.0
    for group in prior:
        if group:
            total = recorded_rdp(list(group), unit)
            eps, _ = rdp_lib.compute_epsilon(np.asarray(RDP_ORDERS), total, delta)
            worst = max(worst, float(eps))
    return worst


def _trials_with_mean(trials: Trials, mean: float) -> Trials:
    if isinstance(trials, PoissonTrials):
        return PoissonTrials(mean)
    return NegativeBinomialTrials.from_mean(trials.shape, mean)


def _largest_mean(
    run: TuningRun, budget: float, delta: float, prior: Sequence[RoundGroups]
) -> float | None:
    """The largest mean number of trials (to 1%) with which every candidate fits, or None."""
    low = 1.0 if isinstance(run.trials, PoissonTrials) else 1.0 + 1e-9
    if tuning_epsilon(_with(run, run.candidates, _trials_with_mean(run.trials, low)), delta,
                      prior) > budget:  # fmt: skip
        return None
    high = run.trials.mean  # refused at this mean, so the answer lies below it
    while high / low > 1.01:
        mid = math.sqrt(low * high)
        trials = _trials_with_mean(run.trials, mid)
        if tuning_epsilon(_with(run, run.candidates, trials), delta, prior) <= budget:
            low = mid
        else:
            high = mid
    return low


# ------------------------------------------------------------------------------- the record


def release_of(run: TuningRun, description: str) -> TuningRelease:
    """The ledger's record of ``run``'s release (tuning_release.py): its RDP curves.

    The participant-level curve is computed where every candidate's round caps a participant's
    tasks (``participant_cap``) and has participants (a two-stage scheme); otherwise ``None``,
    which composes to no bound at that level.
    """
    neighbouring = run.candidates[0].event.neighbouring
    task = tuning_rdp(run) if run.unit == "task" else tuning_rdp(_with_unit(run, "task"))
    caps = [c.event.participant_cap for c in run.candidates]
    participant: tuple[float, ...] | None = None
    cap: int | None = None
    if all(isinstance(c, int) for c in caps):
        try:
            participant = tuple(float(v) for v in tuning_rdp(_with_unit(run, "participant")))
            cap = max(int(c) for c in caps if c is not None)
        except ValueError:  # a single-stage scheme: no participants to bound
            participant, cap = None, None
    return TuningRelease(tuple(RDP_ORDERS), tuple(float(v) for v in task), participant, cap,
                         neighbouring, description)  # fmt: skip


def _with_unit(run: TuningRun, unit: Unit) -> TuningRun:
    return TuningRun(run.candidates, run.trials, unit)


def describe(run: TuningRun) -> str:
    """The public plan of ``run`` in one line (recorded with its release, for the operator)."""
    law = (f"Poisson(mean {run.trials.mean:g})" if isinstance(run.trials, PoissonTrials) else
           f"truncated negative binomial(eta {run.trials.shape:g}, gamma {run.trials.gamma:.6g}, "
           f"mean {run.trials.mean:.4g})")  # fmt: skip
    rounds = ", ".join(f"{c.label}: {c.rounds} rounds" for c in run.candidates)
    return f"tuning: K ~ {law} trials over {len(run.candidates)} candidates ({rounds})"
