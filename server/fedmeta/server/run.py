"""A federation run: start or resume, register, plan, rounds, evaluation, checkpoints, summary.

``run_federation(cfg, transport, ...)`` is what every entry point runs (``fedmeta simulate``, the
Flower ServerApp, tests). Flower stays behind the transport (server/fedmeta/server/transport.py);
one round is ``server.round.run_round``; this module strings rounds together.

**Once, then per round.** Start-up (server/fedmeta/server/startup.py) builds a frozen
:class:`RunContext`: the configuration, the plan, the ledger, the release strategy chosen from the
plan (server/fedmeta/server/release_strategy.py) and the :class:`~fedmeta.server.round.RoundContext`
every round shares, with the run's one ``stop`` event. Before each round the run builds its
:class:`~fedmeta.server.round.RoundSetup` (the population eligible now, the sampler over its scheme,
the strategy's release for it); what the rounds change (the model, the records, the next round)
is the run's progress, :class:`_Run`.

**The budget belongs to the data.** A private run spends from the ledger in fedmeta's state
directory (or ``privacy.ledger_path``), in the federation of its data's identity
(core/fedmeta/workload.py): runs over the same data compose, whatever their seed or output
directory. Runs in the reproducible test mode (``privacy.insecure_test_seed``) use another ledger.

**Resume** (the ledger is the source of truth for spends): a round whose spend is in the ledger is
spent, whether or not its update reached a checkpoint. A resumed run continues from its checkpoint's
model; its next round is one past the larger of the checkpoint's last round and the ledger's last
spend for this run, so a round index is never spent twice, and rounds whose update was lost count
as completed (their privacy cost is paid) and are reported as lost. Neither the sampler's nor the
noise's randomness is ever checkpointed: a resumed private run draws fresh secrets. Adaptive
clipping's current bound is training state: it is checkpointed with the model and restored, so a
resumed run (in the reproducible test mode) goes on exactly as an uninterrupted one.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fedmeta.accounting import InsecureSeededSource, Ledger, SystemRandomSource
from fedmeta.checkpoint import Checkpoint, save_checkpoint
from fedmeta.config import Config
from fedmeta.server.data_budget import EvaluationDataPrivate, check_evaluation_data, ledger_file
from fedmeta.server.individual_filter import (
    IndividualFilter,
    end_of_run,
    round_cohort,
    start_filter,
)
from fedmeta.server.membership import Membership
from fedmeta.server.plan import BudgetForecast, RunPlan, private_requested, reports_epsilon
from fedmeta.server.release_strategy import ReleasedRun, ReleaseStrategy, choose_release
from fedmeta.server.report import Observers, RoundOutcome, RunFinished, RunObserver, RunStarted
from fedmeta.server.round import (
    STOP_BUDGET,
    STOP_PLANNED,
    RoundAbandoned,
    RoundContext,
    RoundSetup,
    TrainingState,
    run_round,
)
from fedmeta.server.rundir import exclusive_run_directory
from fedmeta.server.sample_plan import round_sampler
from fedmeta.server.selection import ModelSelection
from fedmeta.server.starting import StartingModel, source_of
from fedmeta.server.startup import (
    FederationError,
    LedgerOpener,
    RunIds,
    RunPosition,
    forecast_run,
    initial_state,
    model_selection,
    plan_and_budget,
    refuse_to_overwrite_run,
    register,
    round_context,
    run_spends,
)
from fedmeta.server.subspace import PublicSubspace, public_subspace
from fedmeta.server.transport import GridTransport, Registered
from fedmeta.workload import HeldOut, Workload, build_workload

log = logging.getLogger("fedmeta.server")

STOP_INTERRUPTED = "interrupted"
STOP_NO_PARTICIPANTS = "no_participants"


@dataclass
class RunResult:
    """What ``run_federation`` returns: the summary (``summary.json``) and every round's record."""

    summary: dict[str, Any]
    outcomes: list[RoundOutcome]
    out_dir: Path
    #: Whether the run's private diagnostics may be written: decided from its plan at start-up
    #: (``RoundContext.diagnostics``), never from the caller's configuration.
    diagnostics: bool
    rounds_run: int = 0  # by this invocation (a resumed run counts only its own)


@dataclass(frozen=True)
class RunOptions:
    """How ``run_federation`` was asked to run: its keyword arguments, resolved."""

    out: Path
    resume: bool
    observers: Sequence[RunObserver]
    open_ledger: LedgerOpener | None
    workload: Workload | None
    stop: threading.Event  # the run's one stop request (SIGINT/SIGTERM)
    test_when_interrupted: bool


