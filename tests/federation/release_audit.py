"""An empirical audit of the real release path: sampling, validation, aggregation, secure noise.

Each trial is one private round through ``server.round.run_round``: the real ``TwoStageSampler``
on the operating system's CSPRNG, replies validated and re-clipped by ``server/validation.py``, the
sum noised by ``server/noise.py`` (AES-CTR keystreams, the release grid), divided by the public
normaliser. Participants are scripted to send fixed 1-D gradients (unclipped: the server's re-clip
is part of what is audited), for a worst-case pair of neighbouring datasets D (with the target
task) and D' (without it). The released values of many rounds on each give, for a test fixed in
advance (the release falling in a window), a Clopper-Pearson lower bound on epsilon:

    eps >= log((TPR_lower - delta) / FPR_upper)        (95% two-sided intervals)

The bound must stay below the accountant's epsilon, and exceed the epsilon claimed by each negative
control, which shows the audit has the power to catch a broken mechanism or accountant.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import stats

from accounting import GaussianRound, SystemRandomSource, TwoStageSampler
from fedmeta.protocol import REPLY_PER_TASK, GradientReply, GradientRequest
from server import round as round_mod
from server import validation as validation_mod
from server.noise import NoiseSource
from server.plan import RunPlan
from server.round import Delivery, Exchange, RoundSession, run_round

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

    def flat(self) -> np.ndarray:
        return np.zeros(1, dtype=np.float32)

    def step(self, update: torch.Tensor, index: int) -> None:
        self.values.append(float(update[0]) * self.normaliser)


def _transport(grads: Mapping[str, Sequence[float]]) -> Any:
    table = {pid: np.asarray(g, dtype=np.float32) for pid, g in grads.items()}

    def exchange(requests: Mapping[str, GradientRequest]) -> Exchange:
        return Exchange(
            {
                pid: Delivery(GradientReply(req.run_id, req.round_id, pid, req.task_ids,
                                            table[pid][list(req.task_ids)][:, None], None, None))
                for pid, req in requests.items()
            },
            {},
        )  # fmt: skip

    return exchange


def released(
    event: GaussianRound, grads: Mapping[str, Sequence[float]], trials: int, noise: NoiseSource
) -> np.ndarray:
    """The sums one private round releases, ``trials`` times, through the real pipeline."""
    plan = RunPlan(True, event.neighbouring, event.scheme, event, 1.0, 1.0, False, 1e9, 1e-5,
                   10**9)  # type: ignore[arg-type]  # fmt: skip
    counts = {pid: len(g) for pid, g in grads.items()}
    sampler = TwoStageSampler(plan.scheme, SystemRandomSource())
    session = RoundSession(
        "audit", "audit", plan, counts, sampler, _transport(grads), "{}", 1, REPLY_PER_TASK, 1e-4,
        False, 0.0, fake_ledger(1e12, 1e-12), noise,
    )  # fmt: skip
    out = _Released(plan.normaliser)
    for index in range(trials):
        run_round(session, out, index)  # type: ignore[arg-type]
    return np.asarray(out.values)


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
) -> float:
    """The lower bound for ``pair`` under the real path (or a control's noise source)."""
    make = (noise or NoiseSource).create
    d = released(event, pair.with_target, trials, make())
    d_prime = released(event, pair.without_target, trials, make())
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

    with _patch(validation_mod, "clip_by_global_norm", trusting):
        yield


@contextlib.contextmanager
def divided_by_realised_count() -> Iterator[None]:
    """Control: the noisy sum divided by the number of tasks received (Opacus issue #571)."""
    real = round_mod._aggregate

    def by_count(session: RoundSession, checked: Any) -> Any:
        update, std = real(session, checked)
        received = sum(a.n_tasks for a in checked.accepted)
        return update * session.plan.normaliser / max(received, 1), std

    with _patch(round_mod, "_aggregate", by_count):
        yield


@contextlib.contextmanager
def _patch(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
