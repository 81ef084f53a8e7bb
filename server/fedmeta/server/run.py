"""A federation run: start or resume, register, plan, rounds, evaluation, checkpoints, summary.

``run_federation(cfg, transport, ...)`` is what every entry point runs (``fedmeta simulate``, the
Flower ServerApp, tests). Flower stays behind the transport (server/fedmeta/server/transport.py);
one round is
``server.round.run_round``; this module strings rounds together.

**The budget belongs to the data.** A private run spends from the ledger in fedmeta's state
directory (or ``privacy.ledger_path``), in the federation of its data's identity
(core/fedmeta/workload.py): runs over the same data compose, whatever their seed or output
directory.
Runs in the reproducible test mode (``privacy.insecure_test_seed``) use a separate ledger.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fedmeta.accounting import (
    BudgetLedger,
    InsecureSeededSource,
    LedgerCheckpoint,
    LedgerMode,
    SystemRandomSource,
    TwoStageSampler,
    resolve_federation,
)
from fedmeta.accounting.ledger import ensure_directory
from fedmeta.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from fedmeta.client_config import client_config
from fedmeta.config import Config
from fedmeta.protocol import GradientRequest, RegisterRequest
from fedmeta.server.budget_keys import (
    budget_identity,
    budget_label,
    inherited_labels,
    ledger_participants,
    use_round_cohort,
)
from fedmeta.server.data_budget import (
    BudgetMismatch,
    adopt_data_budget,
    ledger_file,
    no_fit_reason,
    other_budget_hint,
)
from fedmeta.server.epsilon_curve import RoundEpsilons
from fedmeta.server.ledger_witness import refuse_second_ledger, watch_ledger
from fedmeta.server.membership import Membership
from fedmeta.server.noise import NoiseSource
from fedmeta.server.plan import (
    BudgetForecast,
    RunPlan,
    build_plan,
    forecast,
    ledger_epsilons,
    reported_epsilon,
)
from fedmeta.server.report import (
    STATUS_LOST_ON_RESUME,
    Observers,
    RoundOutcome,
    RunFinished,
    RunObserver,
    RunStarted,
)
from fedmeta.server.round import (
    STOP_BUDGET,
    STOP_PLANNED,
    Exchange,
    RoundAbandoned,
    RoundSession,
    TrainingState,
    run_round,
)
from fedmeta.server.rundir import exclusive_run_directory
from fedmeta.server.selection import ModelSelection
from fedmeta.server.starting import StartingModel, source_of
from fedmeta.server.subspace import public_subspace
from fedmeta.server.transport import GridTransport, Registered, RegistrationError
from fedmeta.workload import HeldOut, Workload, build_workload

log = logging.getLogger("fedmeta.server")

STOP_INTERRUPTED = "interrupted"
STOP_NO_PARTICIPANTS = "no_participants"


class FederationError(RuntimeError):
    """The federation cannot start or go on; the message says why and what to do."""


class PlanError(ValueError):
    """The privacy plan cannot be made from this configuration (a one-line reason)."""


class NoRoundAffordable(RuntimeError):
    """A fresh private run whose budget affords no round: refused before anything is written."""


@dataclass
class RunResult:
    """What ``run_federation`` returns: the summary (``summary.json``) and every round's record."""

    summary: dict[str, Any]
    outcomes: list[RoundOutcome]
    out_dir: Path
    rounds_run: int = 0  # by this invocation (a resumed run counts only its own)


def refuse_to_overwrite_run(out_dir: Path, resume: bool) -> dict[str, Any] | None:
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