@dataclass(frozen=True)
class RunContext:
    """What a run fixes at start-up and never changes, built once by :func:`_start`.

    ``release`` is the release strategy chosen from the plan (server/fedmeta/server/
    release_strategy.py); ``rounds`` what every round shares, the run's one ``stop`` included.
    """

    cfg: Config  # with the data's recorded budget
    out: Path
    plan: RunPlan
    registered: tuple[Registered, ...]
    membership: Membership  # who is connected changes; the object does not
    workload: Workload  # the server's model and held-out tasks
    observers: Observers
    forecast: BudgetForecast | None  # None: a non-private run
    ledger: Ledger | None  # None: a non-private run (the ledger is not touched)
    release: ReleaseStrategy
    rounds: RoundContext
    test_when_interrupted: bool  # False: an interrupted run ends without its test tasks
    resumed: bool  # from a checkpoint (the test's seen items then count this session's members)
    #: ``privacy.subspace``: rounds noised in a subspace of public gradients (server/subspace.py)
    subspace: PublicSubspace | None
    individual: IndividualFilter | None  # who takes part in which round (individual_filter.py)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def run_id(self) -> str:
        """The run's id (kept across resumes)."""
        return self.rounds.run_id

    @property
    def federation_id(self) -> str:
        """The budget's federation id in the ledger (``non-private`` without one)."""
        return self.rounds.federation_id


@dataclass
class _Run:
    """A run in progress: its fixed context and what its rounds change."""

    context: RunContext
    state: TrainingState
    outcomes: list[RoundOutcome]
    next_round: int
    selection: ModelSelection
    starting: StartingModel | None = None  # round 0 (server/fedmeta/server/starting.py)
    refused_since_last: dict[str, int] = field(default_factory=dict)
    refused_reported: dict[str, int] = field(default_factory=dict)  # in earlier rounds' records


def run_federation(
    cfg: Config,
    transport: GridTransport,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    observers: Iterable[RunObserver] = (),
    announce: Callable[[str], None] = lambda text: log.info("%s", text),
    open_ledger: LedgerOpener | None = None,
    stop: threading.Event | None = None,
    workload: Workload | None = None,
    test_when_interrupted: bool = True,
) -> RunResult:
    """Run the federation to ``planned_rounds``, ``budget_exhausted`` or ``interrupted``.

    ``open_ledger(cfg, registered)`` opens the budget (default :func:`open_budget`). Setting
    ``stop`` ends the run within the round in progress (abandoned if not yet spent, finished if
    spent), with a final checkpoint and summary. The output directory is held exclusively for the
    whole run (server/fedmeta/server/rundir.py). ``workload``: the one ``cfg`` describes, when the
    caller has built it already (else it is built once here). ``test_when_interrupted=False``: a
    stopped run ends at once, without scoring its test tasks (a resume or ``fedmeta evaluate``
    does).
    """
    out = Path(out_dir or cfg.output.dir)
    options = RunOptions(out, resume, list(observers), open_ledger, workload,
                         stop or threading.Event(), test_when_interrupted)  # fmt: skip
    with exclusive_run_directory(out):
        run = _start(cfg, transport, options)
        try:
            return _run(run, announce)
        finally:
            run.context.release.close()


def _run(run: _Run, announce: Callable[[str], None]) -> RunResult:
    """Announce the plan, run the rounds and finish."""
    from fedmeta.server.outputs import format_plan

    ctx = run.context
    announce(format_plan(ctx.plan, ctx.forecast, ctx.cfg, len(ctx.registered), _coordinates(ctx)))
    ctx.observers.run_started(_run_started(ctx))
    if run.next_round == 0:  # round 0: the plots' first point, the selection's first candidate
        run.starting = _starting_model(ctx, _validate(run))
        run.selection.offer(0, run.starting.validation_metric, run.state.params)
    elif run.selection.keeps_best and run.selection.round is None:
        # A run resumed under this rule after starting under "last": its candidates begin where
        # it resumes.
        run.selection.offer(run.next_round, _validate(run), run.state.params)
    _checkpoint(run)  # the run id is recoverable from the first moment
    first = run.next_round
    stopped = _rounds(run)
    result = _finish(run, stopped)
    result.rounds_run = run.next_round - first
    return result


