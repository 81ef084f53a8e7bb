"""A run's privacy plan: the accounted sampling scheme, its event, the noise, and what it will cost.

:class:`RunPlan` is fixed once participants have registered and the noise multiplier is known. A run
is private exactly when its plan holds a :class:`PrivatePlan` (event, clip, budget, delta, adaptive
clipping: none of them optional); the run chooses its release strategy from that once
(server/fedmeta/server/release_strategy.py), so the sampler that runs and the event the ledger
records come from the same scheme object and no round asks whether it is private.
:class:`BudgetForecast` is what the plan will cost against the ledger, printed before the first
round.

Under the add/remove relation (the default) the participants' task counts are private: the trusted
server uses them to sample task indices and nothing else. The scheme's stage-2 bound
(``min_tasks`` for a fixed-size stage 2) and the normaliser of the noisy sum are public constants
of the configuration, and participants below the public ``min_tasks`` are refused at registration.
Under replace-one the counts are public, and the smallest registered count is the accounted bound.

With adaptive clipping (:class:`AdaptiveClipping`) the event's ``z`` is the *total* noise multiplier
of the round's two releases (the gradient sum and the noisy count of clip bits); the gradient gets
the smaller ``z_grad`` (accounting/fedmeta/accounting/adaptive.py), and ``PrivatePlan.clip`` is
the first round's bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fedmeta.accounting import (
    GaussianRound,
    Ledger,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    calibrate_noise_multiplier,
    epsilon,
    gradient_noise_multiplier,
    participant_level_note,
    tombs2022_published_epsilon,
)
from fedmeta.accounting.composition import Method
from fedmeta.accounting.levels import AnyRound
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.accounting.schemes import Neighbouring, Unit
from fedmeta.accounting.tuning_release import Recorded
from fedmeta.config import Config, ConfigError
from fedmeta.config_privacy import PrivacyConfig
from fedmeta.server.sample_plan import sample_event, sample_normaliser, sampling_of

TwoStageScheme = TwoStagePoissonScheme | TwoStageFixedScheme
#: Why a sample-level run has no participant-level epsilon (its unit is one example).
SAMPLE_LEVEL_NOTE = (
    "a sample-level run protects one example; it states no participant-level bound (an example "
    "neighbour is not a participant neighbour)"
)


def server_noise_multiplier(event: AnyRound) -> float:
    """The noise multiplier of what the server adds: ``z``, or a sample-level round's ``z_out``."""
    if isinstance(event, SampleLevelRound):
        return event.outer_noise_multiplier
    return event.noise_multiplier


@dataclass(frozen=True)
class AdaptiveClipping:
    """The public constants of adaptive clipping (Andrew et al. 2021), resolved for one run."""

    target_quantile: float
    learning_rate: float
    count_noise: float  # s_b, in tasks
    gradient_noise_multiplier: float  # z_grad = (z^-2 - (2 s_b)^-2)^(-1/2)
    initial_clip: float
    min_clip: float
    max_clip: float


@dataclass(frozen=True)
class PrivatePlan:
    """What makes a run private, all of it known before the first round (no field is optional).

    ``event`` is the accounted round over the plan's scheme; ``clip`` the fixed bound, or adaptive
    clipping's first one; ``epsilon_budget`` and ``delta`` the data's budget the ledger enforces.
    """

    event: AnyRound  # a SampleLevelRound at privacy.level = "sample" (server/sample_plan.py)
    clip: float
    epsilon_budget: float
    delta: float
    noise_calibrated: bool
    adaptive: AdaptiveClipping | None = None  # None: the clip bound is fixed

    @property
    def noise_multiplier(self) -> float:
        """``z``: the round's total noise multiplier (sample level: the server's ``z_out``)."""
        return server_noise_multiplier(self.event)

    @property
    def level(self) -> str:
        """``"sample"`` for a sample-level run, else ``"task"`` (summary.json's ``level``)."""
        return "sample" if isinstance(self.event, SampleLevelRound) else "task"

    @property
    def gradient_noise_multiplier(self) -> float:
        """The gradient's own noise multiplier: ``z``, or ``z_grad`` with adaptive clipping."""
        if self.adaptive is not None:
            return self.adaptive.gradient_noise_multiplier
        return self.noise_multiplier

    @property
    def participant_level_note(self) -> str | None:
        """Why the participant-level epsilon is not meaningful, or None when it is."""
        if isinstance(self.event, SampleLevelRound):
            return SAMPLE_LEVEL_NOTE
        return participant_level_note(self.event)

    def over(self, scheme: TwoStageScheme) -> PrivatePlan:
        """The same z, clip and budget, the event taken over ``scheme`` (a round's population)."""
        if isinstance(self.event, SampleLevelRound):
            assert isinstance(scheme, TwoStagePoissonScheme)  # config_sample refuses 'fixed'
            return replace(self, event=replace(self.event, sampling=sampling_of(scheme)))
        event = GaussianRound(scheme, self.noise_multiplier, _cap(scheme), self.event.neighbouring)
        return replace(self, event=event)


