"""How a round's accepted replies become its release: a strategy chosen once, when the run starts.

A run is private exactly when its plan holds a :class:`~fedmeta.server.plan.PrivatePlan`
(server/fedmeta/server/plan.py), and :func:`choose_release` turns that into one of two
strategies for the whole run:

- :class:`PrivateStrategy`: each round first checks the run's own budget (what its own rounds
  afford: the individual filter, server/fedmeta/server/individual_filter.py); after
  the replies are re-checked it **spends** the round (``ledger.spend``, durable), and only then
  sums the accepted contributions, adds ``N(0, (zC)^2 I)`` (server/fedmeta/server/noise.py) and
  divides by the public normaliser. With adaptive clipping the noisy centred count of clip bits
  is released beside the sum, and the next bound ``C_{t+1}`` is computed from it alone.
  At sample level (server/fedmeta/server/sample_plan.py) the event is a ``SampleLevelRound``,
  the replies carry one row per query example, and the noise is ``N(0, (z_out C_out)^2 I)``.
- :class:`MeanStrategy` (non-private): no budget, no clip, no noise; the mean over the tasks
  received.

Each round asks the strategy for its :class:`RoundRelease` over the round's population
(``for_round``): the private one carries the round's event, clip and noise source, all set, so
the round (server/fedmeta/server/round.py) has no privacy Optional to check. The strategy also
answers the run's epsilons (``epsilons``): the ledger's, with the task-level value computed ahead
of the rounds where the ledger can say what it composes (server/fedmeta/server/epsilon_curve.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from fedmeta.accounting import (
    BudgetExhausted,
    Exposures,
    GaussianRound,
    Ledger,
    SpendProjection,
    next_clip,
    noisy_fraction,
)
from fedmeta.accounting.ledger import multiset
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.server.epsilon_curve import RoundEpsilons
from fedmeta.server.noise import NoiseSource, noised_release, noised_sum
from fedmeta.server.plan import PrivatePlan, RunPlan, TwoStageScheme, run_epsilons
from fedmeta.server.sample_plan import outer_gaussian
from fedmeta.server.subspace import Subspace
from fedmeta.server.validation import RoundReplies


@dataclass(frozen=True)
class Released:
    """A round's release: the update the optimizer takes and what the round's record says."""

    update: Tensor  # the noisy sum over the public normaliser, or the plain mean
    noise_std: float | None = None  # None: a non-private round
    position: int | None = None  # the round's spend in the ledger (None: non-private)
    noise_variance: float | None = None  # adaptive clipping: the optimizer's correction now
    next_clip: float | None = None  # adaptive clipping: C_{t+1}, from the released count alone


class RoundRelease(Protocol):
    """One round's release rule: what it asks of participants and how it releases their sum."""

    @property
    def private(self) -> bool:
        """Whether the round is private (its outputs then follow docs/privacy.md)."""
        ...

    @property
    def clip(self) -> float | None:
        """The bound sent to participants and re-checked (None: no clipping)."""
        ...

    @property
    def clip_bits(self) -> bool:
        """Whether replies carry clip bits (adaptive clipping)."""
        ...

    @property
    def example_rows(self) -> bool:
        """Whether replies carry a row per query example (sample level), not per task."""
        ...

    def affordable(self) -> bool:
        """Whether the budget allows the round (checked before anything is sent)."""
        ...

    def release(self, checked: RoundReplies, index: int) -> Released | None:
        """Spend (if private), then sum and release; None if the budget ran out meanwhile."""
        ...


class ReleaseStrategy(Protocol):
    """The run's release rule, fixed at start-up: a :class:`RoundRelease` per round."""

    def for_round(
        self, scheme: TwoStageScheme, index: int, clip: float | None, basis: Subspace | None = None
    ) -> RoundRelease:
        """Round ``index``'s release over ``scheme`` (``clip``: adaptive clipping's ``C_t``).

        ``basis``: ``privacy.subspace``'s public subspace for the round (server/subspace.py), the
        release then made in its ``k`` coordinates; None: the full space.
        """
        ...

    def epsilons(self) -> dict[str, Any]:
        """The run's epsilons now, as its records report them (empty: a non-private run)."""
        ...

    def close(self) -> None:
        """Stop what the strategy started (the epsilon curve's thread)."""
        ...


def _identity(values: Tensor) -> Tensor:
    return values


def summed(checked: RoundReplies, dim: int) -> Tensor:
    """The sum of the accepted contributions (float64; zeros when none was accepted)."""
    total = torch.zeros(dim, dtype=torch.float64)
    for accepted in checked.accepted:
        total += accepted.grad_sum
    return total