def _start(given: Config, transport: GridTransport, options: RunOptions) -> _Run:
    """Register, plan, open the budget and restore or create the state: the run's context.

    ``given`` is the caller's configuration; from the plan on, the run uses ``budgeted.cfg`` (with
    the data's recorded budget) and asks ``plan.private`` whether it is private.
    """
    ckpt = refuse_to_overwrite_run(options.out, options.resume)
    run_id = ckpt.run_id if ckpt else uuid.uuid4().hex[:12]
    membership = register(given, transport, run_id)
    registered = tuple(membership.members.values())
    wl = options.workload or build_workload(given)  # the data, whatever the budget's terms
    # Held-out metrics are released: never on items a budget records as participants' (issue 52).
    # Checked when a run starts, before it records its own data; a resumed run was checked then
    # (its own participants' items are in the ledger now, and may be its test items: issue 42).
    if ckpt is None and private_requested(given.privacy) and options.open_ledger is None:
        try:
            check_evaluation_data(given, wl, ledger_file(given))
        except EvaluationDataPrivate as error:
            raise FederationError(str(error)) from None
    budgeted = plan_and_budget(given, options.open_ledger, ckpt, membership)
    cfg, plan, ledger = budgeted.cfg, budgeted.plan, budgeted.ledger
    federation_id = ledger.federation_id if ledger is not None else "non-private"
    selection = model_selection(cfg, wl, None if ckpt is None else ckpt.selection)
    state, outcomes, next_round = initial_state(cfg, plan, ckpt, ledger, run_id, wl)
    public = wl.public_data_use()
    if ledger is not None and public is not None:  # before the first spend
        ledger.record_public_use(public, run_id)
    position = RunPosition(run_id, next_round)
    predicted = forecast_run(cfg, plan, ledger, position, fresh=ckpt is None)
    individual = start_filter(cfg, plan.privacy, ledger, membership.members, position)
    dim = int(state.trained.numel())
    try:
        subspace = public_subspace(cfg, wl)
    except ValueError as error:
        raise FederationError(str(error)) from None
    ids = RunIds(run_id, federation_id)
    rounds = round_context(cfg, ids, plan, membership, dim, options.stop)
    release = _release(cfg, plan, ledger, ReleasedRun(run_id, dim, plan.normaliser))
    context = RunContext(
        cfg, options.out, plan, registered, membership, wl, Observers(options.observers),
        predicted, ledger, release, rounds, options.test_when_interrupted, ckpt is not None,
        subspace, individual,
    )  # fmt: skip
    starting = StartingModel.from_dict(None if ckpt is None else ckpt.starting_model)
    return _Run(context, state, outcomes, next_round, selection, starting)


# ---------------------------------------------------------------------------------- the rounds


def _rounds(run: _Run) -> str:
    """Run rounds until the plan or the budget ends, or ``stop`` is set; the stop reason."""
    ctx = run.context
    stop = ctx.rounds.stop  # set once, for the run: a round ends within seconds
    for index in range(run.next_round, ctx.cfg.rounds):
        if stop.is_set():
            log.info("stopping before round %d: interrupted", index + 1)
            return STOP_INTERRUPTED
        setup = _prepare_round(run, index)
        if setup is None:
            return STOP_NO_PARTICIPANTS
        try:
            outcome = run_round(ctx.rounds, setup, run.state, index)
        except RoundAbandoned as abandoned:
            log.info("%s", abandoned)
            return STOP_INTERRUPTED
        if outcome is None:
            log.info("round %d not run: budget exhausted", index + 1)
            return STOP_BUDGET
        outcome = _evaluate_round(run, outcome)
        run.outcomes.append(outcome)
        run.next_round = index + 1
        ctx.observers.round_finished(outcome)
        if run.next_round % ctx.cfg.training.checkpoint_every == 0:
            _checkpoint(run)
    return STOP_PLANNED


