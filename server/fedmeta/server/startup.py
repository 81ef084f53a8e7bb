"""Starting a run: the checkpoint to resume, who registered, the data's budget, the first state.

What :func:`fedmeta.server.run.run_federation` does before its first round, each step a function
that refuses with one line (what is wrong, what to do) before anything is written: the output
directory's checkpoint (:func:`refuse_to_overwrite_run`), registration (:func:`register`), the
ledger of the data's budget (:func:`open_budget`, on resume the one the run recorded), a budget
that affords the run (:func:`check_target_fits`), and the model, rounds and next round to start
from (:func:`initial_state`, by the resume rule in server/fedmeta/server/run.py's docstring).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmeta.accounting import BudgetLedger, Ledger, LedgerCheckpoint, LedgerMode
from fedmeta.accounting.ledger import EpsilonCache, ensure_directory
from fedmeta.accounting.sample_level import SampleLevelRound
from fedmeta.checkpoint import CHECKPOINT_NAME, Checkpoint, KeptModel, load_checkpoint
from fedmeta.client_config import ClientSampleLevel, client_config
from fedmeta.config import Config
from fedmeta.config_training import TrainingConfig
from fedmeta.paths import epsilon_cache_path
from fedmeta.protocol import GradientRequest, RegisterRequest
from fedmeta.server.budget_keys import budget_key, federation_of, ledger_participants
from fedmeta.server.data_budget import (
    BudgetMismatch,
    adopt_data_budget,
    ledger_file,
    no_fit_reason,
    other_budget_hint,
)
from fedmeta.server.ledger_witness import refuse_second_ledger, watch_ledger
from fedmeta.server.membership import SUSPENDING_FAILURES, Membership, MembershipRules
from fedmeta.server.plan import (
    BudgetForecast,
    PrivatePlan,
    RunPlan,
    build_plan,
    forecast,
    private_requested,
    reported_epsilon,
)
from fedmeta.server.releases import suspending_failures
from fedmeta.server.report import STATUS_LOST_ON_RESUME, RoundOutcome
from fedmeta.server.round import Exchange, RoundContext, TrainingState
from fedmeta.server.sample_plan import client_sample
from fedmeta.server.selection import ModelSelection
from fedmeta.server.transport import GridTransport, Registered, RegistrationError
from fedmeta.workload import Workload

log = logging.getLogger("fedmeta.server")

#: Opens the budget a private run spends from (default :func:`open_budget`; tests pass a fake).
LedgerOpener = Callable[[Config, Sequence[Registered]], Ledger]


class FederationError(RuntimeError):
    """The federation cannot start or go on; the message says why and what to do."""


class PlanError(ValueError):
    """The privacy plan cannot be made from this configuration (a one-line reason)."""


class NoRoundAffordable(RuntimeError):
    """A fresh private run whose budget affords no round: refused before anything is written."""


def refuse_to_overwrite_run(out_dir: Path, resume: bool) -> Checkpoint | None:
    """The checkpoint to resume from (or None for a fresh run), refusing what would lose a run."""
    existing = Path(out_dir) / CHECKPOINT_NAME
    if not resume and existing.is_file():
        raise FederationError(
            f"{out_dir} already holds a run's checkpoint ({existing.name}); continue that run with "
            "--resume, or give a new output directory with --out"
        )
    if resume and not existing.is_file():
        raise FederationError(
            f"--resume: no checkpoint in {out_dir}; start a new run without --resume, or point "
            "--out at the run to continue"
        )
    return load_checkpoint(Path(out_dir)) if resume else None


def open_budget(cfg: Config, registered: Sequence[Registered]) -> BudgetLedger:
    """The current budget of this data in the ledger (created on first use), per participant.

    The federation id is an HMAC of the data set's declared identity under the ledger's secret
    salt (``accounting.resolve_federation``); each participant is charged under its own stable key
    (server/fedmeta/server/budget_keys.py). A test-mode run needs an insecure ledger; the ledger
    refuses the other
    mode.
    """
    mode: LedgerMode = "secure" if cfg.privacy.insecure_test_seed is None else "insecure"
    path = ledger_file(cfg)
    key = budget_key(cfg.dataset.name, cfg.seed)
    # One ledger per data (issue 39), checked before creating.
    refuse_second_ledger(cfg.privacy, key, path, registered)
    ensure_directory(path)  # one line naming the path if read-only or full (issue 21)
    federation = federation_of(path, key, mode)
    members = {r.participant_id: r for r in registered}
    ledger = BudgetLedger.open(
        path, federation, epsilon_budget=cfg.privacy.epsilon_budget, delta=cfg.privacy.delta,
        neighbouring=cfg.privacy.neighbouring, mode=mode,
    )  # fmt: skip
    # Keep what the run composes for `fedmeta ledger show` (issue 54: a show after a run reads
    # it instead of composing again); never read here: the run's checks compose from the records.
    ledger.keep_epsilons(EpsilonCache(epsilon_cache_path(), read=False))
    try:
        # Refused if behind its witness outside the state directory.
        watch_ledger(ledger, cfg.privacy)
        ledger.use_cohort(ledger_participants(key, members, members))
    except BaseException:
        ledger.close()
        raise
    return ledger


def run_spends(ledger: Ledger, run_id: str) -> list[int]:
    """Round indices this run has spent, from the ledger (the source of truth)."""
    return sorted(r.round_index for r in ledger.records() if r.run_id == run_id)


def model_selection(cfg: Config, workload: Workload, kept: KeptModel | None) -> ModelSelection:
    """The run's model selection (server/fedmeta/server/selection.py); ``kept``: a resume's."""
    rule = cfg.training.model_selection
    if rule == "best_validation" and workload.validation_is_test:
        raise FederationError(
            f"training.model_selection = 'best_validation' needs validation classes apart from the "
            f"test classes, and dataset.split = {cfg.dataset.split!r} has none: choosing on test "
            "classes would bias the test result; use a split with validation classes "
            "('evaluation' or 'dpmaml') or training.model_selection = 'last'"
        )
    selection = ModelSelection(rule, workload.higher_is_better)
    selection.restore(kept)
    return selection


def with_recorded_ledger(cfg: Config, recorded: LedgerCheckpoint | None, *, check: bool) -> Config:
    """The configuration to open the ledger with: on resume, the ledger the run recorded.

    A run records its ledger's absolute path before its first spend; resuming from another
    directory with a relative ``privacy.ledger_path`` would otherwise open (and create) another
    file. A recorded ledger that is gone is refused before anything is created.
    """
    path = None if recorded is None else recorded.path
    if not path:
        return cfg
    if check and not Path(path).is_file():
        raise FederationError(
            f"the run spent from the ledger {path} (recorded in its checkpoint), which is missing; "
            "restore that file there (a `fedmeta ledger backup` copy is a complete one) and "
            "resume again"
        )
    privacy = cfg.privacy.model_copy(update={"ledger_path": str(path)})
    return cfg.model_copy(update={"privacy": privacy})


def check_target_fits(
    cfg: Config, plan: PrivatePlan, ledger: Ledger, predicted: BudgetForecast
) -> None:
    """Refuse, before any round, a run whose own rounds the budget affords none of, or too few.

    Public: ``predicted`` is the mechanism's own (plan.py ``forecast``), never what the
    participants' data spent before (the individual filter decides who takes part,
    server/fedmeta/server/individual_filter.py). A run with ``privacy.target_epsilon`` asks for all
    its rounds: it starts only if they fit the budget. Without one it runs what its rounds afford.
    """
    if not predicted.rounds_to_run:
        raise NoRoundAffordable(_no_round_reason(cfg, plan, ledger))
    if cfg.privacy.target_epsilon is not None and predicted.rounds_to_run < cfg.rounds:
        raise NoRoundAffordable(no_fit_reason(cfg, plan, ledger, predicted))


def _no_round_reason(cfg: Config, plan: PrivatePlan, ledger: Ledger) -> str:
    """One line: why the budget affords no round, and what to change (public values only)."""
    one = reported_epsilon([(plan.event, 1)], plan.delta) or 0.0
    return (
        f"the budget affords no round: one round at noise multiplier "
        f"{plan.noise_multiplier:g} costs epsilon {one:.4g} at delta {plan.delta:g}, "
        f"over the data's budget {ledger.epsilon_budget:g} (in {ledger.path}); "
        "raise privacy.noise_multiplier (or set a smaller privacy.target_epsilon), or "
        + other_budget_hint(cfg, ledger.path, ledger.federation_id)
        + "; nothing was run or written"
    )


def register(cfg: Config, transport: GridTransport, run_id: str) -> Membership:
    """The run's membership once enough participants registered (fedmeta.server.membership)."""
    request = RegisterRequest(run_id, client_config(cfg).model_dump_json())  # a participant's part
    rules = MembershipRules.of(cfg)
    membership = Membership(rules, transport, request)
    membership.start()
    if len(membership.members) < rules.want:
        refused = f" (refused: {membership.refused})" if membership.refused else ""
        raise RegistrationError(
            f"{len(membership.members)} participants registered within "
            f"federation.register_timeout_s={cfg.federation.register_timeout_s:g}; the run needs "
            f">= {rules.want} (federation.min_participants){refused}"
        )
    return membership