def centred_count(checked: RoundReplies) -> float:
    """``sum_i (b_i - 1/2)`` over the accepted tasks: sensitivity 1/2 under add/remove.

    Centring is what makes the count's sensitivity half the clip's share
    (accounting/fedmeta/accounting/adaptive.py);
    a dropped reply or task contributes 0 to both the count and the sum.
    """
    return float(sum(a.under_clip - a.n_tasks / 2 for a in checked.accepted))


# ------------------------------------------------------------------------------- non-private


@dataclass(frozen=True)
class MeanRound:
    """A non-private round: no budget, no clip, the mean over the tasks received."""

    dim: int
    basis: Subspace | None = None  # the mean confined to a public subspace (an ablation)
    private: bool = False
    clip: float | None = None
    clip_bits: bool = False
    example_rows: bool = False

    def affordable(self) -> bool:
        """Always: a non-private round spends nothing."""
        return True

    def release(self, checked: RoundReplies, index: int) -> Released:
        """The plain mean over the tasks received (within the subspace, if one is given)."""
        mean = summed(checked, self.dim) / max(sum(a.n_tasks for a in checked.accepted), 1)
        return Released(mean if self.basis is None else self.basis.restrict(mean))


@dataclass(frozen=True)
class MeanStrategy:
    """A non-private run's release: the mean, every round."""

    dim: int

    def for_round(
        self, scheme: TwoStageScheme, index: int, clip: float | None, basis: Subspace | None = None
    ) -> MeanRound:
        """The same mean every round."""
        return MeanRound(self.dim, basis)

    def epsilons(self) -> dict[str, Any]:
        """None to report: a non-private run has no guarantee."""
        return {}

    def close(self) -> None:
        """Nothing to stop."""


# ----------------------------------------------------------------------------------- private


@dataclass(frozen=True)
class PrivateRound:
    """A private round: its event (over the round's population), bound, ledger and noise."""

    plan: PrivatePlan
    clip: float
    ledger: Ledger
    noise: NoiseSource
    run_id: str
    dim: int
    normaliser: float
    basis: Subspace | None = None  # released in a public subspace's k coordinates
    private: bool = True

    @property
    def clip_bits(self) -> bool:
        """Whether replies carry clip bits: with adaptive clipping."""
        return self.plan.adaptive is not None

    @property
    def example_rows(self) -> bool:
        """Whether replies carry one row per query example: at sample level (server/sample_plan)."""
        return isinstance(self.plan.event, SampleLevelRound)

    def affordable(self) -> bool:
        """Whether the run's own rounds afford this round's event (public: the individual filter).

        Never the ledger's check over the participants' earlier spends: who of them may take part
        is the individual filter's (server/fedmeta/server/individual_filter.py).
        """
        return self.ledger.run_rounds_affordable(self.run_id, self.plan.event) >= 1

    def release(self, checked: RoundReplies, index: int) -> Released | None:
        """Spend first, durably; only then sum and add the noise (nothing released otherwise)."""
        try:
            self.ledger.spend(self.plan.event, self.run_id, index)
        except BudgetExhausted:
            # The filter's decisions make this the last safety only (docs/privacy.md, "Overlap
            # and the individual filter": a concurrent run on the same data): nothing released.
            return None
        position = self.ledger.position()
        total, norm, a = summed(checked, self.dim), self.normaliser, self.plan.adaptive
        sensitivity, basis = self.clip, self.basis
        if basis is not None:  # k coordinates, noised at their sensitivity; residual dropped
            total, sensitivity = basis.project(total, self.clip, norm * self.clip)
        lift: Callable[[Tensor], Tensor] = _identity if basis is None else basis.lift
        event = self.plan.event  # sample level: the outer Gaussian of the recorded round
        gauss = outer_gaussian(event) if isinstance(event, SampleLevelRound) else event
        if a is None:
            plain = noised_sum(total, clip=sensitivity, event=gauss, source=self.noise)
            return Released(lift(plain.value) / norm, plain.noise_std, position)
        joint = noised_release(total, centred_count(checked), clip=sensitivity,
                               event=gauss, count_noise=a.count_noise,
                               source=self.noise)  # fmt: skip
        # C_{t+1} from the released noisy count and public constants only (post-processing).
        fraction = noisy_fraction(joint.count, norm)
        following = next_clip(self.clip, fraction, a.target_quantile, a.learning_rate,
                              (a.min_clip, a.max_clip))  # fmt: skip
        # The optimizer's noise correction follows the round's C (DP-AdamBC's Phi).
        return Released(lift(joint.value) / norm, joint.noise_std, position,
                        (joint.noise_std / norm) ** 2, following)  # fmt: skip