def _prepare_round(run: _Run, index: int) -> RoundSetup | None:
    """The round's population, sampler and release; None if nobody can be sampled."""
    ctx, membership = run.context, run.context.membership
    membership.refresh()
    eligible = membership.eligible()
    if not eligible:
        log.warning("round %d not run: no participant is connected and unsuspended", index + 1)
        return None
    # Refusals since the last round's record, registration before round 1 included.
    done = run.refused_reported
    run.refused_since_last = {k: v - done.get(k, 0) for k, v in membership.refused.items()
                              if v > done.get(k, 0)}  # fmt: skip
    run.refused_reported = dict(membership.refused)
    plan = ctx.plan.for_population(ctx.cfg, eligible)  # the round's own event: its population's
    excluded = round_cohort(ctx.individual, ctx.ledger, ctx.cfg, membership.members, eligible,
                            plan.privacy)  # fmt: skip
    # The subspace from public data and the released model only (refreshed when due), free.
    basis = None if ctx.subspace is None else ctx.subspace.at(run.state.params, index)
    release = ctx.release.for_round(plan.scheme, index, run.state.clip, basis)  # after the cohort
    seed = ctx.cfg.privacy.insecure_test_seed
    # Test mode: sampling (and noise) re-derived from (seed, round), so resumes reproduce.
    source = SystemRandomSource() if seed is None else InsecureSeededSource(seed, stream=index)
    sampler = round_sampler(ctx.plan.level, plan.scheme, source)  # sample level: stage 1 alone
    sampler.check_task_counts(eligible)
    return RoundSetup(eligible, sampler, release, excluded)


def _release(
    cfg: Config, plan: RunPlan, ledger: Ledger | None, run: ReleasedRun
) -> ReleaseStrategy:
    """The run's release strategy, chosen once from the plan."""
    reports = lambda r: reports_epsilon(cfg, r)  # noqa: E731 - which records carry epsilon
    return choose_release(plan, ledger, run, cfg.privacy.insecure_test_seed, reports)


def _evaluate_round(run: _Run, outcome: RoundOutcome) -> RoundOutcome:
    """Add the public evaluation (held-out tasks, noisy model) and, on report rounds, epsilon."""
    ctx, r = run.context, outcome.round
    cfg = ctx.cfg
    probe = _held_out(run, "probe", cfg.dataset.probe_tasks) if cfg.dataset.probe_tasks else None
    loss = _evaluate(run, probe).mean if probe is not None else None
    validation = None
    if r % cfg.training.eval_every == 0 or r == cfg.rounds:
        validation = _validate(run)
        run.selection.offer(r, validation, run.state.params)
    eps = ctx.release.epsilons() if reports_epsilon(cfg, r) else {}  # {}: a non-private run
    return replace(
        outcome,
        train_loss=loss,
        validation_metric=validation,
        participants_suspended=len(ctx.membership.suspended),
        nodes_refused=run.refused_since_last,
        **eps,
    )


def _starting_model(ctx: RunContext, validation: float) -> StartingModel:
    """Round 0's record: the public starting model's validation score, the data's epsilon then."""
    before = ctx.forecast.epsilon_spent_before if ctx.forecast is not None else None
    return StartingModel(source_of(ctx.cfg.public.warm_start), validation, before)


def _validate(run: _Run) -> float:
    """The current model's mean metric on the server's validation tasks."""
    tasks = _held_out(run, "validation", run.context.cfg.dataset.validation_tasks)
    return float(_evaluate(run, tasks).mean)


def _held_out(run: _Run, which: HeldOut, n_tasks: int) -> Any:
    return run.context.workload.held_out(which, n_tasks)


def _evaluate(run: _Run, tasks: Any, params: torch.Tensor | None = None, pre: bool = False) -> Any:
    from fedmeta.adaptation import inner_kwargs
    from fedmeta.metalearning import evaluate

    cfg = run.context.cfg
    return evaluate(
        run.context.workload.model,
        (run.state.params if params is None else params).detach(),
        tasks,
        **inner_kwargs(cfg.training, evaluation=True),
        device=cfg.federation.client_device,  # the run's device (auto: CUDA when present)
        chunk_size=cfg.training.chunk_size,
        with_pre_adaptation=pre,
    )


def _checkpoint(run: _Run) -> None:
    from fedmeta.server.outputs import ledger_anchor

    ctx = run.context
    ledger, privacy = ctx.ledger, ctx.plan.privacy
    save_checkpoint(ctx.out, Checkpoint(
        run_id=ctx.run_id,
        federation_id=ctx.federation_id,
        params=run.state.params.detach().clone(),
        optimizer=run.state.optimizer.state_dict(),
        next_round=run.next_round,
        config=ctx.cfg,
        private=ctx.plan.private,
        noise_multiplier=None if privacy is None else privacy.noise_multiplier,
        noise_calibrated=privacy is not None and privacy.noise_calibrated,
        clip=run.state.clip,  # adaptive clipping's next bound (None: fixed)
        outcomes=tuple(o.to_dict() for o in run.outcomes),
        ledger=None if ledger is None else ledger.checkpoint(),
        witness=ledger_anchor(ledger),
        released_coordinates=_coordinates(ctx),  # the implemented guarantee's count
        selection=run.selection.to_checkpoint(),
        starting_model=None if run.starting is None else run.starting.to_dict(),
    ))  # fmt: skip