@dataclass(frozen=True)
class RunPlan:
    """A run's rounds, fixed before the first one: private exactly when ``privacy`` is set."""

    neighbouring: Neighbouring
    scheme: TwoStageScheme
    normaliser: float  # public divisor of the noisy sum
    planned_rounds: int
    privacy: PrivatePlan | None = None  # None: a non-private run (no clip, no noise, no ledger)

    @property
    def private(self) -> bool:
        """Whether the run is private (it has a :class:`PrivatePlan`)."""
        return self.privacy is not None

    @property
    def level(self) -> str | None:
        """What the guarantee protects, ``"task"`` or ``"sample"``; None: a non-private run."""
        return None if self.privacy is None else self.privacy.level

    def for_population(self, cfg: Config, task_counts: Mapping[str, int]) -> RunPlan:
        """The same plan (z, clip, normaliser) for the population eligible in a round."""
        scheme = build_scheme(cfg, task_counts)
        privacy = None if self.privacy is None else self.privacy.over(scheme)
        return replace(self, scheme=scheme, privacy=privacy)


def build_scheme(cfg: Config, task_counts: Mapping[str, int]) -> TwoStageScheme:
    """The two-stage scheme over the registered participants (their number is public)."""
    participants = len(task_counts)
    n1 = min(cfg.n1, participants)
    if cfg.privacy.level == "sample":  # stage 2: each example, at the participant
        return TwoStagePoissonScheme(participants, n1, cfg.privacy.sample.example_rate)
    if cfg.sampling.stage2 == "poisson":
        return TwoStagePoissonScheme(participants, n1, cfg.sampling.task_rate)
    assert cfg.sampling.tasks_per_round is not None  # the configuration requires it
    public = cfg.privacy.neighbouring == "replace_one"
    min_tasks = min(task_counts.values()) if public else cfg.min_tasks
    return TwoStageFixedScheme(participants, n1, cfg.sampling.tasks_per_round, min_tasks)


def _cap(scheme: TwoStageScheme) -> int | None:
    """The most tasks a participant sends per round: known only for a fixed-size stage 2."""
    return scheme.tasks_per_round if isinstance(scheme, TwoStageFixedScheme) else None


def normaliser(cfg: Config) -> float:
    """The public divisor: configured, or the expected lot computed from the configuration alone.

    Neither the registered population nor any task count enters it, so it stays one constant for
    the whole run, however the population changes. Sample level: server/sample_plan.py.
    """
    if cfg.privacy.level == "sample":
        return sample_normaliser(cfg)
    if cfg.privacy.normaliser is not None:
        return float(cfg.privacy.normaliser)
    n1 = cfg.n1
    if cfg.sampling.stage2 == "fixed":
        return float(n1 * (cfg.sampling.tasks_per_round or 1))
    return n1 * cfg.sampling.task_rate * cfg.dataset.tasks_per_participant


def private_requested(privacy: PrivacyConfig) -> bool:
    """Whether a plan built from this configuration is private: the plan's answer before it exists.

    Start-up asks it to decide whether to look up the data's budget before planning; once there
    is a plan, ``RunPlan.private`` is the one answer (no other server module reads the flag,
    ``tests/federation/test_private_answer.py``).
    """
    return privacy.enabled


def build_plan(
    cfg: Config, task_counts: Mapping[str, int], *, noise_multiplier: float | None = None
) -> RunPlan:
    """The plan for the registered participants; ``noise_multiplier`` keeps a resumed run's z."""
    scheme = build_scheme(cfg, task_counts)
    norm = normaliser(cfg)
    plan = RunPlan(cfg.privacy.neighbouring, scheme, norm, cfg.rounds)
    if not private_requested(cfg.privacy):
        return plan
    return replace(plan, privacy=_private_plan(cfg, scheme, norm, noise_multiplier))


