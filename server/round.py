"""The federation's round loop: register, check budget, sample, request, validate, spend, noise.

It takes a Flower ``Grid`` (the real one in simulation or deployment, a fake one in tests), so the
whole protocol is testable without Ray. One round (private mode):

1. ``ledger.would_exceed(event)`` -> stop with ``budget_exhausted`` (the round is not run);
2. sample participants then tasks with the ``TwoStageSampler`` executing the *same* scheme object
   that the accounted ``GaussianRound`` event holds;
3. send each sampled participant the flat float32 meta-parameters, its task ids, C, the inner-loop
   settings, the run id and the round id (``train`` messages, per-round timeout);
4. validate every reply (``server/validation.py``); missing / late / malformed replies do not stop
   the round;
5. ``ledger.spend(event, run_id, round)`` FIRST (raises before anything is released), then sum the
   clipped gradients, add ``N(0, (zC)^2 I)`` (``server/noise.py``), divide by the *expected* number
   of tasks per round (a public constant), and take an Adam step;
6. every k rounds: validation on held-out tasks and a checkpoint; at the end a final checkpoint and
   a test evaluation with a 95% confidence interval.

Resume rule (the ledger is the source of truth for spends): a round whose spend is in the ledger is
spent, whether or not its update reached a checkpoint. On resume the run continues from its
checkpoint's model, and the next round index is one past the larger of the checkpoint's last round
and the ledger's last spend for this run: a round index is never spent twice, and rounds whose
update was lost count as completed (their privacy cost is paid). When rounds were lost the sampler
is reseeded from a fresh secret instead of replaying the checkpointed RNG state (replaying would
reuse the lost rounds' samples). A private run never checkpoints its sampler state at all (it is as
secret as the noise) and always reseeds on resume.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedmeta import protocol as P
from fedmeta.config import Config, default_federation_id
from server import privacy as priv
from server.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from server.noise import NoiseSource, noised_sum
from server.report import RoundReport, RunFinished, RunObserver, RunStarted
from server.validation import Expectation, RoundReplies, validate_round

log = logging.getLogger("fedmeta.server")

STOP_PLANNED = "planned_rounds"
STOP_BUDGET = "budget_exhausted"
STOP_NO_PARTICIPANTS = "no_participants"


class FederationError(RuntimeError):
    """The federation cannot proceed (e.g. too few participants registered)."""


def refuse_to_overwrite_run(out_dir: Path, resume: bool) -> None:
    """Raise ``FederationError`` if a fresh run would overwrite the run recorded in ``out_dir``.

    A new run writes its initial checkpoint at once, which would replace the trained model of the
    run already there; nothing is written before this check.
    """
    existing = Path(out_dir) / CHECKPOINT_NAME
    if not resume and existing.is_file():
        raise FederationError(
            f"{out_dir} already holds a run's checkpoint ({existing.name}); continue that run with "
            "--resume, or give a new output directory with --out"
        )


@dataclass
class RunState:
    """Mutable state of one run (what a checkpoint captures)."""

    run_id: str
    params: torch.Tensor
    optimizer_state: dict[str, Any] | None
    next_round: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    sampler_state: Any = None
    lost_rounds: list[int] = field(default_factory=list)


@dataclass
class RunResult:
    """What ``run_federation`` returns (and ``summary.json`` holds)."""

    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    out_dir: Path


def _safe(observers: Sequence[RunObserver], method: str, event: Any) -> None:
    for obs in observers:
        try:
            getattr(obs, method)(event)
        except Exception:  # noqa: BLE001 - a failing sink must never stop a private run
            log.exception("observer %r failed in %s", obs, method)


def _ensure_task_identity() -> None:
    """Set a task identity: Flower's Message constructor reads it; a fake grid may not set it."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        if getattr(TaskIdentity, name) is None:
            setattr(TaskIdentity, name, 0)