# ---------------------------------------------------------------------------------- the end


def _run_started(ctx: RunContext) -> RunStarted:
    fc, p = ctx.forecast, ctx.plan.privacy
    return RunStarted(
        run_id=ctx.run_id,
        federation_id=ctx.federation_id,
        private=p is not None,
        epsilon_budget=None if p is None else p.epsilon_budget,
        delta=None if p is None else p.delta,
        noise_multiplier=None if p is None else p.noise_multiplier,
        clip=None if p is None else p.clip,
        planned_rounds=ctx.plan.planned_rounds,
        rounds_affordable=fc.rounds_affordable if fc else None,
        epsilon_spent_task=fc.epsilon_spent_before if fc else 0.0,
        epsilon_spent_participant=None,
        participants_registered=len(ctx.registered),
        metric_name=ctx.workload.metric,
        diagnostics=ctx.rounds.diagnostics,
        round_min_seconds=ctx.cfg.federation.round_min_seconds,
        target_epsilon=None if p is None else ctx.cfg.privacy.target_epsilon,
    )


def _test(run: _Run, stopped: str) -> tuple[Any, float | None]:
    """The released model's and the starting model's test scores; (None, None) when skipped."""
    ctx = run.context
    if stopped == STOP_INTERRUPTED and not ctx.test_when_interrupted:
        return None, None
    test_tasks = _held_out(run, "test", ctx.cfg.dataset.test_tasks)
    final = _evaluate(run, test_tasks, params=run.selection.released(run.state.params), pre=True)
    starting = _evaluate(run, test_tasks, params=ctx.workload.initial_params()).mean
    return final, float(starting)


def _finish(run: _Run, stopped: str) -> RunResult:
    from fedmeta.server.outputs import FinalScores, RunEnd, RunFacts, build_summary
    from fedmeta.server.starting import model_start_fields

    ctx = run.context
    _checkpoint(run)
    final, starting = _test(run, stopped)
    eps = ctx.release.epsilons()  # {}: a non-private run
    completed = len(run_spends(ctx.ledger, ctx.run_id)) if ctx.ledger else run.next_round
    end_of_run(ctx.ledger, ctx.run_id, resumable=stopped == STOP_INTERRUPTED)
    ci = None if final is None else (final.ci95_low, final.ci95_high)
    ctx.observers.run_finished(RunFinished(
        ctx.run_id, ctx.federation_id, completed, stopped, eps.get("epsilon_task"),
        eps.get("epsilon_participant"), None if final is None else final.mean, ci,
    ))  # fmt: skip
    facts = RunFacts(ctx.cfg, ctx.plan, ctx.forecast, ctx.run_id, ctx.federation_id,
                     len(ctx.registered), ctx.ledger, _coordinates(ctx))  # fmt: skip
    end = RunEnd(run.outcomes, stopped, completed, eps, time.monotonic() - ctx.started_at)
    model_start = model_start_fields(
        ctx.workload.public_summary(), ctx.workload.trained_summary(),
        run.selection.summary(ctx.cfg.dataset.validation_tasks, run.next_round))  # fmt: skip
    scores = FinalScores(final, starting, model_start, run.starting, _seen(run, final))
    summary = build_summary(facts, end, scores)
    return RunResult(summary, run.outcomes, ctx.out, ctx.rounds.diagnostics)


def _seen(run: _Run, final: Any) -> dict[str, Any]:
    """The test evaluation's ``seen_fraction`` and ``held_out`` (server/.../seen_release.py)."""
    from fedmeta.server.seen_release import seen_fields

    ctx = run.context
    released = run.selection.released(run.state.params)
    return seen_fields(ctx.cfg, ctx.workload, private=ctx.plan.private, final=final,
                       fingerprints=ctx.membership.declared, resumed=ctx.resumed,
                       evaluate_tasks=lambda t: _evaluate(run, t, params=released))  # fmt: skip


def _coordinates(ctx: RunContext) -> int:
    """Noisy values a round of this run releases (the floating-point residual's count)."""
    from fedmeta.server.outputs import released_coordinates

    subspace = ctx.cfg.privacy.subspace.dimension  # a subspace's round releases k values
    return released_coordinates(ctx.plan, ctx.rounds.dim if subspace is None else subspace)