def _private_plan(
    cfg: Config, scheme: TwoStageScheme, norm: float, resumed_z: float | None
) -> PrivatePlan:
    """The private part of the plan: z (resumed, configured or calibrated), clip and budget."""
    _check_target_within_budget(cfg.privacy)
    if cfg.privacy.level == "sample":  # the outer clip C_out is privacy.clip; no adaptive clip
        assert isinstance(scheme, TwoStagePoissonScheme)
        sample, calibrated = sample_event(cfg, scheme, resumed_z)
        plan = PrivatePlan(sample, cfg.privacy.clip, cfg.privacy.epsilon_budget,
                           cfg.privacy.delta, calibrated)  # fmt: skip
        if not calibrated and resumed_z is None:
            _check_noise_meets_target(cfg, sample)
        return plan
    calibrated = resumed_z is None and cfg.privacy.noise_multiplier is None
    noise_multiplier = resumed_z if resumed_z is not None else cfg.privacy.noise_multiplier
    if noise_multiplier is None:
        target = cfg.privacy.target_epsilon or cfg.privacy.epsilon_budget
        noise_multiplier = calibrate_noise_multiplier(
            scheme, cfg.rounds, float(target), cfg.privacy.delta,
            neighbouring=cfg.privacy.neighbouring,
        )  # fmt: skip
    event = GaussianRound(scheme, float(noise_multiplier), _cap(scheme), cfg.privacy.neighbouring)
    if not calibrated and resumed_z is None:
        _check_noise_meets_target(cfg, event)
    adaptive = _adaptive(cfg, float(noise_multiplier), norm)
    return PrivatePlan(
        event=event,
        clip=cfg.privacy.clip if adaptive is None else adaptive.initial_clip,
        epsilon_budget=cfg.privacy.epsilon_budget,
        delta=cfg.privacy.delta,
        noise_calibrated=calibrated,
        adaptive=adaptive,
    )


#: Slack of the target check below: the planner and this check may discretise the PLD apart. It
#: is a consistency check of the configuration, not the guarantee (the ledger enforces the budget).
TARGET_CHECK_SLACK = 1e-2


def _check_target_within_budget(privacy: PrivacyConfig) -> None:
    """A run's target above the data's budget is a configuration error (public: no ledger read).

    No run is refused for what its participants' data spent before: the individual filter
    (server/fedmeta/server/individual_filter.py) lets each take part only as far as it can afford.
    """
    target = privacy.target_epsilon
    if target is not None and target > privacy.epsilon_budget:
        raise ConfigError(
            f"privacy.target_epsilon={target:g} is above the data's budget "
            f"privacy.epsilon_budget={privacy.epsilon_budget:g}: a run's own epsilon can never "
            "exceed its budget; lower privacy.target_epsilon (or leave it unset for the budget)"
        )


def _check_noise_meets_target(cfg: Config, event: AnyRound) -> None:
    """A run given both ``noise_multiplier`` and ``target_epsilon`` must not exceed its target."""
    target = cfg.privacy.target_epsilon
    if target is None:
        return
    own = reported_epsilon([(event, cfg.rounds)], cfg.privacy.delta) or 0.0
    if own > target * (1 + TARGET_CHECK_SLACK):  # a configuration error: one line, exit status 2
        z = server_noise_multiplier(event)
        raise ConfigError(
            f"privacy.noise_multiplier={z:g} over rounds={cfg.rounds} spends "
            f"epsilon {own:.4g} > privacy.target_epsilon={target:g}: leave "
            "privacy.noise_multiplier unset to calibrate it to the target, or lower rounds"
        )


def _adaptive(cfg: Config, z: float, expected_lot: float) -> AdaptiveClipping | None:
    """Adaptive clipping's constants, with the gradient's share of ``z`` (None when it is off)."""
    a = cfg.privacy.adaptive_clipping
    if not a.enabled:
        return None
    # Andrew et al.'s lot / 20 costs almost nothing at large lots; at small ones it would exceed the
    # whole round's noise (2 s_b <= z), so the default never goes below z: at most 15% more
    # gradient noise (z_grad = z / sqrt(3/4)), and a default configuration always starts.
    count_noise = a.count_noise if a.count_noise is not None else max(expected_lot / 20.0, z)
    try:
        z_grad = gradient_noise_multiplier(z, count_noise)
    except ValueError:  # only a configured count_noise can be too small (the default is >= z)
        raise ValueError(
            f"privacy.adaptive_clipping.count_noise must be > z / 2 = {z / 2:g} (z = the total "
            f"noise multiplier); got {count_noise:g}: raise it, or lower z"
        ) from None
    initial = a.initial_clip if a.initial_clip is not None else cfg.privacy.clip
    return AdaptiveClipping(a.target_quantile, a.learning_rate, count_noise, z_grad, initial,
                            a.min_clip, a.max_clip)  # fmt: skip


# ------------------------------------------------------------------------------------- the cost


