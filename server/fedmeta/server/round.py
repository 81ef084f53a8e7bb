"""One round of a federation as a pipeline, free of Flower: ``run_round(context, setup, state, i)``.

``context`` (:class:`RoundContext`) is what every round of the run shares, fixed at start-up;
``setup`` (:class:`RoundSetup`) is this round's population, sampler and release, whose rule the
run chose once from its plan (server/fedmeta/server/release_strategy.py): the round never asks
whether the run is private.

1. **Budget check.** If the run's own rounds cannot afford the planned round, stop: nothing is run
   (``release.affordable()``; public, never the participants' earlier spends).
2. **Sample.** Stage 1 draws ``n1`` participants, stage 2 tasks inside each, with the
   ``TwoStageSampler`` executing the very scheme object that the accounted event holds.
3. **Request.** Every stage-1 participant is sent the meta-parameters and its task ids (an empty
   list when it drew none), so who is contacted reveals nothing about stage 2.
4. **Validate.** Structural problems drop a reply; value problems are neutralised and counted
   (server/fedmeta/server/validation.py). Missing, late and malformed replies never stop a round.
5. **Pad, then spend.** The round waits until ``federation.round_min_seconds`` have passed since
   it started (the work before depends on the stage-2 count), then ``release.release`` first
   spends: ``ledger.spend(event, run_id, round)`` records the round durably *before* anything is
   released; if another run spent the rest meanwhile it raises and nothing is released. What
   follows the spend (sum, noise, step) costs the same whatever was sampled.
6. **Sum, noise and step.** Sum the accepted contributions of the participants taking part (the
   replies of those whose allowance is spent are discarded: server/fedmeta/server/
   individual_filter.py; they were asked and checked as everyone else), add ``N(0, (zC)^2 I)`` on
   the release grid (server/fedmeta/server/noise.py), divide by the public normaliser (the release
   strategy, server/fedmeta/server/release_strategy.py), and take the optimizer step. With adaptive
   clipping the round's bound ``C_t`` is the training state's, the centred count of the replies'
   clip bits is released beside the sum (the gradient's noise multiplier lowered so that the two
   together are the event's ``z``), and the next bound ``C_{t+1}`` is computed from that release
   alone (accounting/fedmeta/accounting/adaptive.py).

A non-private run skips 1, 5 and the noise, and averages over the tasks received. The result is a
:class:`~server.report.RoundOutcome`; private diagnostics are attached only where allowed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedmeta.accounting import TwoStageSampler
from fedmeta.config_training import TrainingConfig
from fedmeta.protocol import GradientReply, GradientRequest, ReplyFormat
from fedmeta.server.operator_log import log_failures
from fedmeta.server.optimizer import learning_rate, make_optimizer
from fedmeta.server.release_strategy import Released, RoundRelease
from fedmeta.server.releases import split_failures
from fedmeta.server.report import RoundDiagnostics, RoundOutcome
from fedmeta.server.sample_plan import ParticipantSampler
from fedmeta.server.validation import Expectation, RoundReplies, validate_round

STOP_PLANNED = "planned_rounds"
STOP_BUDGET = "budget_exhausted"


@dataclass(frozen=True)
class Delivery:
    """What the transport got back for one request: a decoded reply, or why there is none."""

    reply: GradientReply | None
    failure: str | None = None  # e.g. timeout, node_unavailable, error_reply, protocol_version
    detail: str = ""


@dataclass(frozen=True)
class Exchange:
    """One round's replies, keyed by participant id, and replies that matched no request."""

    deliveries: Mapping[str, Delivery]
    stray_replies: Mapping[str, int]


#: Sends one round's requests (participant id -> request) and returns what came back.
Transport = Callable[[Mapping[str, GradientRequest]], Exchange]


class RoundAbandoned(RuntimeError):
    """A stop request came before the round's spend: nothing of the round was spent or released."""


class TrainingDiverged(ValueError):
    """The meta-model left the finite floats: a step size the configuration must change."""


