"""One round of a federation as a pipeline, free of Flower: ``run_round(session, state, index)``.

1. **Budget check.** If spending the planned round would exceed the budget, stop: nothing is run.
2. **Sample.** Stage 1 draws ``n1`` participants, stage 2 tasks inside each, with the
   ``TwoStageSampler`` executing the very scheme object that the accounted event holds.
3. **Request.** Every stage-1 participant is sent the meta-parameters and its task ids (an empty
   list when it drew none), so who is contacted reveals nothing about stage 2.
4. **Validate.** Structural problems drop a reply; value problems are neutralised and counted
   (server/validation.py). Missing, late and malformed replies never stop a round.
5. **Spend.** ``ledger.spend(event, run_id, round)`` records the round durably *before* anything is
   released; if another run spent the rest meanwhile it raises and nothing is released.
6. **Noise and step.** Sum the accepted contributions, add ``N(0, (zC)^2 I)`` on the release grid
   (server/noise.py), divide by the public normaliser, and take the optimizer step.

A non-private run skips 1, 5 and the noise, and averages over the tasks received. The result is a
:class:`~server.report.RoundOutcome`; private diagnostics are attached only where allowed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from accounting import BudgetExhausted, BudgetLedger, TwoStageSampler
from fedmeta.config import TrainingConfig
from fedmeta.protocol import GradientReply, GradientRequest
from server.noise import NoiseSource, noised_sum
from server.optimizer import learning_rate, make_optimizer
from server.plan import RunPlan
from server.report import RoundDiagnostics, RoundOutcome
from server.validation import Expectation, RoundReplies, validate_round

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


class TrainingDiverged(ValueError):
    """The meta-model left the finite floats: a step size the configuration must change."""


class TrainingState:
    """The meta-parameters and their optimizer: what a round changes."""

    def __init__(
        self,
        params: Tensor,
        training: TrainingConfig,
        *,
        noise_variance: float = 0.0,
        planned_rounds: int = 1,
        optimizer_state: dict[str, Any] | None = None,
    ) -> None:
        """The configured meta-optimizer on a flat float32 parameter vector (server/optimizer)."""
        self.params = params.detach().to(torch.float32).clone().requires_grad_(True)
        self.training = training
        self.planned_rounds = planned_rounds
        self.optimizer = make_optimizer(self.params, training, noise_variance)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)

    def step(self, update: Tensor, index: int) -> None:
        """The optimizer step of round ``index`` along ``update`` (released, normalised)."""
        rate = learning_rate(self.training, index, self.planned_rounds)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        self.optimizer.zero_grad(set_to_none=True)
        self.params.grad = update.to(self.params.dtype).reshape(self.params.shape)
        self.optimizer.step()
        # Stop here rather than send participants a model they can only answer with NaN: the round's
        # spend is recorded, the last checkpoint holds the finite model before it.
        if not bool(torch.isfinite(self.params).all()):
            raise TrainingDiverged(
                f"the meta-model became non-finite at round {index + 1}: the step is too large; "
                "lower training.meta_lr (or, with training.optimizer=adam_bc, raise "
                "training.adam_bc_floor); the rounds before it are in the ledger and the last "
                "checkpoint"
            )

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
    reply_format: str
    tolerance: float
    diagnostics: bool
    round_min_seconds: float = 0.0
    ledger: BudgetLedger | None = None
    noise: NoiseSource | None = None


def run_round(session: RoundSession, state: TrainingState, index: int) -> RoundOutcome | None:
    """Run round ``index`` (0-based); None when the budget does not allow it (nothing happened)."""
    started = time.perf_counter()
    plan = session.plan
    if plan.private and session.ledger.would_exceed(plan.event):  # type: ignore[union-attr,arg-type]
        return None
    sample = session.sampler.sample(session.task_counts)
    requests = _requests(session, state, index, sample)
    exchange = session.transport(requests)
    checked = validate_round(
        {pid: d.reply for pid, d in exchange.deliveries.items() if d.reply is not None},
        _expectations(session, index, requests),
    )
    position = _spend(session, index)
    if plan.private and position is None:
        return None
    received = time.perf_counter()
    update, noise_std = _aggregate(session, checked)
    state.step(update, index)
    outcome = _outcome(session, index, exchange, checked, position, noise_std)
    _pad(started, session.round_min_seconds)
    if not session.diagnostics:
        return outcome
    return _with_diagnostics(outcome, requests, checked, started, received)


def _requests(
    session: RoundSession, state: TrainingState, index: int, sample: Mapping[str, list[int]]
) -> dict[str, GradientRequest]:
    params = state.flat()
    return {
        pid: GradientRequest(
            session.run_id, index, tuple(task_ids), session.plan.clip, params, session.config_json
        )
        for pid, task_ids in sample.items()
    }


def _expectations(
    session: RoundSession, index: int, requests: Mapping[str, GradientRequest]
) -> dict[str, Expectation]:
    return {
        pid: Expectation(
            session.run_id,
            index,
            pid,
            req.task_ids,
            session.dim,
            session.plan.clip,
            session.reply_format,
            session.tolerance,
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


def _aggregate(session: RoundSession, checked: RoundReplies) -> tuple[Tensor, float | None]:
    """The update: noisy sum over the public normaliser (private), or the plain mean."""
    total = torch.zeros(session.dim, dtype=torch.float64)
    for accepted in checked.accepted:
        total += accepted.grad_sum
    plan = session.plan
    if not plan.private:
        received = sum(a.n_tasks for a in checked.accepted)
        return total / max(received, 1), None
    assert plan.event is not None and plan.clip is not None and session.noise is not None
    released = noised_sum(total, clip=plan.clip, event=plan.event, source=session.noise)
    return released.value / plan.normaliser, released.noise_std


def _outcome(
    session: RoundSession,
    index: int,
    exchange: Exchange,
    checked: RoundReplies,
    position: int | None,
    noise_std: float | None,
) -> RoundOutcome:
    failures: dict[str, int] = {}
    for delivery in exchange.deliveries.values():
        if delivery.failure is not None:
            failures[delivery.failure] = failures.get(delivery.failure, 0) + 1
    for reason, count in checked.rejected_by_reason().items():
        failures[reason] = failures.get(reason, 0) + count
    return RoundOutcome(
        run_id=session.run_id,
        federation_id=session.federation_id,
        round=index + 1,
        participants_registered=len(session.task_counts),
        participants_sampled=len(exchange.deliveries),
        participants_replied=len(checked.accepted),
        participants_failed=sum(failures.values()),
        failures=failures,
        stray_replies=dict(exchange.stray_replies),
        ledger_position=position,
        noise_std=noise_std,
        clip=session.plan.clip,
    )


def _pad(started: float, minimum: float) -> None:
    """Sleep so the round lasts ``minimum`` seconds: its end then says nothing about its work."""
    left = minimum - (time.perf_counter() - started)
    if left > 0:
        time.sleep(left)


def _with_diagnostics(
    outcome: RoundOutcome,
    requests: Mapping[str, GradientRequest],
    checked: RoundReplies,
    started: float,
    received: float,
) -> RoundOutcome:
    """Attach the facts that depend on stage 2 or on private values (an opt-in in private runs)."""
    from dataclasses import replace

    norms = np.array([x for a in checked.accepted for x in a.post_clip_norms])
    clip = outcome.clip
    at_bound = (
        None if clip is None or not norms.size else float(np.mean(norms >= clip * (1 - 1e-5)))
    )
    quantiles = {q: float(np.quantile(norms, q)) for q in (0.5, 0.9, 0.99)} if norms.size else None
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
    )
    return replace(outcome, diagnostics=diagnostics)