# ---------------------------------------------------------------------------------- the budget


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
    refuse_second_ledger(cfg, path, registered)  # one ledger per data (issue 39), before creating
    ensure_directory(path)  # one line naming the path if read-only or full (issue 21)
    identity = budget_identity(cfg, registered)
    federation = resolve_federation(path, identity, label=budget_label(cfg), mode=mode,
                                    inherit=inherited_labels(cfg))  # fmt: skip
    members = {r.participant_id: r for r in registered}
    ledger = BudgetLedger.open(
        path, federation, epsilon_budget=cfg.privacy.epsilon_budget, delta=cfg.privacy.delta,
        neighbouring=cfg.privacy.neighbouring, mode=mode,
    )  # fmt: skip
    try:
        watch_ledger(ledger, cfg)  # refused if behind its witness outside the state directory
        ledger.use_cohort(ledger_participants(cfg, members, members))
    except BaseException:
        ledger.close()
        raise
    return ledger


def run_spends(ledger: BudgetLedger, run_id: str) -> list[int]:
    """Round indices this run has spent, from the ledger (the source of truth)."""
    return sorted(r.round_index for r in ledger.records() if r.run_id == run_id)


# ---------------------------------------------------------------------------------- the run


@dataclass
class _Run:
    """One run's context, built by :func:`_start` and carried through its rounds."""

    cfg: Config
    out: Path
    run_id: str
    federation_id: str
    plan: RunPlan
    registered: list[Registered]
    session: RoundSession
    state: TrainingState
    outcomes: list[RoundOutcome]
    next_round: int
    observers: Observers
    forecast: BudgetForecast | None
    workload: Workload  # built once, in _start; the server's model and held-out tasks
    membership: Membership
    ledger: BudgetLedger | None = None
    epsilons: RoundEpsilons | None = None  # task-level epsilon per round (server.epsilon_curve)
    started_at: float = field(default_factory=time.monotonic)
    refused_since_last: dict[str, int] = field(default_factory=dict)
    refused_reported: dict[str, int] = field(default_factory=dict)  # in earlier rounds' records
    selection: ModelSelection = field(default_factory=lambda: ModelSelection("last", True))
    test_when_interrupted: bool = True  # False: an interrupted run ends without its test tasks
    starting: StartingModel | None = None  # round 0 (server/fedmeta/server/starting.py)
    resumed: bool = False


def run_federation(
    cfg: Config,
    transport: GridTransport,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    observers: Iterable[RunObserver] = (),
    announce: Callable[[str], None] = lambda text: log.info("%s", text),
    open_ledger: Callable[[Config, Sequence[Registered]], BudgetLedger] | None = None,
    stop: threading.Event | None = None,
    workload: Workload | None = None,
    test_when_interrupted: bool = True,
) -> RunResult:
    """Run the federation to ``planned_rounds``, ``budget_exhausted`` or ``interrupted``.

    ``open_ledger(cfg, registered)`` opens the budget (default :func:`open_budget`). Setting
    ``stop`` ends the run within the round in progress (abandoned if not yet spent, finished if
    spent), with a final checkpoint and summary. The output directory is held exclusively for the
    whole run (server/fedmeta/server/rundir.py). ``workload``: the one ``cfg`` describes, when the
    caller has
    built it already (else it is built once here). ``test_when_interrupted=False``: a stopped
    run ends at once, without scoring its test tasks (a resume or ``fedmeta evaluate`` does).
    """
    out = Path(out_dir or cfg.output.dir)
    with exclusive_run_directory(out):
        run = _start(cfg, transport, out, resume, list(observers), open_ledger, workload)
        run.test_when_interrupted = test_when_interrupted
        try:
            return _run(run, stop or threading.Event(), announce)
        finally:
            if run.epsilons is not None:
                run.epsilons.close()