@dataclass(frozen=True)
class RunIds:
    """A run's id and its budget's federation id (``non-private`` without a ledger)."""

    run_id: str
    federation_id: str


def round_context(
    cfg: Config,
    ids: RunIds,
    plan: RunPlan,
    membership: Membership,
    dim: int,
    stop: threading.Event,
) -> RoundContext:
    """What every round shares: the run's ids, the exchange, ``stop``; private as the plan is.

    ``stop`` is the run's one stop request: the round reads it before its spend, and the exchange
    hands it to the transport, whose wait for replies ends at once when it is set. Suspension
    counts the failures a private run may count (server/fedmeta/server/releases.py).
    """
    if cfg.privacy.insecure_test_seed is not None:
        log.warning("INSECURE: noise and sampling use insecure_test_seed (tests only, not private)")

    suspending = suspending_failures(plan.private, SUSPENDING_FAILURES)

    def exchange(requests: Mapping[str, GradientRequest]) -> Exchange:
        result = membership.transport.exchange(requests, membership.nodes(), stop=stop)
        failed = {pid: d.failure for pid, d in result.deliveries.items() if d.failure}
        membership.record(requests, failed, suspending)
        return result

    return RoundContext(
        run_id=ids.run_id,
        federation_id=ids.federation_id,
        transport=exchange,
        config_json=client_config(cfg, participant_part(cfg, plan)).model_dump_json(),
        dim=dim,
        reply_format=cfg.federation.reply_format,
        tolerance=cfg.privacy.clip_tolerance,
        diagnostics=not plan.private or cfg.metrics.private_diagnostics,
        round_min_seconds=cfg.federation.round_min_seconds,
        stop=stop,
    )


