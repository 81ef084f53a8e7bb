"""An empirical audit of the real release path: sampling, validation, aggregation, secure noise.

Each trial is one private round through ``server.round.run_round`` with the private release
(``server.release_strategy.PrivateRound``): the real ``TwoStageSampler``
on the operating system's CSPRNG, replies validated and re-clipped by
``server/fedmeta/server/validation.py``, the
sum noised by ``server/fedmeta/server/noise.py`` (AES-CTR keystreams, the release grid), divided by
the public
normaliser. Participants are scripted to send fixed 1-D gradients (unclipped: the server's re-clip
is part of what is audited), for a worst-case pair of neighbouring datasets D (with the target
task) and D' (without it). The released values of many rounds on each give, for a test fixed in
advance (the release falling in a window), a Clopper-Pearson lower bound on epsilon:

    eps >= log((TPR_lower - delta) / FPR_upper)        (95% two-sided intervals)

The bound must stay below the accountant's epsilon, and exceed the epsilon claimed by each negative
control, which shows the audit has the power to catch a broken mechanism or accountant.

With adaptive clipping on (``adaptive=...``) a round releases two values, the noisy sum and the
noisy centred count of clip bits. The count is read where it really leaves the server: from the
next round's clip bound ``C_1`` (which goes to every participant and into ``rounds.csv``), inverted
through the public update rule. The participants report their bits with the client's own function
(``client.gradients.clip_bits``), and the adversary's statistic is the likelihood-ratio projection
of both releases (:func:`projection`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import stats

from fedmeta.accounting import (
    GaussianRound,
    SystemRandomSource,
    TwoStageSampler,
    gradient_noise_multiplier,
)
from fedmeta.client.gradients import clip_bits
from fedmeta.protocol import REPLY_PER_TASK, GradientReply, GradientRequest
from fedmeta.server import release_strategy as release_mod
from fedmeta.server import validation as validation_mod
from fedmeta.server.noise import NoiseSource
from fedmeta.server.plan import AdaptiveClipping, PrivatePlan
from fedmeta.server.release_strategy import PrivateRound
from fedmeta.server.round import Delivery, Exchange, RoundContext, RoundSetup, run_round

from .fakes import fake_ledger


@dataclass(frozen=True)
class Neighbours:
    """A worst-case pair: each participant's per-task 1-D gradients, with and without the target."""

    with_target: Mapping[str, Sequence[float]]
    without_target: Mapping[str, Sequence[float]]


class _Released:
    """Stands in for the training state: records ``update * normaliser`` (the released sum)."""

    def __init__(self, normaliser: float) -> None:
        self.normaliser = normaliser
        self.values: list[float] = []
        self.clip: float | None = None  # adaptive clipping's bound: reset before every trial

    def set_noise_variance(self, variance: float) -> None:
        pass

    def flat(self) -> np.ndarray:
        return np.zeros(1, dtype=np.float32)

    def step(self, update: torch.Tensor, index: int) -> None:
        self.values.append(float(update[0]) * self.normaliser)


def _transport(grads: Mapping[str, Sequence[float]]) -> Any:
    table = {pid: np.asarray(g, dtype=np.float32) for pid, g in grads.items()}

    def reply(pid: str, req: GradientRequest) -> GradientReply:
        rows = table[pid][list(req.task_ids)]
        bits = None if req.clip is None else clip_bits(np.abs(rows), req.clip)  # 1-D: norm = |g|
        return GradientReply(req.run_id, req.round_id, pid, req.task_ids, rows[:, None], None,
                             None, None, bits)  # fmt: skip

    def exchange(requests: Mapping[str, GradientRequest]) -> Exchange:
        return Exchange({pid: Delivery(reply(pid, req)) for pid, req in requests.items()}, {})

    return exchange


def adaptive_clipping(event: GaussianRound, count_noise: float) -> AdaptiveClipping:
    """Adaptive clipping for an audit: C_0 = 1, eta = 1, gamma = 1/2, wide bounds (invertible)."""
    z_grad = gradient_noise_multiplier(event.noise_multiplier, count_noise)
    return AdaptiveClipping(0.5, 1.0, count_noise, z_grad, 1.0, 1e-12, 1e12)