def _run(run: _Run, stop: threading.Event, announce: Callable[[str], None]) -> RunResult:
    """Announce the plan, run the rounds and finish."""
    from fedmeta.server.outputs import format_plan

    cfg = run.cfg
    announce(format_plan(run.plan, run.forecast, cfg, len(run.registered), _coordinates(run)))
    run.observers.run_started(_run_started(run))
    if run.next_round == 0:  # round 0: the plots' first point, the selection's first candidate
        run.starting = _starting_model(run, _validate(run))
        run.selection.offer(0, run.starting.validation_metric, run.state.params)
    elif run.selection.keeps_best and run.selection.round is None:
        # A run resumed under this rule after starting under "last": its candidates begin where
        # it resumes.
        run.selection.offer(run.next_round, _validate(run), run.state.params)
    _checkpoint(run)  # the run id is recoverable from the first moment
    first = run.next_round
    stopped = _rounds(run, stop)
    result = _finish(run, stopped)
    result.rounds_run = run.next_round - first
    return result


def _start(
    cfg: Config,
    transport: GridTransport,
    out: Path,
    resume: bool,
    observers: list[RunObserver],
    open_ledger: Callable[[Config, Sequence[Registered]], BudgetLedger] | None,
    workload: Workload | None,
) -> _Run:
    ckpt = refuse_to_overwrite_run(out, resume)
    run_id = str(ckpt["run_id"]) if ckpt else uuid.uuid4().hex[:12]
    membership = _register(cfg, transport, run_id)
    registered = list(membership.members.values())
    task_counts = membership.eligible()
    z = float(ckpt["noise_multiplier"]) if ckpt and ckpt.get("noise_multiplier") else None
    recorded = open_ledger is None  # fedmeta's ledger, where the data's budget is recorded
    opened_with = _with_recorded_ledger(cfg, ckpt, check=recorded)
    if recorded:  # the data's recorded budget, not the run's configuration
        try:
            cfg = adopt_data_budget(cfg, registered, ledger_file(opened_with))
        except BudgetMismatch as error:
            raise FederationError(str(error)) from None
        opened_with = _with_recorded_ledger(cfg, ckpt, check=False)
    try:
        plan = build_plan(cfg, task_counts, noise_multiplier=z)
    except ValueError as error:  # e.g. a target epsilon no noise multiplier in range reaches
        raise PlanError(f"cannot plan the private run: {error}") from None
    ledger = (open_ledger or open_budget)(opened_with, registered) if plan.private else None
    federation_id = ledger.federation_id if ledger is not None else "non-private"
    wl = workload or build_workload(cfg)
    selection = _model_selection(cfg, wl, ckpt)
    state, outcomes, next_round = _initial_state(cfg, plan, ckpt, ledger, run_id, wl)
    public = wl.public_data_use()
    if ledger is not None and public is not None:  # before the first spend
        ledger.record_public_use(public, run_id)
    session = _session(cfg, run_id, federation_id, plan, membership, state, ledger)
    try:
        session.subspace = public_subspace(cfg, wl)
    except ValueError as error:
        raise FederationError(str(error)) from None
    spent = len(run_spends(ledger, run_id)) if ledger is not None else 0
    predicted = forecast(plan, ledger, cfg.rounds - max(spent, next_round)) if ledger else None
    if ckpt is None and predicted is not None and ledger:
        _check_target_fits(cfg, plan, ledger, predicted)
    run = _Run(cfg, out, run_id, federation_id, plan, registered, session, state, outcomes,
               next_round, Observers(observers), predicted, wl, membership, ledger)  # fmt: skip
    if isinstance(ledger, BudgetLedger):  # a test's fake ledger answers epsilon at once
        run.epsilons = RoundEpsilons(lambda r: _reports_epsilon(cfg, r))
    run.selection, run.resumed = selection, ckpt is not None
    run.starting = StartingModel.from_dict((ckpt or {}).get("starting_model"))
    return run


def _model_selection(cfg: Config, workload: Workload, ckpt: Mapping[str, Any] | None
                     ) -> ModelSelection:  # fmt: skip
    """The run's model selection (server/fedmeta/server/selection.py), restored on resume."""
    rule = cfg.training.model_selection
    if rule == "best_validation" and workload.validation_is_test:
        raise FederationError(
            f"training.model_selection = 'best_validation' needs validation classes apart from the "
            f"test classes, and dataset.split = {cfg.dataset.split!r} has none: choosing on test "
            "classes would bias the test result; use a split with validation classes "
            "('evaluation' or 'dpmaml') or training.model_selection = 'last'"
        )
    selection = ModelSelection(rule, workload.higher_is_better)
    selection.restore((ckpt or {}).get("selection"))
    return selection


