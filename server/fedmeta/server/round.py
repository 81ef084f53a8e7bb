"""One round of a federation as a pipeline, free of Flower: ``run_round(session, state, index)``.

1. **Budget check.** If spending the planned round would exceed the budget, stop: nothing is run.
2. **Sample.** Stage 1 draws ``n1`` participants, stage 2 tasks inside each, with the
   ``TwoStageSampler`` executing the very scheme object that the accounted event holds.
3. **Request.** Every stage-1 participant is sent the meta-parameters and its task ids (an empty
   list when it drew none), so who is contacted reveals nothing about stage 2.
4. **Validate.** Structural problems drop a reply; value problems are neutralised and counted
   (server/fedmeta/server/validation.py). Missing, late and malformed replies never stop a round.
5. **Pad, then spend.** The round waits until ``federation.round_min_seconds`` have passed since
   it started (the work before depends on the stage-2 count), then ``ledger.spend(event, run_id,
   round)`` records the round durably *before* anything is released; if another run spent the
   rest meanwhile it raises and nothing is released. What follows the spend (sum, noise, step)
   costs the same whatever was sampled.
6. **Noise and step.** Sum the accepted contributions, add ``N(0, (zC)^2 I)`` on the release grid
   (server/fedmeta/server/noise.py), divide by the public normaliser, and take the optimizer step.
   With adaptive
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedmeta.accounting import (
    BudgetExhausted,
    BudgetLedger,
    TwoStageSampler,
    next_clip,
    noisy_fraction,
)
from fedmeta.config import TrainingConfig
from fedmeta.protocol import GradientReply, GradientRequest, ReplyFormat
from fedmeta.server.noise import NoiseSource, noised_release, noised_sum
from fedmeta.server.operator_log import log_failures
from fedmeta.server.optimizer import learning_rate, make_optimizer
from fedmeta.server.plan import RunPlan
from fedmeta.server.releases import split_failures
from fedmeta.server.report import RoundDiagnostics, RoundOutcome
from fedmeta.server.subspace import PublicSubspace
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


@dataclass
class RoundSession:
    """What every round of a run shares: the plan, the sampler, the ledger, the transport."""

    run_id: str
    federation_id: str
    plan: RunPlan
    task_counts: Mapping[str, int]  # private under add/remove: used to sample, never released
    sampler: TwoStageSampler
    transport: Transport
    config_json: str
    dim: int
    reply_format: ReplyFormat
    tolerance: float
    diagnostics: bool
    round_min_seconds: float = 0.0
    ledger: BudgetLedger | None = None
    noise: NoiseSource | None = None
    #: Set by SIGINT/SIGTERM: a round not yet spent is abandoned (RoundAbandoned); one spent goes
    #: on to its release, since the ledger already counts it.
    stop: threading.Event | None = None
    #: ``privacy.subspace``: the release is noised in a public subspace (server/subspace.py).
    subspace: PublicSubspace | None = None


def run_round(session: RoundSession, state: TrainingState, index: int) -> RoundOutcome | None:
    """Run round ``index`` (0-based); None when the budget does not allow it (nothing happened)."""
    started = time.perf_counter()
    plan = session.plan
    if plan.private and session.ledger.would_exceed(plan.event):  # type: ignore[union-attr,arg-type]
        return None
    clip = _round_clip(session, state)
    if session.subspace is not None:  # public data and the released model only: before the rest
        session.subspace.at(state.params, index)
    sample = session.sampler.sample(session.task_counts)
    requests = _requests(session, state, index, sample, clip)
    exchange = session.transport(requests)  # returns early on a stop request (server/transport)
    checked = validate_round(
        {pid: d.reply for pid, d in exchange.deliveries.items() if d.reply is not None},
        _expectations(session, index, requests, clip),
    )
    # Pad before the spend: the spend's time (kept in the ledger) and everything after it then
    # follow the public minimum, not this round's stage-2 work; the spend still precedes the noise.
    _pad(started, session.round_min_seconds)
    received = time.perf_counter()
    # The last moment to stop without a trace: after it come the spend and the release, no wait.
    if session.stop is not None and session.stop.is_set():
        raise RoundAbandoned(f"round {index + 1} abandoned before its spend: stop requested")
    position = _spend(session, index)
    if plan.private and position is None:
        return None
    update, noise_std, count = _aggregate(session, checked, clip)
    if plan.adaptive is not None:  # the optimizer's noise correction follows the round's C
        assert noise_std is not None
        state.set_noise_variance((noise_std / plan.normaliser) ** 2)
    state.step(update, index)
    if plan.adaptive is not None:
        assert clip is not None and count is not None
        state.clip = _next_clip(session, clip, count)
    outcome = _outcome(session, index, exchange, checked, position, noise_std, clip)
    log_failures(session.run_id, index + 1, _named_failures(exchange, checked))  # operator only
    if not session.diagnostics:
        return outcome
    return _with_diagnostics(outcome, requests, exchange, checked, (started, received))


def _round_clip(session: RoundSession, state: TrainingState) -> float | None:
    """This round's bound: the plan's fixed C, or adaptive clipping's current ``C_t``."""
    plan = session.plan
    if plan.adaptive is None:
        return plan.clip
    return plan.adaptive.initial_clip if state.clip is None else float(state.clip)


