"""The meta-learning rate and model selection a planned design's signal-to-noise calls for.

A heuristic for utility, measured on this project's runs, not a privacy quantity: the rate and
which validated model is released are post-processing of the noisy updates (Dwork and Roth 2014,
Prop. 2.1), so this advice costs no privacy whichever way it errs.

Why the rate should shrink with the signal-to-noise ratio. ``fedmeta privacy plan
--signal-norm G --dimension d`` gives each design's run SNR, ``round_snr * sqrt(T)`` with
``round_snr = G / sqrt(d sigma^2 + (C^2 - G^2) / E[lot])``
(accounting/fedmeta/accounting/planner.py). When it is
small, each round's update is mostly noise and Adam moves every coordinate by about its learning
rate whatever the signal (server/fedmeta/server/optimizer.py): the progress along the signal grows
with the rate,
the variance of the random walk the noise adds (and the loss it costs) with its square, so a
smaller rate keeps more of the gain. The same holds for SGD with momentum, so the factor applies
whatever ``training.optimizer`` is; the measurements below are Adam's.
The base configuration's rate is taken as the non-private one (tuned without noise). Measured
(docs/results.md, Adam, lot 100, (1.5, 1e-6) unless said; run SNRs from G on public tasks):

* run SNR 0.85, Omniglot 5-way from a public warm start: the base rate 0.003 ended 0.4 points
  under the warm start (3 runs), a third of it (0.001) 0.4 points above it (3 runs), a tenth of it
  (0.0003) 0.5 points above it (3 runs; their last models as well as their best validated ones);
* run SNR 1.41, 20-way from a public warm start: the base rate 0.003 lost 10.8 points (1 run), a
  tenth of it (0.0003) gained 1.3 (3 runs);
* run SNR about 38, the sinusoid's default design at epsilon 8 (G = 0.47 at C = 1, lot 200, 200
  rounds): the base rate 0.03 beat two thirds of it, 0.02 (test MSE 0.462 against 0.523, 1 run
  each), and 0.01 was far worse at every design tried.

So the advice is the base rate at run SNR 10 and above (measured at 38 only; the other sinusoid
designs in docs/results.md, at 6 to 38, ran at that rate with no other rate tried; 10 is a choice,
not a measured edge), a tenth of it at 1.5 and below, and between them log-linear in the SNR: an
interpolation, not measured. Below
run SNR 10 it also releases the best validated model (server/fedmeta/server/selection.py), which
guards against a
rate still too large: such a run can end below where it started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["HIGH_SNR", "LOW_SNR", "SMALLEST_FACTOR", "RateAdvice", "advise_rate"]

#: At and above this run SNR the base (non-private) rate is kept: the sinusoid's runs.
HIGH_SNR = 10.0
#: At and below this run SNR the rate is :data:`SMALLEST_FACTOR` of the base: the Omniglot runs.
LOW_SNR = 1.5
SMALLEST_FACTOR = 0.1


@dataclass(frozen=True)
class RateAdvice:
    """The advised ``training.meta_lr`` (``factor`` times the base) and model selection."""

    run_snr: float
    base_rate: float
    factor: float
    select_best_validation: bool

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_rate) and self.base_rate > 0):
            raise ValueError(f"base_rate must be a positive number; got {self.base_rate!r}")
        if not SMALLEST_FACTOR <= self.factor <= 1:
            raise ValueError(f"factor must be in [{SMALLEST_FACTOR}, 1]; got {self.factor!r}")

    @property
    def rate(self) -> float:
        """The advised rate: the base itself at factor 1, else to 3 significant digits."""
        if self.factor == 1:
            return self.base_rate
        return float(f"{self.base_rate * self.factor:.3g}")

    def describe(self, optimizer: str) -> str:
        """One line: what is advised and on what ground."""
        base = self.base_rate
        if self.factor == 1:
            what = f"kept training.meta_lr = {base:g}"
        else:
            what = f"training.meta_lr = {self.rate:g} ({self.factor:.3g} x the base {base:g})"
        if self.run_snr <= LOW_SNR:
            where = "the low-SNR rule"
        elif self.run_snr >= HIGH_SNR:
            where = "the high-SNR rule"
        else:
            where = "interpolated between the rules"
        return (
            f"{what} for run SNR {self.run_snr:.3g} ({where}, measured with adam; configured: "
            f"{optimizer}; docs/privacy.md, a utility heuristic, not a privacy quantity)"
        )


def advise_rate(run_snr: float, base_rate: float) -> RateAdvice:
    """The rate factor for ``run_snr`` (module docstring): 1 at >= 10, 0.1 at <= 1.5, log-linear."""
    if math.isnan(run_snr) or run_snr < 0:
        raise ValueError(f"run_snr must be a non-negative number; got {run_snr!r}")
    if run_snr >= HIGH_SNR:
        factor = 1.0
    elif run_snr <= LOW_SNR:
        factor = SMALLEST_FACTOR
    else:
        position = math.log(run_snr / LOW_SNR) / math.log(HIGH_SNR / LOW_SNR)
        factor = SMALLEST_FACTOR ** (1.0 - position)
    return RateAdvice(run_snr, base_rate, factor, select_best_validation=run_snr < HIGH_SNR)