def _with_recorded_ledger(cfg: Config, ckpt: Mapping[str, Any] | None, *, check: bool) -> Config:
    """The configuration to open the ledger with: on resume, the ledger the run recorded.

    A run records its ledger's absolute path before its first spend; resuming from another
    directory with a relative ``privacy.ledger_path`` would otherwise open (and create) another
    file. A recorded ledger that is gone is refused before anything is created.
    """
    recorded = (ckpt or {}).get("ledger") or {}
    path = recorded.get("path")
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


def _check_target_fits(
    cfg: Config, plan: RunPlan, ledger: BudgetLedger, predicted: BudgetForecast
) -> None:
    """Refuse, before any round, a run the budget affords no round of, or whose target misses.

    A run with ``privacy.target_epsilon`` asks for all its rounds: it starts only if they fit
    what every participant it may sample has left. Without one it spends what is left.
    """
    if not predicted.rounds_to_run:
        raise NoRoundAffordable(_no_round_reason(cfg, plan, ledger))
    if cfg.privacy.target_epsilon is not None and predicted.rounds_to_run < cfg.rounds:
        raise NoRoundAffordable(no_fit_reason(cfg, plan, ledger, predicted))


def _no_round_reason(cfg: Config, plan: RunPlan, ledger: BudgetLedger) -> str:
    """One line: why the budget affords no round, and what to change (public values only)."""
    assert plan.event is not None and plan.delta is not None
    spent = ledger.epsilon(unit="task")
    one = reported_epsilon([*ledger.rounds(), (plan.event, 1)], plan.delta) or 0.0
    return (
        f"the budget affords no round: one round at noise multiplier "
        f"{plan.event.noise_multiplier:g} brings epsilon to {one:.4g} at delta {plan.delta:g}, "
        f"over the data's budget {ledger.epsilon_budget:g} ({spent:.4g} already spent "
        f"on this data in {ledger.path}, {max(ledger.epsilon_budget - spent, 0.0):.4g} left); "
        "raise privacy.noise_multiplier (or set a smaller privacy.target_epsilon), or "
        + other_budget_hint(cfg, ledger.path, ledger.federation_id)
        + "; nothing was run or written"
    )


def _register(cfg: Config, transport: GridTransport, run_id: str) -> Membership:
    """The run's membership once enough participants registered (fedmeta.server.membership)."""
    request = RegisterRequest(run_id, client_config(cfg).model_dump_json())  # a participant's part
    membership = Membership(cfg, transport, request)
    membership.start()
    want = cfg.federation.min_participants or cfg.n1
    if len(membership.members) < want:
        refused = f" (refused: {membership.refused})" if membership.refused else ""
        raise RegistrationError(
            f"{len(membership.members)} participants registered within "
            f"federation.register_timeout_s={cfg.federation.register_timeout_s:g}; the run needs "
            f">= {want} (federation.min_participants){refused}"
        )
    return membership