def participant_part(cfg: Config, plan: RunPlan) -> ClientSampleLevel | None:
    """A sample-level run's part for its participants (server/sample_plan.py); else None."""
    event = None if plan.privacy is None else plan.privacy.event
    return client_sample(cfg, event) if isinstance(event, SampleLevelRound) else None


def _optimizer_args(cfg: Config, plan: RunPlan, workload: Workload) -> dict[str, Any]:
    """The meta-optimizer's settings: the noise variance Phi it may correct for is public."""
    p = plan.privacy
    phi = 0.0 if p is None else (p.gradient_noise_multiplier * p.clip / plan.normaliser) ** 2
    return {"training": cfg.training, "noise_variance": phi, "planned_rounds": cfg.rounds,
            "clip": p.clip if p is not None and p.adaptive is not None else None,
            "coordinates": workload.trained_coordinates}  # fmt: skip


def initial_state(
    cfg: Config,
    plan: RunPlan,
    ckpt: Checkpoint | None,
    ledger: Ledger | None,
    run_id: str,
    workload: Workload,
) -> tuple[TrainingState, list[RoundOutcome], int]:
    """The model, the rounds so far and the next round: fresh, or resumed by the resume rule."""
    if ckpt is None:
        fresh = TrainingState(workload.initial_params(), **_optimizer_args(cfg, plan, workload))
        return fresh, [], 0
    _check_same_subset(ckpt.config.training, cfg.training)
    state = TrainingState(ckpt.params, **_optimizer_args(cfg, plan, workload),
                          optimizer_state=dict(ckpt.optimizer))  # fmt: skip
    adaptive = None if plan.privacy is None else plan.privacy.adaptive
    if adaptive is not None and ckpt.clip is not None:
        state.clip = ckpt.clip  # adaptive clipping's bound for the next round
        state.set_noise_variance((adaptive.gradient_noise_multiplier * state.clip
                                  / plan.normaliser) ** 2)  # fmt: skip
    outcomes = [RoundOutcome.from_dict(o) for o in ckpt.outcomes]
    next_round = ckpt.next_round
    if ledger is None:
        return state, outcomes, next_round
    _check_ledger_binding(ckpt.ledger, ledger)
    lost = [i for i in run_spends(ledger, run_id) if i >= next_round]
    if lost:
        log.warning("resume: rounds %s were spent but their update was not checkpointed; they "
                    "count as spent and are not run again", [i + 1 for i in lost])  # fmt: skip
        outcomes += [
            RoundOutcome(run_id, ledger.federation_id, i + 1, STATUS_LOST_ON_RESUME) for i in lost
        ]
        next_round = max(lost) + 1
    return state, outcomes, next_round