def _pipeline(
    event: GaussianRound,
    grads: Mapping[str, Sequence[float]],
    noise: NoiseSource,
    adaptive: AdaptiveClipping | None,
    normaliser: float,
) -> tuple[RoundContext, Any]:
    """The round's context and ``setup(clip)``: the round's setup at the bound ``clip``.

    The release is the private one the run chooses (``PrivateRound``), on this very event.
    """
    plan = PrivatePlan(event, 1.0, 1e9, 1e-5, False, adaptive)
    ledger = fake_ledger(1e12, 1e-12)
    context = RoundContext("audit", "audit", _transport(grads), "{}", 1, REPLY_PER_TASK, 1e-4,
                           False)  # fmt: skip
    counts = {pid: len(g) for pid, g in grads.items()}
    sampler = TwoStageSampler(event.scheme, SystemRandomSource())

    def setup(clip: float | None) -> RoundSetup:
        bound = 1.0 if clip is None else clip
        release = PrivateRound(plan, bound, ledger, noise, "audit", 1, normaliser)
        return RoundSetup(counts, sampler, release)

    return context, setup


def released(
    event: GaussianRound,
    grads: Mapping[str, Sequence[float]],
    trials: int,
    noise: NoiseSource,
    adaptive: AdaptiveClipping | None = None,
) -> np.ndarray:
    """What one private round releases, ``trials`` times, through the real pipeline.

    The sums ``[trials]``; with ``adaptive``, ``[trials, 2]``: the sum and the noisy centred count,
    the latter recovered from the next bound, ``C_1 = C_0 exp(-eta (count / normaliser + 1/2 -
    gamma))``. Every trial starts from ``C_0``.
    """
    normaliser = 1.0
    context, setup = _pipeline(event, grads, noise, adaptive, normaliser)
    out = _Released(normaliser)
    counts = []
    for index in range(trials):
        out.clip = None if adaptive is None else adaptive.initial_clip
        run_round(context, setup(out.clip), out, index)  # type: ignore[arg-type]
        if adaptive is not None:
            assert out.clip is not None
            step = math.log(out.clip / adaptive.initial_clip) / adaptive.learning_rate
            counts.append((adaptive.target_quantile - step - 0.5) * normaliser)
    if adaptive is None:
        return np.asarray(out.values)
    return np.column_stack([out.values, counts])


def clip_trajectory(
    event: GaussianRound,
    grads: Mapping[str, Sequence[float]],
    rounds: int,
    adaptive: AdaptiveClipping,
    normaliser: float,
) -> list[float]:
    """The bound of each of ``rounds`` consecutive private rounds through the real pipeline."""
    context, setup = _pipeline(event, grads, NoiseSource.create(), adaptive, normaliser)
    out = _Released(normaliser)
    out.clip = adaptive.initial_clip
    clips = []
    for index in range(rounds):
        clips.append(float(out.clip))
        run_round(context, setup(out.clip), out, index)  # type: ignore[arg-type]
    return clips


def projection(
    values: np.ndarray, with_target: Sequence[float], without_target: Sequence[float],
    stds: Sequence[float],
) -> np.ndarray:  # fmt: skip
    """The likelihood-ratio statistic of independent Gaussian releases, scaled to means 1 and 0.

    For releases with means ``with_target`` (D) or ``without_target`` (D') and standard deviations
    ``stds``, the optimal test thresholds ``sum_k d_k x_k / s_k^2`` (``d`` the mean difference).
    Shifted and scaled, it is ``N(1, zeta^2)`` on D and ``N(0, zeta^2)`` on D', ``zeta = 1 /
    |d / s|``: the one Gaussian mechanism the pair of releases is
    (accounting/fedmeta/accounting/adaptive.py). The
    means and scales come from the mechanism's closed form, fixed before any sample is drawn.
    """
    a, b, s = (np.asarray(v, dtype=np.float64) for v in (with_target, without_target, stds))
    weights = (a - b) / s**2
    return (np.asarray(values, dtype=np.float64) - b) @ weights / float((a - b) @ weights)