def _session(
    cfg: Config,
    run_id: str,
    federation_id: str,
    plan: RunPlan,
    membership: Membership,
    state: TrainingState,
    ledger: BudgetLedger | None,
) -> RoundSession:
    seed = cfg.privacy.insecure_test_seed
    if seed is not None:
        log.warning("INSECURE: noise and sampling use insecure_test_seed (tests only, not private)")

    def exchange(requests: Mapping[str, GradientRequest]) -> Exchange:
        result = membership.transport.exchange(requests, membership.nodes())
        failed = {pid: d.failure for pid, d in result.deliveries.items() if d.failure}
        membership.record(requests, failed)
        return result

    return RoundSession(
        run_id=run_id,
        federation_id=federation_id,
        plan=plan,
        task_counts=membership.eligible(),
        sampler=TwoStageSampler(plan.scheme, SystemRandomSource()),
        transport=exchange,
        config_json=client_config(cfg).model_dump_json(),
        dim=int(state.trained.numel()),
        reply_format=cfg.federation.reply_format,
        tolerance=cfg.privacy.clip_tolerance,
        diagnostics=not plan.private or cfg.metrics.private_diagnostics,
        round_min_seconds=cfg.federation.round_min_seconds,
        ledger=ledger,
        noise=NoiseSource.create() if seed is None else None,
    )


def _optimizer_args(cfg: Config, plan: RunPlan, workload: Workload) -> dict[str, Any]:
    """The meta-optimizer's settings: the noise variance Phi it may correct for is public."""
    phi = 0.0
    z = plan.gradient_noise_multiplier
    if plan.private and z is not None and plan.clip is not None:
        phi = (z * plan.clip / plan.normaliser) ** 2
    return {"training": cfg.training, "noise_variance": phi, "planned_rounds": cfg.rounds,
            "clip": plan.clip if plan.adaptive is not None else None,
            "coordinates": workload.trained_coordinates}  # fmt: skip


def _initial_state(
    cfg: Config,
    plan: RunPlan,
    ckpt: dict[str, Any] | None,
    ledger: BudgetLedger | None,
    run_id: str,
    workload: Workload,
) -> tuple[TrainingState, list[RoundOutcome], int]:
    """The model, the rounds so far and the next round: fresh, or resumed by the resume rule."""
    if ckpt is None:
        fresh = TrainingState(workload.initial_params(), **_optimizer_args(cfg, plan, workload))
        return fresh, [], 0
    _check_same_subset(ckpt, cfg)
    state = TrainingState(ckpt["params"], **_optimizer_args(cfg, plan, workload),
                          optimizer_state=ckpt["optimizer"])  # fmt: skip
    if plan.adaptive is not None and ckpt.get("clip") is not None:
        state.clip = float(ckpt["clip"])  # adaptive clipping's bound for the next round
        state.set_noise_variance((plan.adaptive.gradient_noise_multiplier * state.clip
                                  / plan.normaliser) ** 2)  # fmt: skip
    outcomes = [RoundOutcome.from_dict(o) for o in ckpt.get("outcomes", [])]
    next_round = int(ckpt["next_round"])
    if ledger is None:
        return state, outcomes, next_round
    _check_ledger_binding(ckpt, ledger)
    lost = [i for i in run_spends(ledger, run_id) if i >= next_round]
    if lost:
        log.warning("resume: rounds %s were spent but their update was not checkpointed; they "
                    "count as spent and are not run again", [i + 1 for i in lost])  # fmt: skip
        outcomes += [
            RoundOutcome(run_id, ledger.federation_id, i + 1, STATUS_LOST_ON_RESUME) for i in lost
        ]
        next_round = max(lost) + 1
    return state, outcomes, next_round


def _check_same_subset(ckpt: Mapping[str, Any], cfg: Config) -> None:
    """Refuse to resume with other trained parameters: the optimizer's state is for the old ones."""
    saved = ckpt.get("config", {}).get("training", {}).get("trained_parameters", "all")
    if saved != cfg.training.trained_parameters:
        raise FederationError(
            f"the checkpoint trained training.trained_parameters = {saved!r}, this configuration "
            f"says {cfg.training.trained_parameters!r}: resume with {saved!r}, or start a new run "
            "with --out"
        )