def _check_same_subset(recorded: TrainingConfig, given: TrainingConfig) -> None:
    """Refuse to resume with other trained parameters: the optimizer's state is for the old ones."""
    saved = recorded.trained_parameters
    if saved != given.trained_parameters:
        raise FederationError(
            f"the checkpoint trained training.trained_parameters = {saved!r}, this configuration "
            f"says {given.trained_parameters!r}: resume with {saved!r}, or start a new run "
            "with --out"
        )


def _check_ledger_binding(saved: LedgerCheckpoint | None, ledger: Ledger) -> None:
    """Refuse a ledger that is not the one the run spent from, or that lost records since.

    The run recorded the ledger's identity, path, position and last record before its first spend
    and in every checkpoint; a resume that opened another, emptier or diverged ledger (a relative
    path from another directory, a restored backup, a copy without its journal) stops here.
    """
    if saved is None:
        raise FederationError("the checkpoint records no ledger: it is not a private run's")
    if Path(saved.path) != Path(ledger.path) and saved.ledger_id != ledger.ledger_id:
        raise FederationError(
            f"the run spent from the ledger {saved.path} but this resume opened {ledger.path}; "
            f"restore the run's ledger at {saved.path} and resume again"
        )
    ledger.check_resume(saved)


@dataclass(frozen=True)
class Budgeted:
    """A run's start-up answer: the configuration with its data's budget, the plan, the ledger.

    ``cfg`` is the caller's configuration with the data's recorded budget adopted
    (server/fedmeta/server/data_budget.py); from here on the plan, not ``cfg.privacy``, says
    whether the run is private (``plan.private``).
    """

    cfg: Config
    plan: RunPlan
    ledger: Ledger | None  # None: a non-private run


def plan_and_budget(
    given: Config, open_ledger: LedgerOpener | None, ckpt: Checkpoint | None,
    membership: Membership,
) -> Budgeted:  # fmt: skip
    """The configuration with the data's budget, the plan, and the ledger (opened if private)."""
    registered = list(membership.members.values())
    z = (ckpt.noise_multiplier or None) if ckpt else None  # a resumed run keeps its z
    binding = None if ckpt is None else ckpt.ledger
    recorded = open_ledger is None  # fedmeta's ledger, where the data's budget is recorded
    opened_with = with_recorded_ledger(given, binding, check=recorded)
    budgeted = given
    if recorded and private_requested(given.privacy):  # the data's budget, not the run's config
        try:
            budgeted = adopt_data_budget(given, registered, ledger_file(opened_with))
        except BudgetMismatch as error:
            raise FederationError(str(error)) from None
        opened_with = with_recorded_ledger(budgeted, binding, check=False)
    try:
        plan = build_plan(budgeted, membership.eligible(), noise_multiplier=z)
    except ValueError as error:  # e.g. a target epsilon no noise multiplier in range reaches
        raise PlanError(f"cannot plan the private run: {error}") from None
    ledger = (open_ledger or open_budget)(opened_with, registered) if plan.private else None
    return Budgeted(budgeted, plan, ledger)


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands at start-up: its id and the next round (0-based) it runs."""

    run_id: str
    next_round: int


def forecast_run(
    cfg: Config, plan: RunPlan, ledger: Ledger | None, position: RunPosition, *, fresh: bool
) -> BudgetForecast | None:
    """What the rest of the run costs (None: non-private); a fresh run refused if nothing fits.

    The ledger's spends of this run count as done, as do the rounds before ``position``'s next;
    the forecast is the run's own (plan.py), whatever its participants' data spent before.
    """
    if plan.privacy is None or ledger is None:
        return None
    spent = len(run_spends(ledger, position.run_id))
    rounds_left = cfg.rounds - max(spent, position.next_round)
    predicted = forecast(plan.privacy, ledger, rounds_left, position.run_id)
    if fresh:
        check_target_fits(cfg, plan.privacy, ledger, predicted)
    return predicted