def _next_clip(session: RoundSession, clip: float, noisy_count: float) -> float:
    """``C_{t+1}`` from the released noisy count and public constants only (post-processing)."""
    plan = session.plan
    a = plan.adaptive
    assert a is not None
    fraction = noisy_fraction(noisy_count, plan.normaliser)
    return next_clip(clip, fraction, a.target_quantile, a.learning_rate, (a.min_clip, a.max_clip))


def _requests(
    session: RoundSession,
    state: TrainingState,
    index: int,
    sample: Mapping[str, list[int]],
    clip: float | None,
) -> dict[str, GradientRequest]:
    params = state.flat()
    return {
        pid: GradientRequest(
            session.run_id, index, tuple(task_ids), clip, params, session.config_json
        )  # fmt: skip
        for pid, task_ids in sample.items()
    }


def _expectations(
    session: RoundSession, index: int, requests: Mapping[str, GradientRequest], clip: float | None
) -> dict[str, Expectation]:
    bits = session.plan.adaptive is not None
    return {
        pid: Expectation(
            session.run_id,
            index,
            pid,
            req.task_ids,
            session.dim,
            clip,
            session.reply_format,
            session.tolerance,
            bits,
        )  # fmt: skip
        for pid, req in requests.items()
    }


def _spend(session: RoundSession, index: int) -> int | None:
    """Record the round; its ledger position, or None if the budget ran out meanwhile."""
    if not session.plan.private:
        return None
    assert session.ledger is not None and session.plan.event is not None
    try:
        session.ledger.spend(session.plan.event, session.run_id, index)
    except BudgetExhausted:
        return None  # another run on the same ledger spent the rest: nothing is released
    return session.ledger.position()


def centred_count(checked: RoundReplies) -> float:
    """``sum_i (b_i - 1/2)`` over the accepted tasks: sensitivity 1/2 under add/remove.

    Centring is what makes the count's sensitivity half the clip's share
    (accounting/fedmeta/accounting/adaptive.py);
    a dropped reply or task contributes 0 to both the count and the sum.
    """
    return float(sum(a.under_clip - a.n_tasks / 2 for a in checked.accepted))


def _aggregate(
    session: RoundSession, checked: RoundReplies, clip: float | None
) -> tuple[Tensor, float | None, float | None]:
    """The update (noisy sum over the public normaliser, or the plain mean), its noise, the count.

    The count is the released noisy centred count of clip bits (adaptive clipping), else None.
    With a subspace the sum's ``k`` coordinates in it are released, noised at its sensitivity,
    and mapped back; the residual is dropped (server/fedmeta/server/subspace.py).
    """
    basis = None if session.subspace is None else session.subspace.current
    total = torch.zeros(session.dim, dtype=torch.float64)
    for accepted in checked.accepted:
        total += accepted.grad_sum
    plan = session.plan
    if not plan.private:
        mean = total / max(sum(a.n_tasks for a in checked.accepted), 1)
        return (mean if basis is None else basis.restrict(mean)), None, None
    assert plan.event is not None and clip is not None and session.noise is not None
    sensitivity = clip
    if basis is not None:
        total, sensitivity = basis.project(total, clip, plan.normaliser * clip)
    if plan.adaptive is None:
        released = noised_sum(total, clip=sensitivity, event=plan.event, source=session.noise)
        value, noise_std, count = released.value, released.noise_std, None
    else:
        joint = noised_release(
            total, centred_count(checked), clip=sensitivity, event=plan.event,
            count_noise=plan.adaptive.count_noise, source=session.noise,
        )  # fmt: skip
        value, noise_std, count = joint.value, joint.noise_std, joint.count
    if basis is not None:
        value = basis.lift(value)
    return value / plan.normaliser, noise_std, count


def _outcome(
    session: RoundSession,
    index: int,
    exchange: Exchange,
    checked: RoundReplies,
    position: int | None,
    noise_std: float | None,
    clip: float | None,
) -> RoundOutcome:
    failures = all_failures(exchange, checked)
    private = session.plan.private
    split = split_failures(failures, private=private)
    sampled = len(exchange.deliveries)
    return RoundOutcome(
        run_id=session.run_id,
        federation_id=session.federation_id,
        round=index + 1,
        participants_registered=len(session.task_counts),
        participants_sampled=sampled,
        # Private: sampled participants whose node was available
        # (server/fedmeta/server/releases.py).
        participants_replied=sampled - split.released_count if private else len(checked.accepted),
        participants_failed=split.released_count,
        failures=dict(split.released),
        stray_replies={} if private else dict(exchange.stray_replies),
        ledger_position=position,
        noise_std=noise_std,
        clip=clip,
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