def _check_ledger_binding(ckpt: Mapping[str, Any], ledger: BudgetLedger) -> None:
    """Refuse a ledger that is not the one the run spent from, or that lost records since.

    The run recorded the ledger's identity, path, position and last record before its first spend
    and in every checkpoint; a resume that opened another, emptier or diverged ledger (a relative
    path from another directory, a restored backup, a copy without its journal) stops here.
    """
    bound = ckpt.get("ledger")
    if bound is None:
        raise FederationError("the checkpoint records no ledger: it is not a private run's")
    saved = LedgerCheckpoint.from_dict(bound)
    if Path(saved.path) != Path(ledger.path) and saved.ledger_id != ledger.ledger_id:
        raise FederationError(
            f"the run spent from the ledger {saved.path} but this resume opened {ledger.path}; "
            f"restore the run's ledger at {saved.path} and resume again"
        )
    ledger.check_resume(saved)


# ---------------------------------------------------------------------------------- the rounds


def _rounds(run: _Run, stop: threading.Event) -> str:
    """Run rounds until the plan or the budget ends, or ``stop`` is set; the stop reason."""
    cfg = run.cfg
    run.session.stop = run.membership.transport.stop = stop  # a round ends within seconds
    for index in range(run.next_round, cfg.rounds):
        if stop.is_set():
            log.info("stopping before round %d: interrupted", index + 1)
            return STOP_INTERRUPTED
        if not _prepare_round(run, index):
            return STOP_NO_PARTICIPANTS
        try:
            outcome = run_round(run.session, run.state, index)
        except RoundAbandoned as abandoned:
            log.info("%s", abandoned)
            return STOP_INTERRUPTED
        if outcome is None:
            log.info("round %d not run: budget exhausted", index + 1)
            return STOP_BUDGET
        outcome = _evaluate_round(run, outcome)
        run.outcomes.append(outcome)
        run.next_round = index + 1
        run.observers.round_finished(outcome)
        if run.next_round % cfg.training.checkpoint_every == 0:
            _checkpoint(run)
    return STOP_PLANNED


def _prepare_round(run: _Run, index: int) -> bool:
    """The round's population, its privacy event and sampler; False if nobody can be sampled."""
    session, membership = run.session, run.membership
    membership.refresh()
    eligible = membership.eligible()
    if not eligible:
        log.warning("round %d not run: no participant is connected and unsuspended", index + 1)
        return False
    # Refusals since the last round's record, registration before round 1 included.
    done = run.refused_reported
    run.refused_since_last = {k: v - done.get(k, 0) for k, v in membership.refused.items()
                              if v > done.get(k, 0)}  # fmt: skip
    run.refused_reported = dict(membership.refused)
    session.task_counts = eligible
    use_round_cohort(run.ledger, run.cfg, membership.members, eligible)  # who this round may sample
    session.plan = run.plan.for_population(run.cfg, eligible)
    if run.epsilons is not None and isinstance(run.ledger, BudgetLedger):
        assert session.plan.event is not None
        run.epsilons.before_round(run.ledger.projection(session.plan.event), index + 1)
    seed = run.cfg.privacy.insecure_test_seed
    if seed is None:
        session.sampler = TwoStageSampler(session.plan.scheme, SystemRandomSource())
    else:  # test mode: sampling and noise re-derived from (seed, round), so resumes reproduce
        source = InsecureSeededSource(seed, stream=index)
        session.sampler = TwoStageSampler(session.plan.scheme, source)
        session.noise = NoiseSource.insecure_for_tests(seed, index)
    session.sampler.check_task_counts(eligible)
    return True


def _reports_epsilon(cfg: Config, r: int) -> bool:
    """Whether round ``r``'s record carries epsilon (``privacy.report_every``, default every round).

    Also round 1, the evaluated rounds (the validation-vs-epsilon plot) and the last.
    """
    every, evaluated = cfg.privacy.report_every, cfg.training.eval_every
    return r <= cfg.rounds and (r == 1 or r % every == 0 or r % evaluated == 0 or r == cfg.rounds)