#: Which accountant reports which unit. Task level: PLD, the enforced value. Participant level:
#: RDP, an upper bound on the PLD value that costs milliseconds where a PLD grid at the
#: participant-level sensitivity (up to hundreds of C) needs gigabytes; reported, never enforced.
REPORTING_METHOD: dict[Unit, Method] = {"task": "pld", "participant": "rdp"}


def reported_epsilon(
    groups: Sequence[tuple[Recorded, int]], delta: float, unit: Unit = "task"
) -> float | None:
    """Epsilon of ``groups`` as fedmeta reports it; None where the unit has no meaningful bound."""
    groups = [(e, int(n)) for e, n in groups if n > 0]
    if not groups:
        return 0.0
    if unit == "participant" and any(e.participant_cap is None for e, _ in groups):
        return None
    return float(epsilon(groups, delta, unit, REPORTING_METHOD[unit]))


def run_epsilons(
    ledger: Ledger, run_id: str, event: AnyRound, planned_rounds: int | None,
    *, task: bool = True,
) -> dict[str, float | int | None]:  # fmt: skip
    """The run's own epsilons and rounds left: what a participant with no earlier spend has.

    The individual filter's published figures (server/fedmeta/server/individual_filter.py).
    ``task=False`` leaves out the task-level epsilon (a PLD composition, computed ahead by
    server/fedmeta/server/epsilon_curve.py). Participant level: RDP, where every round of the run
    has a cap. Rounds affordable: what the run's own composition still allows, at most its planned
    rounds left. Functions of the configuration and the population of each round only.
    """
    own = ledger.run_rounds(run_id)
    participant = None
    if all(e.participant_cap is not None for e, _ in own):
        participant = ledger.run_epsilon(run_id, "participant", REPORTING_METHOD["participant"])
    left = ledger.run_rounds_affordable(run_id, event)
    if planned_rounds is not None:
        left = max(0, min(left, planned_rounds - sum(c for _, c in own)))
    values: dict[str, float | int | None] = {
        "epsilon_participant": participant,
        "rounds_affordable": left,
    }
    if task:
        values["epsilon_task"] = ledger.run_epsilon(run_id, "task", REPORTING_METHOD["task"])
    return values


@dataclass(frozen=True)
class BudgetForecast:
    """What the plan costs, before the run's (or this invocation's) first round.

    The mechanism's own (individual filter, server/fedmeta/server/individual_filter.py): the
    run's earlier spends (a resumed run's) and its plan, never the participants' earlier spends,
    which follow their private overlap with recorded data. ``ledger_records_before`` counts every
    spend of the budget, a public number.
    """

    ledger_records_before: int
    epsilon_spent_before: float
    rounds_affordable: int
    rounds_to_run: int
    epsilon_task_at_end: float
    epsilon_participant_at_end: float | None
    epsilon_theorem3_at_end: float | None  # Tombs et al. 2022 Thm 3: NOT a valid guarantee


def forecast(
    plan: PrivatePlan, ledger: Ledger, rounds_left: int, run_id: str = ""
) -> BudgetForecast:
    """The run's spends so far, what its own rounds afford, and epsilon if it goes to its end.

    ``run_id``: a resumed run's own spends count; empty: a fresh run (nothing of its own yet).
    """
    before = ledger.run_rounds(run_id) if run_id else []
    # What the run's own rounds afford, at most its rounds left (the rounds' records say the same):
    # so also the rounds it will run.
    to_run = max(0, min(ledger.run_rounds_affordable(run_id, plan.event), rounds_left))
    after = [*before, (plan.event, to_run)]
    published = (
        tombs2022_published_epsilon(plan.event, to_run, plan.delta)
        if to_run and isinstance(plan.event, GaussianRound)
        and plan.event.neighbouring == "add_remove"
        else None
    )
    return BudgetForecast(
        ledger_records_before=ledger.position(),
        epsilon_spent_before=reported_epsilon(before, plan.delta) or 0.0,
        rounds_affordable=to_run,
        rounds_to_run=to_run,
        epsilon_task_at_end=reported_epsilon(after, plan.delta) or 0.0,
        epsilon_participant_at_end=reported_epsilon(after, plan.delta, "participant"),
        epsilon_theorem3_at_end=published,
    )


def reports_epsilon(cfg: Config, r: int) -> bool:
    """Whether round ``r``'s record carries epsilon (``privacy.report_every``, default every round).

    Also round 1, the evaluated rounds (the validation-vs-epsilon plot) and the last.
    """
    every, evaluated = cfg.privacy.report_every, cfg.training.eval_every
    return r <= cfg.rounds and (r == 1 or r % every == 0 or r % evaluated == 0 or r == cfg.rounds)