class TrainingState:
    """The meta-parameters, their optimizer and the clip bound: what a round changes.

    ``clip`` is the bound of the next round; adaptive clipping updates it every round (it is
    checkpointed and restored on resume). With a fixed bound it is never read. ``coordinates``
    (``training.trained_parameters``) are the positions of the meta-parameters the rounds update;
    the optimizer holds only those (``trained``), the others keep their initial values in
    ``params``. None: every parameter, and ``trained`` is ``params`` itself.
    """

    def __init__(
        self,
        params: Tensor,
        training: TrainingConfig,
        *,
        noise_variance: float = 0.0,
        planned_rounds: int = 1,
        optimizer_state: dict[str, Any] | None = None,
        clip: float | None = None,
        coordinates: Tensor | None = None,
    ) -> None:
        """The configured meta-optimizer on a flat float32 parameter vector (server/optimizer)."""
        self.clip = clip
        self.params = params.detach().to(torch.float32).clone()
        self.coordinates = coordinates
        picked = self.params if coordinates is None else self.params[coordinates]
        self.trained = picked.requires_grad_(True)
        self.training = training
        self.planned_rounds = planned_rounds
        self.optimizer = make_optimizer(self.trained, training, noise_variance)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)

    def step(self, update: Tensor, index: int) -> None:
        """The optimizer step of round ``index`` along ``update`` (released, normalised)."""
        rate = learning_rate(self.training, index, self.planned_rounds)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        self.optimizer.zero_grad(set_to_none=True)
        self.trained.grad = update.to(self.trained.dtype).reshape(self.trained.shape)
        self.optimizer.step()
        if self.coordinates is not None:
            with torch.no_grad():
                self.params[self.coordinates] = self.trained
        # Stop here rather than send participants a model they can only answer with NaN: the round's
        # spend is recorded, the last checkpoint holds the finite model before it.
        if not bool(torch.isfinite(self.trained).all()):
            raise TrainingDiverged(
                f"the meta-model became non-finite at round {index + 1}: the step is too large; "
                "lower training.meta_lr (or, with training.optimizer=adam_bc, raise "
                "training.adam_bc_floor); the rounds before it are in the ledger and the last "
                "checkpoint"
            )

    def set_noise_variance(self, variance: float) -> None:
        """Tell an optimizer that corrects for the noise (DP-AdamBC's Phi) the round's variance."""
        for group in self.optimizer.param_groups:
            if "phi" in group:
                group["phi"] = float(variance)

    def flat(self) -> np.ndarray:
        """The parameters as sent to participants: one float32 vector."""
        return self.params.detach().to(torch.float32).contiguous().numpy().copy()


@dataclass(frozen=True)
class RoundContext:
    """What every round of a run shares, fixed when the run starts."""

    run_id: str
    federation_id: str
    transport: Transport
    config_json: str
    dim: int
    reply_format: ReplyFormat
    tolerance: float
    diagnostics: bool
    round_min_seconds: float = 0.0
    #: Set by SIGINT/SIGTERM: a round not yet spent is abandoned (RoundAbandoned); one spent goes
    #: on to its release, since the ledger already counts it. The transport's wait reads it too.
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class RoundSetup:
    """What one round runs with: its population, its sampler, and its release.

    Built by the run before each round (server/fedmeta/server/run.py): the population eligible
    now, the sampler over the scheme of that population, and the release strategy's rule for the
    round (server/fedmeta/server/release_strategy.py), which holds the round's event and noise.
    """

    task_counts: Mapping[str, int]  # private under add/remove: used to sample, never released
    sampler: TwoStageSampler | ParticipantSampler  # the latter: stage 1 alone (sample level)
    release: RoundRelease
    #: Sampled and asked as everyone, their replies discarded before the sum: participants whose
    #: allowance is spent (server/fedmeta/server/individual_filter.py). Operator-only.
    excluded: frozenset[str] = frozenset()


def run_round(
    context: RoundContext, setup: RoundSetup, state: TrainingState, index: int
) -> RoundOutcome | None:
    """Run round ``index`` (0-based); None when the budget does not allow it (nothing happened)."""
    started = time.perf_counter()
    release = setup.release
    if not release.affordable():
        return None
    sample = setup.sampler.sample(setup.task_counts)
    requests = _requests(context, state, index, sample, release.clip)
    exchange = context.transport(requests)  # returns early on a stop request (server/transport)
    checked = validate_round(
        {pid: d.reply for pid, d in exchange.deliveries.items() if d.reply is not None},
        _expectations(context, index, requests, release),
    )
    # Pad before the spend: the spend's time (kept in the ledger) and everything after it then
    # follow the public minimum, not this round's stage-2 work; the spend still precedes the noise.
    _pad(started, context.round_min_seconds)
    received = time.perf_counter()
    # The last moment to stop without a trace: after it come the spend and the release, no wait.
    if context.stop.is_set():
        raise RoundAbandoned(f"round {index + 1} abandoned before its spend: stop requested")
    released = release.release(_taking_part(checked, setup.excluded), index)  # spend, sum, noise
    if released is None:
        return None
    if released.noise_variance is not None:
        state.set_noise_variance(released.noise_variance)
    state.step(released.update, index)
    if released.next_clip is not None:
        state.clip = released.next_clip
    outcome = _outcome(context, setup, index, (exchange, checked), released)
    log_failures(context.run_id, index + 1, _named_failures(exchange, checked))  # operator only
    if not context.diagnostics:
        return outcome
    return _with_diagnostics(outcome, requests, exchange, checked, (started, received))