def _evaluate_round(run: _Run, outcome: RoundOutcome) -> RoundOutcome:
    """Add the public evaluation (held-out tasks, noisy model) and, on report rounds, epsilon."""
    cfg, r = run.cfg, outcome.round
    probe = _held_out(run, "probe", cfg.dataset.probe_tasks) if cfg.dataset.probe_tasks else None
    loss = _evaluate(run, probe).mean if probe is not None else None
    validation = None
    if r % cfg.training.eval_every == 0 or r == cfg.rounds:
        validation = _validate(run)
        run.selection.offer(r, validation, run.state.params)
    eps: dict[str, Any] = {}
    if run.ledger is not None and _reports_epsilon(cfg, r):
        eps = _epsilons(run)
    return replace(
        outcome,
        train_loss=loss,
        validation_metric=validation,
        participants_suspended=len(run.membership.suspended),
        nodes_refused=run.refused_since_last,
        **eps,
    )


def _epsilons(run: _Run) -> dict[str, Any]:
    """The ledger's epsilons now; the task-level one from the curve (fedmeta.server.epsilon_curve).

    The curve's value is ``Exposures.epsilon`` of the ledger's exposures read here, the value
    ``ledger.epsilon()`` would compute; the ledger computes it itself only without a curve (a
    test's fake ledger) or if the curve's composition failed.
    """
    assert run.ledger is not None and run.plan.event is not None
    task = None
    if run.epsilons is not None and isinstance(run.ledger, BudgetLedger):
        task = run.epsilons.after_spend(run.ledger.exposures(unit="task"))
    if task is None:
        return ledger_epsilons(run.ledger, run.plan.event)
    return {**ledger_epsilons(run.ledger, run.plan.event, task=False), "epsilon_task": task}


def _starting_model(run: _Run, validation: float) -> StartingModel:
    """Round 0's record: the public starting model's validation score, the data's epsilon then."""
    before = run.forecast.epsilon_spent_before if run.forecast is not None else None
    return StartingModel(source_of(run.cfg.public.warm_start), validation, before)


def _validate(run: _Run) -> float:
    """The current model's mean metric on the server's validation tasks."""
    tasks = _held_out(run, "validation", run.cfg.dataset.validation_tasks)
    return float(_evaluate(run, tasks).mean)


def _held_out(run: _Run, which: HeldOut, n_tasks: int) -> Any:
    return run.workload.held_out(which, n_tasks)


def _evaluate(run: _Run, tasks: Any, params: torch.Tensor | None = None, pre: bool = False) -> Any:
    from fedmeta.adaptation import inner_kwargs
    from fedmeta.metalearning import evaluate

    cfg = run.cfg
    return evaluate(
        run.workload.model,
        (run.state.params if params is None else params).detach(),
        tasks,
        **inner_kwargs(cfg.training, evaluation=True),
        device=cfg.federation.client_device,  # the run's device (auto: CUDA when present)
        chunk_size=cfg.training.chunk_size,
        with_pre_adaptation=pre,
    )


def _checkpoint(run: _Run) -> None:
    from fedmeta.server.outputs import ledger_anchor

    ledger = run.ledger
    save_checkpoint(
        run.out,
        {
            "run_id": run.run_id,
            "federation_id": run.federation_id,
            "params": run.state.params.detach().clone(),
            "optimizer": run.state.optimizer.state_dict(),
            "next_round": run.next_round,
            "config": run.cfg.to_dict(),
            "noise_multiplier": run.plan.noise_multiplier,
            "noise_calibrated": run.plan.noise_calibrated,
            "clip": run.state.clip,  # adaptive clipping's next bound (None: fixed)
            "outcomes": [o.to_dict() for o in run.outcomes],
            "private": run.plan.private,
            "ledger": None if ledger is None else ledger.checkpoint().to_dict(),
            "witness": ledger_anchor(ledger),
            "released_coordinates": _coordinates(run),  # the implemented guarantee's count
            "selection": run.selection.to_checkpoint(),
            "starting_model": None if run.starting is None else run.starting.to_dict(),
        },
    )