@dataclass(frozen=True)
class PrivateStrategy:
    """A private run's release, and the epsilons its records report.

    ``noise(index)`` is round ``index``'s noise source: the run's one CSPRNG source, or in the
    reproducible test mode one re-derived from (seed, round), so that resumes reproduce.
    """

    plan: PrivatePlan
    ledger: Ledger
    run_id: str
    dim: int
    normaliser: float
    noise: Callable[[int], NoiseSource]
    curve: RoundEpsilons | None = field(default=None, compare=False)
    planned_rounds: int | None = None  # the published rounds affordable stay within the plan

    def for_round(
        self, scheme: TwoStageScheme, index: int, clip: float | None, basis: Subspace | None = None
    ) -> PrivateRound:
        """The round's release; the curve starts computing the epsilons its spend will bring."""
        plan = self.plan.over(scheme)
        # The curve composes task-level rounds ahead (a sample-level round's epsilon is composed
        # in the round: docs/privacy.md, "Running at sample level").
        if (self.curve is not None and isinstance(plan.event, GaussianRound)
                and self.ledger.projection(plan.event) is not None):
            own = self._own_exposures()  # the run's own rounds: one group, every spend reaches it
            self.curve.before_round(SpendProjection(own, plan.event, (True,)), index + 1)
        bound = self.plan.clip if plan.adaptive is None or clip is None else float(clip)
        return PrivateRound(plan, bound, self.ledger, self.noise(index), self.run_id, self.dim,
                            self.normaliser, basis)  # fmt: skip

    def _own_exposures(self) -> Exposures:
        """The run's own recorded rounds as one group: what ``ledger.run_epsilon`` composes."""
        own = multiset(Counter(dict(self.ledger.run_rounds(self.run_id))))
        return Exposures((own,), self.ledger.delta, "task")

    def epsilons(self) -> dict[str, Any]:
        """The run's own epsilons now (individual_filter.py); task level from the curve if it can.

        The curve's value is ``Exposures.epsilon`` of the run's own rounds read here, the value
        ``ledger.run_epsilon`` would compute; the ledger computes it itself where it has no
        exposures (a test's fake ledger) or if the curve's composition failed. Never the ledger's
        maximum over participants: that follows their private overlap with recorded data.
        """
        task = None
        if self.curve is not None and self.ledger.exposures(unit="task") is not None:
            task = self.curve.after_spend(self._own_exposures())
        event, rounds = self.plan.event, self.planned_rounds
        if task is None:
            return run_epsilons(self.ledger, self.run_id, event, rounds)
        return {**run_epsilons(self.ledger, self.run_id, event, rounds, task=False),
                "epsilon_task": task}  # fmt: skip

    def close(self) -> None:
        """Stop the epsilon curve's thread."""
        if self.curve is not None:
            self.curve.close()


@dataclass(frozen=True)
class ReleasedRun:
    """What a release needs of its run: the run id, the released dimension, the normaliser."""

    run_id: str
    dim: int
    normaliser: float


def choose_release(
    plan: RunPlan,
    ledger: Ledger | None,
    run: ReleasedRun,
    seed: int | None,
    reports: Callable[[int], bool],
) -> ReleaseStrategy:
    """The run's release, chosen once from its plan: private exactly when the plan is.

    A private plan without a ledger is refused rather than released without noise.
    """
    if plan.privacy is None:
        return MeanStrategy(run.dim)
    if ledger is None:
        raise ValueError("a private run needs the ledger of its data's budget; none was opened")
    strategy = private_strategy(plan.privacy, ledger, run, seed, reports)
    return replace(strategy, planned_rounds=plan.planned_rounds)


def private_strategy(
    plan: PrivatePlan,
    ledger: Ledger,
    run: ReleasedRun,
    seed: int | None,
    reports: Callable[[int], bool],
) -> PrivateStrategy:
    """A private run's strategy for ``run``.

    ``seed`` (``privacy.insecure_test_seed``): every round's noise from (seed, round); None: one
    CSPRNG source for the whole run. ``reports(round)``: whether that round's record has epsilon.
    """
    noise = _noise(seed)
    # Sample level: the ledger composes each epsilon itself (no curve computed ahead).
    curve = None if isinstance(plan.event, SampleLevelRound) else RoundEpsilons(reports)
    return PrivateStrategy(plan, ledger, run.run_id, run.dim, run.normaliser, noise, curve)


def _noise(seed: int | None) -> Callable[[int], NoiseSource]:
    """Round ``index``'s noise source: the one CSPRNG source, or the test mode's per round."""
    if seed is None:
        source = NoiseSource.create()
        return lambda index: source
    return lambda index: NoiseSource.insecure_for_tests(seed, index)