def _taking_part(checked: RoundReplies, excluded: frozenset[str]) -> RoundReplies:
    """The replies whose contributions enter the sum: the excluded ones' discarded, nothing else.

    Their requests, validation and released counts were those of every other participant.
    """
    if not excluded:
        return checked
    kept = [a for a in checked.accepted if a.participant_id not in excluded]
    return RoundReplies(kept, checked.rejected)


def _requests(
    context: RoundContext,
    state: TrainingState,
    index: int,
    sample: Mapping[str, list[int]],
    clip: float | None,
) -> dict[str, GradientRequest]:
    params = state.flat()
    return {
        pid: GradientRequest(
            context.run_id, index, tuple(task_ids), clip, params, context.config_json
        )  # fmt: skip
        for pid, task_ids in sample.items()
    }


def _expectations(
    context: RoundContext,
    index: int,
    requests: Mapping[str, GradientRequest],
    release: RoundRelease,
) -> dict[str, Expectation]:
    return {
        pid: Expectation(
            context.run_id,
            index,
            pid,
            req.task_ids,
            context.dim,
            release.clip,
            context.reply_format,
            context.tolerance,
            release.clip_bits,
            release.example_rows,
        )  # fmt: skip
        for pid, req in requests.items()
    }


def _outcome(
    context: RoundContext,
    setup: RoundSetup,
    index: int,
    replies: tuple[Exchange, RoundReplies],
    released: Released,
) -> RoundOutcome:
    exchange, checked = replies
    failures = all_failures(exchange, checked)
    private = setup.release.private
    split = split_failures(failures, private=private)
    sampled = len(exchange.deliveries)
    return RoundOutcome(
        run_id=context.run_id,
        federation_id=context.federation_id,
        round=index + 1,
        participants_registered=len(setup.task_counts),
        participants_sampled=sampled,
        # Private: sampled participants whose node was available
        # (server/fedmeta/server/releases.py).
        participants_replied=sampled - split.released_count if private else len(checked.accepted),
        participants_failed=split.released_count,
        failures=dict(split.released),
        stray_replies={} if private else dict(exchange.stray_replies),
        ledger_position=released.position,
        noise_std=released.noise_std,
        clip=setup.release.clip,
    )


def _named_failures(exchange: Exchange, checked: RoundReplies) -> list[tuple[str, str, str]]:
    """``(participant, reason, detail)`` of a round's failures: for the operator log alone."""
    out = [(pid, d.failure, d.detail) for pid, d in sorted(exchange.deliveries.items())
           if d.failure is not None]  # fmt: skip
    return out + [(r.participant_id, r.reason, r.detail) for r in checked.rejected]


def all_failures(exchange: Exchange, checked: RoundReplies) -> dict[str, int]:
    """Every failed participant of a round under its one reason (transport, then validation)."""
    failures: dict[str, int] = {}
    for delivery in exchange.deliveries.values():
        if delivery.failure is not None:
            failures[delivery.failure] = failures.get(delivery.failure, 0) + 1
    for reason, count in checked.rejected_by_reason().items():
        failures[reason] = failures.get(reason, 0) + count
    return failures


def _pad(started: float, minimum: float) -> None:
    """Sleep so the round lasts ``minimum`` seconds: its end then says nothing about its work."""
    left = minimum - (time.perf_counter() - started)
    if left > 0:
        time.sleep(left)


def _with_diagnostics(
    outcome: RoundOutcome,
    requests: Mapping[str, GradientRequest],
    exchange: Exchange,
    checked: RoundReplies,
    times: tuple[float, float],
) -> RoundOutcome:
    """Attach the facts that depend on stage 2 or on private values (an opt-in in private runs)."""
    from dataclasses import replace

    norms = np.array([x for a in checked.accepted for x in a.post_clip_norms])
    clip = outcome.clip
    at_bound = (
        None if clip is None or not norms.size else float(np.mean(norms >= clip * (1 - 1e-5)))
    )
    quantiles = {q: float(np.quantile(norms, q)) for q in (0.5, 0.9, 0.99)} if norms.size else None
    started, received = times
    now = time.perf_counter()
    diagnostics = RoundDiagnostics(
        tasks_requested=sum(len(r.task_ids) for r in requests.values()),
        tasks_received=sum(a.n_tasks for a in checked.accepted),
        norm_violations=sum(a.norm_violations for a in checked.accepted),
        nonfinite=sum(a.nonfinite for a in checked.accepted),
        clipped_fraction=at_bound,
        norm_quantiles=quantiles,
        round_seconds=now - started,
        aggregation_seconds=now - received,
        compute_seconds_per_task=tuple(
            a.compute_seconds / a.n_tasks
            for a in checked.accepted
            if a.compute_seconds is not None and a.n_tasks
        ),
        replies_accepted=len(checked.accepted),
        failures=all_failures(exchange, checked),
        stray_replies=dict(exchange.stray_replies),
    )
    return replace(outcome, diagnostics=diagnostics)