# ---------------------------------------------------------------------------------- the end


def _run_started(run: _Run) -> RunStarted:
    plan, fc = run.plan, run.forecast
    return RunStarted(
        run_id=run.run_id,
        federation_id=run.federation_id,
        private=plan.private,
        epsilon_budget=plan.epsilon_budget,
        delta=plan.delta,
        noise_multiplier=plan.noise_multiplier,
        clip=plan.clip,
        planned_rounds=plan.planned_rounds,
        rounds_affordable=fc.rounds_affordable if fc else None,
        epsilon_spent_task=fc.epsilon_spent_before if fc else 0.0,
        epsilon_spent_participant=None,
        participants_registered=len(run.registered),
        metric_name=run.workload.metric,
        diagnostics=run.session.diagnostics,
        round_min_seconds=run.cfg.federation.round_min_seconds,
        target_epsilon=run.cfg.privacy.target_epsilon if plan.private else None,
    )


def _test(run: _Run, stopped: str) -> tuple[Any, float | None]:
    """The released model's and the starting model's test scores; (None, None) when skipped."""
    if stopped == STOP_INTERRUPTED and not run.test_when_interrupted:
        return None, None
    test_tasks = _held_out(run, "test", run.cfg.dataset.test_tasks)
    final = _evaluate(run, test_tasks, params=run.selection.released(run.state.params), pre=True)
    starting = _evaluate(run, test_tasks, params=run.workload.initial_params()).mean
    return final, float(starting)


def _finish(run: _Run, stopped: str) -> RunResult:
    _checkpoint(run)
    final, starting = _test(run, stopped)
    eps = _epsilons(run) if run.ledger is not None else {}
    completed = len(run_spends(run.ledger, run.run_id)) if run.ledger else run.next_round
    ci = None if final is None else (final.ci95_low, final.ci95_high)
    run.observers.run_finished(RunFinished(
        run.run_id, run.federation_id, completed, stopped, eps.get("epsilon_task"),
        eps.get("epsilon_participant"), None if final is None else final.mean, ci,
    ))  # fmt: skip
    from fedmeta.server.outputs import build_summary
    from fedmeta.server.starting import model_start_fields

    summary = build_summary(
        run.cfg, run.plan, run.forecast, run.outcomes,
        run_id=run.run_id, federation_id=run.federation_id, stopped=stopped,
        rounds_completed=completed, epsilons=eps, final=final, starting=starting,
        participants=len(run.registered), noise_secure=run.cfg.privacy.insecure_test_seed is None,
        ledger=run.ledger, wall_seconds=time.monotonic() - run.started_at,
        coordinates=_coordinates(run),
        model_start=model_start_fields(
            run.workload.public_summary(), run.workload.trained_summary(),
            run.selection.summary(run.cfg.dataset.validation_tasks, run.next_round)),
        start=run.starting, seen=_seen(run, final),
    )  # fmt: skip
    return RunResult(summary, run.outcomes, run.out)


def _seen(run: _Run, final: Any) -> dict[str, Any]:
    """The test evaluation's ``seen_fraction`` and ``held_out`` (server/.../seen_release.py)."""
    from fedmeta.server.seen_release import seen_fields

    released = run.selection.released(run.state.params)
    return seen_fields(run.cfg, run.workload, private=run.plan.private, final=final,
                       fingerprints=run.membership.declared, resumed=run.resumed,
                       evaluate_tasks=lambda t: _evaluate(run, t, params=released))  # fmt: skip


def _coordinates(run: _Run) -> int:
    """Noisy values a round of this run releases (the floating-point residual's count)."""
    from fedmeta.server.outputs import released_coordinates

    subspace = run.cfg.privacy.subspace.dimension  # a subspace's round releases k values
    return released_coordinates(run.plan, run.session.dim if subspace is None else subspace)