class RoundLoop:
    """One federation run over a Grid. ``run()`` returns a :class:`RunResult`."""

    def __init__(
        self,
        cfg: Config,
        grid: Any,
        *,
        out_dir: str | Path | None = None,
        resume: bool = False,
        observers: Iterable[RunObserver] = (),
    ) -> None:
        self.cfg = cfg
        self.grid = grid
        self.out_dir = Path(out_dir or cfg.output.dir)
        self.resume = resume
        self.observers = list(observers)
        self.federation_id = default_federation_id(cfg)
        self.private = cfg.privacy.enabled
        self.test_seed = cfg.privacy.insecure_test_seed
        self.announce: Any = lambda text: log.info("%s", text)

    # ----------------------------------------------------------------------------------------------
    # registration

    def register(self) -> tuple[dict[str, int], dict[str, int]]:
        """Ask every node for its participant id and task count; return (task_counts, pid->node)."""
        cfg = self.cfg
        want = cfg.federation.participants
        deadline = time.monotonic() + cfg.federation.register_timeout_s
        nodes = list(self.grid.get_node_ids())
        while len(nodes) < want and time.monotonic() < deadline:
            time.sleep(0.2)
            nodes = list(self.grid.get_node_ids())
        if not nodes:
            raise FederationError(
                "no participant node connected before federation.register_timeout_s"
            )
        content = ConfigRecord({P.RUN_ID: self.run_id, "config_json": cfg.model_dump_json()})
        msgs = [
            Message(
                RecordDict({P.REGISTER_REQUEST: content}),
                int(n),
                P.MSG_REGISTER,
                group_id="register",
            )
            for n in nodes
        ]
        replies = list(self.grid.send_and_receive(msgs, timeout=cfg.federation.register_timeout_s))
        counts: dict[str, int] = {}
        node_of: dict[str, int] = {}
        for msg in replies:
            if msg.has_error():
                log.warning(
                    "registration error from node %s: %s",
                    msg.metadata.src_node_id,
                    msg.error.reason,
                )
                continue
            rec = msg.content.config_records.get(P.REGISTER_REPLY)
            if rec is None or P.PARTICIPANT_ID not in rec or P.TASK_COUNT not in rec:
                log.warning("malformed registration from node %s", msg.metadata.src_node_id)
                continue
            pid, count = str(rec[P.PARTICIPANT_ID]), rec[P.TASK_COUNT]
            if not isinstance(count, int) or count < 1 or pid in counts:
                log.warning("rejected registration of participant %r (count %r)", pid, count)
                continue
            counts[pid] = int(count)
            node_of[pid] = int(msg.metadata.src_node_id)
        if len(counts) < cfg.sampling.participants_per_round:
            raise FederationError(
                f"{len(counts)} participants registered; sampling.participants_per_round needs "
                f">= {cfg.sampling.participants_per_round}"
            )
        # Deterministic order (sorted numerically when ids are numbers).
        order = sorted(counts, key=lambda s: (0, int(s)) if s.isdigit() else (1, s))
        return {p: counts[p] for p in order}, {p: node_of[p] for p in order}

    # ----------------------------------------------------------------------------------------------
    # the run

    def run(self) -> RunResult:  # noqa: C901 - the protocol, step by step
        """Run the federation to ``planned_rounds`` or ``budget_exhausted``."""
        from client.workload import build_model, held_out_tasks, initial_params, workload

        _ensure_task_identity()
        cfg = self.cfg
        refuse_to_overwrite_run(self.out_dir, self.resume)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        ckpt = load_checkpoint(self.out_dir) if self.resume else None
        if self.resume and ckpt is None:
            log.warning("--resume: no checkpoint in %s; starting a new run", self.out_dir)
        self.run_id = str(ckpt["run_id"]) if ckpt else uuid.uuid4().hex[:12]

        task_counts, node_of = self.register()
        self.task_counts = task_counts
        metric = workload(cfg).metric
        model = build_model(cfg)
        dim = int(initial_params(cfg, model).numel())
        exp_tasks = priv.expected_tasks(cfg, task_counts)

        # --- privacy plan -------------------------------------------------------------------------
        scheme = priv.make_scheme(cfg, task_counts)
        z: float | None = None
        event: Any = None
        ledger: Any = None
        plan_info: dict[str, Any] = {}
        if self.private:
            calibrated = cfg.privacy.noise_multiplier is None
            if ckpt is not None and ckpt.get("noise_multiplier"):
                z = float(ckpt["noise_multiplier"])  # the resumed run keeps its noise level
                calibrated = bool(ckpt.get("noise_calibrated", False))
            elif calibrated:
                target = cfg.privacy.target_epsilon or cfg.privacy.epsilon_budget
                z = priv.calibrate_z(cfg, scheme, cfg.rounds, target)
            else:
                z = float(cfg.privacy.noise_multiplier)  # type: ignore[arg-type]
            event = priv.make_event(cfg, scheme, z, task_counts)
            ledger = priv.open_ledger(cfg, self.out_dir, self.federation_id)
            plan_info = self._plan(ledger, event, z, calibrated, exp_tasks)
        self.plan_info = plan_info
        from server.outputs import format_plan

        self.announce(
            format_plan(
                plan_info,
                self.private,
                {
                    "dataset": cfg.dataset.name,
                    "participants": len(task_counts),
                    "participants_per_round": cfg.sampling.participants_per_round,
                    "stage2": cfg.sampling.stage2,
                    "rounds": cfg.rounds,
                },
            )
        )

        # --- state: fresh or resumed --------------------------------------------------------------
        state = self._initial_state(ckpt, cfg, model, ledger)
        params = state.params.clone().requires_grad_(True)
        opt = torch.optim.Adam([params], lr=cfg.training.meta_lr)
        if state.optimizer_state is not None:
            opt.load_state_dict(state.optimizer_state)
        sampler_seed = None
        if self.test_seed is not None:
            sampler_seed = int(
                np.random.SeedSequence([self.test_seed, state.next_round]).generate_state(1)[0]
            )
        sampler = priv.make_sampler(scheme, sampler_seed, state.sampler_state)
        try:
            # The accounted stage-2 rate assumes every participant holds >= min_tasks tasks.
            sampler.check_task_counts(task_counts)
        except ValueError as error:
            raise FederationError(
                f"the registered task counts do not fit the accounted scheme: {error}"
            ) from error
        noise_seed = None if self.test_seed is None else self.test_seed * 7919 + state.next_round
        noise = NoiseSource.create(noise_seed)
        if self.private and not noise.secure:
            log.warning(
                "INSECURE: noise and sampling use insecure_test_seed (tests only, not private)"
            )

        val_tasks = held_out_tasks(cfg, "validation", cfg.dataset.validation_tasks)
        probe_tasks = (
            held_out_tasks(cfg, "probe", cfg.dataset.probe_tasks)
            if cfg.dataset.probe_tasks
            else None
        )

        spends_this_run = priv.run_spends(ledger, self.run_id) if ledger is not None else []
        rounds_completed = len(spends_this_run) if self.private else state.next_round
        eps_task = priv.ledger_epsilon(ledger) if ledger is not None else None
        eps_part = priv.ledger_epsilon(ledger, "participant") if ledger is not None else None
        started = RunStarted(
            run_id=self.run_id,
            federation_id=self.federation_id,
            private=self.private,
            epsilon_budget=cfg.privacy.epsilon_budget if self.private else None,
            delta=cfg.privacy.delta if self.private else None,
            noise_multiplier=z,
            clip=cfg.privacy.clip if self.private else None,
            planned_rounds=cfg.rounds,
            rounds_affordable=plan_info.get("rounds_affordable"),
            epsilon_spent_task=eps_task or 0.0,
            epsilon_spent_participant=eps_part or 0.0,
            participants_registered=len(task_counts),
            metric_name=metric,
        )
        _safe(self.observers, "run_started", started)
        self._save(
            state, params, opt, sampler, ledger, z
        )  # run id recoverable from the first moment

        stopped = STOP_PLANNED
        last_val: float | None = state.rows[-1].get("validation_metric") if state.rows else None
        for r_prev in reversed(state.rows):
            if r_prev.get("validation_metric") is not None:
                last_val = r_prev["validation_metric"]
                break
        r = state.next_round
        while r < cfg.rounds:
            t_round = time.perf_counter()
            # 1. budget check (dry run)
            if self.private and ledger.would_exceed(event):
                stopped = STOP_BUDGET
                log.info("round %d not run: budget exhausted", r)
                break
            # 2. sampling: same scheme object as the accounted event
            sample = sampler.sample(task_counts)
            # 3. requests
            flat = params.detach().to(torch.float32).contiguous()
            weights = ArrayRecord({P.PARAMS: Array(flat.numpy())})
            msgs: list[Message] = []
            expectations: dict[int, Expectation] = {}
            tasks_requested = 0
            for pid, ids in sample.items():
                ids = [int(t) for t in ids]
                if not ids:
                    continue  # nothing to ask; the participant was sampled but drew no task
                tasks_requested += len(ids)
                node = node_of[pid]
                req = ConfigRecord(
                    {
                        P.RUN_ID: self.run_id,
                        P.ROUND_ID: r,
                        P.TASK_IDS: ids,
                        P.CLIP: float(cfg.privacy.clip) if self.private else 0.0,
                        P.PRIVATE: self.private,
                        P.INNER_STEPS: cfg.training.inner_steps,
                        P.INNER_LR: cfg.training.inner_lr,
                        P.FIRST_ORDER: cfg.training.first_order,
                        P.REPLY_FORMAT: cfg.federation.reply_format,
                        P.PARAM_DIM: dim,
                        "config_json": cfg.model_dump_json(),
                    }
                )
                msgs.append(
                    Message(
                        RecordDict({P.WEIGHTS: weights, P.REQUEST: req}),
                        node,
                        P.MSG_TRAIN,
                        group_id=str(r),
                    )
                )
                expectations[node] = Expectation(
                    run_id=self.run_id,
                    round_id=r,
                    participant_id=pid,
                    task_ids=tuple(ids),
                    dim=dim,
                    clip=float(cfg.privacy.clip) if self.private else math.inf,
                    reply_format=cfg.federation.reply_format,
                    tolerance=cfg.privacy.clip_tolerance,
                )
            t_sent = time.perf_counter()
            replies = (
                list(self.grid.send_and_receive(msgs, timeout=cfg.federation.round_timeout_s))
                if msgs
                else []
            )
            t_recv = time.perf_counter()
            # 4. validation
            checked: RoundReplies = validate_round(replies, expectations)
            for rej in checked.rejected:
                log.warning(
                    "round %d: dropped reply of participant %s: %s (%s)",
                    r,
                    rej.participant_id,
                    rej.reason,
                    rej.detail,
                )
            # 5. spend FIRST, then aggregate and release
            spends_recorded = None
            if self.private:
                try:
                    ledger.spend(event, self.run_id, r)
                except priv.budget_exhausted_error() as error:
                    # Another run on the same ledger spent the rest meanwhile: nothing was recorded
                    # and nothing is released.
                    log.info("round %d not run: %s", r, error)
                    stopped = STOP_BUDGET
                    break
                spends_this_run.append(r)
                spends_recorded = ledger.position()
            update, received, noise_std = aggregate(
                checked.accepted, dim=dim, private=self.private, clip=cfg.privacy.clip, event=event,
                source=noise, expected_tasks=exp_tasks,
            )  # fmt: skip
            opt.zero_grad(set_to_none=True)
            params.grad = update.to(params.dtype)
            opt.step()
            rounds_completed = len(spends_this_run) if self.private else r + 1
            agg_seconds = time.perf_counter() - t_recv
            # 6. evaluation, accounting report, checkpoint
            loss = None
            if probe_tasks is not None:
                loss = self._evaluate(model, params, probe_tasks).mean
            val = None
            is_eval = (r + 1) % cfg.training.eval_every == 0 or r + 1 == cfg.rounds
            if is_eval:
                val = self._evaluate(model, params, val_tasks).mean
                last_val = val
            is_report = is_eval or (r + 1) % cfg.privacy.report_every == 0
            if self.private and is_report:
                eps_task = priv.ledger_epsilon(ledger)
                eps_part = priv.ledger_epsilon(ledger, "participant")
            diag = self.private is False or cfg.metrics.private_diagnostics
            # With Poisson stage 2 the realised number of sampled tasks depends on which tasks exist
            # (the very count the note forbids normalising by), and it is not accounted: like the
            # clip diagnostics it leaves the server only in non-private runs or on opt-in.
            shown_requested = tasks_requested if diag else None
            shown_received = received if diag else None
            n_rows = sum(len(a.post_clip_norms) for a in checked.accepted)
            clipped_fraction = None
            quantiles = None
            if diag and n_rows and self.private:
                clipped_fraction = sum(a.clipped_rows for a in checked.accepted) / n_rows
                allnorms = np.array([x for a in checked.accepted for x in a.post_clip_norms])
                quantiles = {q: float(np.quantile(allnorms, q)) for q in (0.5, 0.9, 0.99)}
            compute_times = tuple(
                a.compute_seconds / max(a.n_tasks, 1)
                for a in checked.accepted
                if a.compute_seconds is not None
            )
            round_seconds = time.perf_counter() - t_round
            row = {
                "round": r + 1,
                "participants_sampled": len(sample),
                "participants_replied": len(checked.accepted),
                "participants_failed": len(checked.rejected),
                "tasks_requested": shown_requested,
                "tasks_received": shown_received,
                "norm_violations": sum(
                    a.norm_violations + a.nonfinite_rows for a in checked.accepted
                ),
                "epsilon": eps_task if is_report else None,
                "epsilon_participant": eps_part if is_report else None,
                "loss": loss,
                "validation_metric": val,
                "round_seconds": round_seconds,
                "server_overhead_seconds": (time.perf_counter() - t_round) - (t_recv - t_sent),
            }
            state.rows.append(row)
            _safe(
                self.observers,
                "round_finished",
                RoundReport(
                    run_id=self.run_id,
                    federation_id=self.federation_id,
                    round_index=r + 1,
                    participants_registered=len(task_counts),
                    participants_sampled=len(sample),
                    participants_replied=len(checked.accepted),
                    participants_failed=len(checked.rejected),
                    tasks_requested=shown_requested,
                    tasks_received=shown_received,
                    rejected_by_reason=checked.rejected_by_reason(),
                    train_loss=loss,
                    validation_metric=last_val,
                    epsilon_spent_task=eps_task if is_report else None,
                    epsilon_spent_participant=eps_part if is_report else None,
                    rounds_affordable=(
                        int(ledger.rounds_affordable(event)) if self.private and is_report else None
                    ),
                    spends_recorded=spends_recorded,
                    noise_std=noise_std,
                    clip=cfg.privacy.clip if self.private else None,
                    clipped_fraction=clipped_fraction,
                    pre_clip_norm_quantiles=quantiles,
                    round_seconds=round_seconds,
                    aggregation_seconds=agg_seconds,
                    client_compute_seconds_per_task=compute_times,
                ),
            )
            r += 1
            state.next_round = r
            if r % cfg.training.checkpoint_every == 0:
                self._save(state, params, opt, sampler, ledger, z)

        # --- end ----------------------------------------------------------------------------------
        self._save(state, params, opt, sampler, ledger, z)
        test_tasks = held_out_tasks(cfg, "test", cfg.dataset.test_tasks)
        final = self._evaluate(model, params, test_tasks, with_pre=True)
        ci = (final.mean - final.ci95, final.mean + final.ci95)
        if self.private:
            eps_task = priv.ledger_epsilon(ledger)
            eps_part = priv.ledger_epsilon(ledger, "participant")
            rounds_completed = len(spends_this_run)
        else:
            rounds_completed = state.next_round
        _safe(
            self.observers,
            "run_finished",
            RunFinished(
                run_id=self.run_id,
                federation_id=self.federation_id,
                rounds_completed=rounds_completed,
                stopped_reason=stopped,
                epsilon_spent_task=eps_task,
                epsilon_spent_participant=eps_part,
                final_metric=final.mean,
                final_metric_ci95=ci,
            ),
        )
        summary = {
            "mode": "private" if self.private else "NON-PRIVATE (no clipping, no noise, no ledger)",
            "private": self.private,
            "run_id": self.run_id,
            "federation_id": self.federation_id,
            "rounds_planned": cfg.rounds,
            "rounds_completed": rounds_completed,
            "rounds_lost_on_resume": state.lost_rounds,
            "stopped_reason": stopped,
            "epsilon_spent": eps_task,
            "epsilon_participant_level": eps_part,
            "participant_level_note": priv.participant_level_note(cfg) if self.private else None,
            "epsilon_spent_this_run_rounds": len(spends_this_run) if self.private else None,
            "delta": cfg.privacy.delta if self.private else None,
            "epsilon_budget": cfg.privacy.epsilon_budget if self.private else None,
            "noise_multiplier": z,
            "noise_calibrated": plan_info.get("noise_calibrated"),
            "clip": cfg.privacy.clip if self.private else None,
            "noise_secure": noise.secure if self.private else None,
            "expected_tasks_per_round": exp_tasks,
            "participants_registered": len(task_counts),
            "participants_per_round": cfg.sampling.participants_per_round,
            "task_counts_public": True,
            "metric": metric,
            "final_metric": final.mean,
            "final_metric_ci95": list(ci),
            "final_metric_ci95_halfwidth": final.ci95,
            "final_metric_pre_adaptation": final.pre_adaptation_mean,
            "test_tasks": final.n_tasks,
            "untrained_metric": self._untrained_metric(model, test_tasks),
            "ledger_records": ledger.position() if ledger is not None else None,
            "plan": plan_info,
        }
        return RunResult(summary, state.rows, self.out_dir)

    # ----------------------------------------------------------------------------------------------
    # helpers

    def _plan(
        self, ledger: Any, event: Any, z: float, calibrated: bool, exp_tasks: float
    ) -> dict[str, Any]:
        cfg = self.cfg
        before = ledger.position()
        eps_before = priv.ledger_epsilon(ledger)
        affordable = int(ledger.rounds_affordable(event))
        spent_run = len(priv.run_spends(ledger, self.run_id))
        remaining = max(cfg.rounds - spent_run, 0)
        will_run = min(remaining, affordable)
        # This run's share composed with what the ledger already holds for this federation.
        groups = priv.ledger_groups(ledger) + [(event, will_run)]
        eps_end = priv.epsilon_for(groups, cfg.privacy.delta)
        eps_end_part = priv.epsilon_for(groups, cfg.privacy.delta, unit="participant")
        return {
            "epsilon_budget": cfg.privacy.epsilon_budget,
            "delta": cfg.privacy.delta,
            "noise_multiplier": z,
            "noise_calibrated": calibrated,
            "clip": cfg.privacy.clip,
            "planned_rounds": cfg.rounds,
            "rounds_affordable": affordable,
            "rounds_to_run": will_run,
            "ledger_records_before": before,
            "epsilon_spent_before": eps_before,
            "epsilon_task_at_end": eps_end,
            "epsilon_participant_at_end": eps_end_part,
            "participant_level_note": priv.participant_level_note(cfg),
            "epsilon_tombs2022_published_at_end_NOT_VALID": priv.published_epsilon(
                event, will_run, cfg.privacy.delta
            ),
            "expected_tasks_per_round": exp_tasks,
            "participants": len(self.task_counts),
            "participants_per_round": cfg.sampling.participants_per_round,
            "stage2": cfg.sampling.stage2,
        }

    def _initial_state(
        self, ckpt: dict[str, Any] | None, cfg: Config, model: Any, ledger: Any
    ) -> RunState:
        from client.workload import initial_params

        if ckpt is None:
            return RunState(self.run_id, initial_params(cfg, model), None, 0)
        state = RunState(
            run_id=self.run_id,
            params=ckpt["params"].to(torch.float32),
            optimizer_state=ckpt["optimizer"],
            next_round=int(ckpt["next_round"]),
            rows=list(ckpt.get("rows", [])),
            sampler_state=ckpt.get("sampler_state") if self._keep_sampler_state() else None,
        )
        if ledger is not None:
            if ledger.position() < int(ckpt.get("ledger_position", 0)):
                raise FederationError(
                    f"the ledger has {ledger.position()} records but the checkpoint saw "
                    f"{ckpt['ledger_position']}: ledger truncated or replaced; refusing to resume"
                )
            spent = priv.run_spends(ledger, self.run_id)
            lost = [i for i in spent if i >= state.next_round]
            if lost:
                log.warning(
                    "resume: rounds %s were spent in the ledger but their update was not "
                    "checkpointed; they count as spent and are not re-run",
                    lost,
                )
                state.lost_rounds = lost
                state.next_round = max(lost) + 1
                state.sampler_state = None  # fresh secret RNG: never replay a lost round's sample
                for i in lost:
                    state.rows.append({"round": i + 1, "lost_on_resume": True})
        return state

    def _save(
        self,
        state: RunState,
        params: torch.Tensor,
        opt: Any,
        sampler: Any,
        ledger: Any,
        z: float | None,
    ) -> None:
        sampler_state = None
        if self._keep_sampler_state():
            try:
                sampler_state = sampler.state()
            except Exception:  # noqa: BLE001
                log.exception("sampler state not saved")
        save_checkpoint(
            self.out_dir,
            {
                "run_id": self.run_id,
                "federation_id": self.federation_id,
                "params": params.detach().clone(),
                "optimizer": opt.state_dict(),
                "next_round": state.next_round,
                "sampler_state": sampler_state,
                "config": self.cfg.to_dict(),
                "ledger_position": ledger.position() if ledger is not None else None,
                "noise_multiplier": z,
                "noise_calibrated": self.plan_info.get("noise_calibrated"),
                "rows": state.rows,
                "private": self.private,
            },
        )

    def _keep_sampler_state(self) -> bool:
        """Whether the sampler's RNG state may be written to (and replayed from) a checkpoint.

        In a private run the sampler's state is as secret as the noise: PCG64 can be stepped
        backwards, so the state in ``checkpoint.pt`` (an output file) would reveal every past
        round's sample and void the amplification by secret sampling. Such runs never store it and
        reseed from a fresh secret on resume (same sampling law). Only non-private runs and runs
        labelled insecure by ``insecure_test_seed`` keep it, for reproducible resumes.
        """
        return not self.private or self.test_seed is not None

    def _evaluate(
        self, model: Any, params: torch.Tensor, tasks: Any, with_pre: bool = False
    ) -> Any:
        from metalearning import evaluate

        cfg = self.cfg
        return evaluate(
            model,
            params.detach(),
            tasks,
            inner_steps=cfg.training.eval_inner_steps,
            inner_lr=cfg.training.inner_lr,
            device="cpu",
            chunk_size=cfg.training.chunk_size,
            with_pre_adaptation=with_pre,
        )

    def _untrained_metric(self, model: Any, tasks: Any) -> float:
        from client.workload import initial_params

        return float(self._evaluate(model, initial_params(self.cfg, model), tasks).mean)


def aggregate(
    accepted: Sequence[Any],
    *,
    dim: int,
    private: bool,
    clip: float,
    event: Any,
    source: NoiseSource,
    expected_tasks: float,
) -> tuple[torch.Tensor, int, float | None]:
    """Sum the validated clipped gradients and, if private, noise and normalise them.

    Private: add N(0,(zC)^2 I) and divide by the *expected* task count (public). Non-private: the
    plain mean over received tasks. Returns (update, received, noise std). The caller has already
    recorded the spend.
    """
    total = torch.zeros(dim, dtype=torch.float64)
    received = 0
    for acc in accepted:
        total += acc.grad_sum
        received += acc.n_tasks
    if private:
        released = noised_sum(total, clip=clip, event=event, source=source)
        return released.value / expected_tasks, received, released.noise_std
    return total / max(received, 1), received, None


def run_federation(
    cfg: Config,
    grid: Any,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    observers: Iterable[RunObserver] = (),
) -> RunResult:
    """Run one federation over ``grid`` (see :class:`RoundLoop`)."""
    return RoundLoop(cfg, grid, out_dir=out_dir, resume=resume, observers=observers).run()