def lower_bound(positive: np.ndarray, negative: np.ndarray, window: tuple[float, float],
                delta: float) -> float:  # fmt: skip
    """Clopper-Pearson lower bound on epsilon of the test "the release falls in ``window``"."""
    low, high = window
    n_pos, n_neg = len(positive), len(negative)
    tp = int(np.count_nonzero((positive > low) & (positive < high)))
    fp = int(np.count_nonzero((negative > low) & (negative < high)))
    tpr_low = stats.beta.ppf(0.025, tp, n_pos - tp + 1) if tp else 0.0
    fpr_high = stats.beta.ppf(0.975, fp + 1, n_neg - fp)
    return math.log((tpr_low - delta) / fpr_high) if tpr_low > delta else 0.0


def audit(
    event: GaussianRound,
    pair: Neighbours,
    trials: int,
    window: tuple[float, float],
    delta: float,
    *,
    noise: type[NoiseSource] | None = None,
    positive_is_without: bool = False,
    adaptive: AdaptiveClipping | None = None,
    statistic: Any = None,
) -> float:
    """The lower bound for ``pair`` under the real path (or a control's noise source).

    With ``adaptive``, ``statistic`` maps the ``[trials, 2]`` releases to the tested scalar.
    """
    make = (noise or NoiseSource).create
    d = released(event, pair.with_target, trials, make(), adaptive)
    d_prime = released(event, pair.without_target, trials, make(), adaptive)
    if statistic is not None:
        d, d_prime = statistic(d), statistic(d_prime)
    if positive_is_without:
        d, d_prime = d_prime, d
    return lower_bound(d, d_prime, window, delta)


# ------------------------------------------------------------------------------ negative controls


class HalvedNoise(NoiseSource):
    """Control: a noise source that draws half the standard deviation the event claims."""

    def standard_normal(self, n: int) -> np.ndarray:
        return super().standard_normal(n) * 0.5


@contextlib.contextmanager
def reclipping_disabled() -> Iterator[None]:
    """Control: the server trusts the participants' clipping (no re-clip of over-norm rows)."""

    def trusting(grads: torch.Tensor, clip: float, *, nonfinite: str = "raise") -> Any:
        return grads, torch.linalg.vector_norm(grads, dim=1)

    real_fused = validation_mod.fused_row_sum

    def trusting_sum(grads: Any, clip: float) -> Any:  # the fused re-check, told C = inf
        return real_fused(grads, math.inf)

    # Both server paths: the fused per-task re-check (server/recheck.py) and the unfused one.
    with patched(validation_mod, "clip_by_global_norm", trusting), \
            patched(validation_mod, "fused_row_sum", trusting_sum):
        yield


@contextlib.contextmanager
def divided_by_realised_count() -> Iterator[None]:
    """Control: the noisy sum divided by the number of tasks received (Opacus issue #571)."""
    real = PrivateRound.release

    def by_count(self: PrivateRound, checked: Any, index: int) -> Any:
        out = real(self, checked, index)
        assert out is not None  # the audit's ledger never runs out
        received = sum(a.n_tasks for a in checked.accepted)
        return dataclasses.replace(out, update=out.update * self.normaliser / max(received, 1))

    with patched(PrivateRound, "release", by_count):
        yield


@contextlib.contextmanager
def count_without_noise() -> Iterator[None]:
    """Control (adaptive clipping): the count of clip bits released exactly, without its noise."""
    real = release_mod.noised_release

    def exact(total: torch.Tensor, centred_count: float, **kw: Any) -> Any:
        return dataclasses.replace(real(total, centred_count, **kw), count=float(centred_count))

    with patched(release_mod, "noised_release", exact):
        yield


@contextlib.contextmanager
def count_not_centred() -> Iterator[None]:
    """Control (adaptive clipping): ``sum b_i`` released instead of ``sum (b_i - 1/2)``.

    Under add/remove the count's sensitivity is then 1, twice what the noise split assumes.
    """

    def uncentred(checked: Any) -> float:
        return float(sum(a.under_clip for a in checked.accepted))

    with patched(release_mod, "centred_count", uncentred):
        yield


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block (a control's broken piece), restored after."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
