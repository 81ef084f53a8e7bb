"""Run outputs: the printed plan and summary, ``summary.json``, ``rounds.csv`` (plots: plots.py).

Every file is derived from the run's records (:class:`~server.report.RoundOutcome`, the plan and the
final evaluation), so they cannot disagree. Non-private runs are labelled NON-PRIVATE in each. In a
private run the CSV has the private-diagnostic columns only when ``metrics.private_diagnostics`` is
on; the summary holds no task count and nothing computed from one (docs/privacy.md, "What a run
releases"). Files are written atomically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from fedmeta.accounting import Ledger
from fedmeta.adaptation import adaptation_summary
from fedmeta.checkpoint import atomic_write_bytes
from fedmeta.config import Config
from fedmeta.seen import seen_line
from fedmeta.server.marks import marks
from fedmeta.server.noise import RESIDUAL_PER_COORDINATE, float_residual
from fedmeta.server.plan import BudgetForecast, PrivatePlan, RunPlan
from fedmeta.server.plots import PLOT_FILES, write_plots
from fedmeta.server.report import RoundOutcome
from fedmeta.server.rounds_csv import write_rounds_csv
from fedmeta.server.sample_plan import level_label, sample_plan_lines, sample_summary
from fedmeta.server.starting import (
    StartingModel,
    model_start_fields,
    starting_fields,
    starting_metric_of,
)
from fedmeta.server.subspace import subspace_line, subspace_summary


def _e(x: Any, fmt: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, fmt)


def _participant_eps(value: Any, note: str | None) -> str:
    return note if note else f"epsilon {_e(value)}"


def _participant_summary(s: Mapping[str, Any]) -> str:
    """The summary's participant-level epsilon; its note is the plan's (printed once a run)."""
    note = s["participant_level_note"]
    if not note:
        return f"epsilon {_e(s['epsilon_participant_level'])}"
    return f"{note.partition(':')[0]} (the plan says why; participant_level_note in summary.json)"


def format_plan(
    plan: RunPlan,
    fc: BudgetForecast | None,
    cfg: Config,
    participants: int,
    coordinates: int | None = None,
) -> str:
    """The privacy plan, printed before training (``coordinates``: noisy values per round)."""
    lines = [
        "== fedmeta federation plan ==",
        f"dataset {cfg.dataset.name} | participants {participants} "
        f"({plan.scheme.participants_per_round} per round, stage 2 {cfg.sampling.stage2}) | "
        f"planned rounds {plan.planned_rounds}",
    ]
    if cfg.privacy.experiment:
        lines.append(experiment_line(cfg.privacy.experiment))
    lines += _model_start_lines(cfg)
    p = plan.privacy
    if p is None or fc is None:
        lines.append("mode: NON-PRIVATE baseline - no clipping, no noise, ledger not touched; "
                     "NO privacy guarantee")  # fmt: skip
        return "\n".join(lines)
    calibrated = (
        f" (calibrated so the planned rounds spend the "
        f"{'budget' if cfg.privacy.target_epsilon is None else 'target'})"
        if p.noise_calibrated
        else ""
    )
    lines += [
        f"mode: private ({level_label(p.event)} DP, {plan.neighbouring} neighbours, PLD "
        "accounting, enforced by the ledger)",
        f"budget of the data: epsilon {_e(p.epsilon_budget, 'g')}, delta "
        f"{_e(p.delta, 'g')} | {_target(cfg)} | clip C = {_e(p.clip, 'g')}",
        f"noise multiplier z = {_e(p.noise_multiplier, '.4f')}{calibrated}",
        *_adaptive_lines(p),
        *sample_plan_lines(p.event, cfg),
        f"normaliser of the noisy sum (public): {_e(plan.normaliser, '.2f')}",
        f"ledger before this run: {fc.ledger_records_before} spends | this run's own epsilon so "
        f"far {_e(fc.epsilon_spent_before)} (what its data spent before stays the operator's)",
        f"rounds affordable: {fc.rounds_affordable} | rounds this run will run: {fc.rounds_to_run}",
        f"at the planned end: {level_label(p.event)} epsilon {_e(fc.epsilon_task_at_end)} "
        f"(delta {_e(p.delta, 'g')})",
        "participant-level epsilon at the planned end: "
        + _participant_eps(fc.epsilon_participant_at_end, p.participant_level_note),
    ]
    if coordinates is not None:
        released = coordinates * (fc.ledger_records_before + fc.rounds_to_run)
        eps, delta = implemented_guarantee(fc.epsilon_task_at_end, p.delta, released)
        lines.append(f"with the floating-point residual (docs/privacy.md): epsilon {_e(eps, '.4f')}"
                     f" at delta {_e(delta, '.4g')} - the implemented noise is not exactly "
                     "Gaussian, so its guarantee is a little above the accountant's, which the "
                     "ledger holds to the budget")  # fmt: skip
    if fc.epsilon_theorem3_at_end is not None:
        lines.append(f"(Tombs et al. 2022 Thm 3 as published: {_e(fc.epsilon_theorem3_at_end)} - "
                     "NOT a valid guarantee, not enforced)")  # fmt: skip
    return "\n".join(lines)


def _model_start_lines(cfg: Config) -> list[str]:
    """The plan's lines on a public warm start and on the privately trained subset."""
    lines = []
    if cfg.public.warm_start:
        lines.append(
            f"public warm start: {cfg.public.steps} non-private MAML steps on Omniglot's "
            "background alphabets (public, not the participants') before round 1"
        )
    if cfg.training.trained_parameters != "all":
        lines.append(
            f"privately trained: {_TRAINED[cfg.training.trained_parameters]} alone; the other "
            "meta-parameters stay at their "
            + ("public warm-start values" if cfg.public.warm_start else "initial values")
        )
    if (subspace := subspace_line(cfg.privacy.subspace)) is not None:
        lines.append(subspace)
    if cfg.training.meta_sgd:
        lines.append(
            f"Meta-SGD: one learned inner rate per meta-parameter, starting at "
            f"{cfg.training.inner_lr:g}; the meta-model has twice the parameters"
        )
    return lines


def public_line(public: Mapping[str, Any]) -> str:
    """The line that labels a run which used public data (summary)."""
    steps = public["non_private_pretraining"]["steps"]
    return (
        f"PUBLIC WARM START: the model was pre-trained without privacy on {public['data']}, "
        f"{public['classes']} classes ({steps} steps), disjoint from the participants' data"
    )


_TRAINED = {
    "head": "the output layer",
    "norm_and_head": "the per-layer normalisation scale and shift and the output layer",
}


def trained_line(trained: Mapping[str, Any], *, public: bool) -> str:
    """The summary line naming a parameter-efficient run's privately trained subset."""
    rest = "their public warm-start values" if public else "their initial values"
    return (
        f"privately trained: {trained['which']}, {trained['count']:,} of {trained['of']:,} "
        f"meta-parameters (the rest stay at {rest})"
    )


def experiment_line(name: str) -> str:
    """The mark every output of an experiment carries (``privacy.experiment``)."""
    return (
        f"EXPERIMENT {name}: public benchmark data, spent from the experiment's own ledger, "
        "not from a production budget"
    )


def _target(cfg: Config) -> str:
    t = cfg.privacy.target_epsilon
    return "this run's target: the whole budget" if t is None else f"this run's target: {t:g}"


def _adaptive_lines(plan: PrivatePlan) -> list[str]:
    a = plan.adaptive
    if a is None:
        return []
    return [
        f"adaptive clipping (Andrew et al. 2021): C starts at {_e(a.initial_clip, 'g')}, tracks "
        f"the {_e(a.target_quantile, 'g')} quantile of task norms (learning rate "
        f"{_e(a.learning_rate, 'g')}, C in [{_e(a.min_clip, 'g')}, {_e(a.max_clip, 'g')}])",
        f"  z = {_e(plan.noise_multiplier, '.4f')} covers both releases: gradient noise "
        f"z_grad = {_e(a.gradient_noise_multiplier, '.4f')}, count noise s_b = "
        f"{_e(a.count_noise, '.4g')} tasks",
    ]


@dataclass(frozen=True)
class RunFacts:
    """What the summary says of the run itself, fixed at its start."""

    cfg: Config
    plan: RunPlan
    forecast: BudgetForecast | None  # None: a non-private run
    run_id: str
    federation_id: str
    participants: int  # registered
    ledger: Ledger | None  # None: a non-private run
    coordinates: int | None = None  # noisy values a round releases


@dataclass(frozen=True)
class RunEnd:
    """How the run ended: its records, why it stopped, what it spent."""

    outcomes: Sequence[RoundOutcome]
    stopped: str
    rounds_completed: int
    epsilons: Mapping[str, Any]  # the ledger's, as the records report them ({}: non-private)
    wall_seconds: float


@dataclass(frozen=True)
class FinalScores:
    """The test evaluation: the released model's, the starting model's, and where it started."""

    final: Any  # None: an interrupted run left its test tasks to the resume
    starting: float | None  # the starting model's test metric
    model_start: Mapping[str, Any] | None = None  # :func:`model_start_fields`
    start: StartingModel | None = None  # round 0's record
    # what the test evaluation scored that the model had seen (server/.../seen_release.py)
    seen: Mapping[str, Any] | None = None


def build_summary(facts: RunFacts, end: RunEnd, scores: FinalScores) -> dict[str, Any]:
    """``summary.json``: the run's plan, its records' totals and the final evaluation."""
    cfg, plan, private = facts.cfg, facts.plan, facts.plan.private
    model_start = scores.model_start or model_start_fields(None, None)
    guarantee = _implemented(plan, end.epsilons, facts.ledger, facts.coordinates)
    return {
        "mode": "private" if private else "NON-PRIVATE (no clipping, no noise, no ledger)",
        "marks": marks(
            private=private,
            experiment=cfg.privacy.experiment,
            public=model_start["public_warm_start"] is not None,
        ),
        "private": private,
        "neighbouring": plan.neighbouring if private else None,
        "experiment": cfg.privacy.experiment,
        "run_id": facts.run_id,
        "federation_id": facts.federation_id,
        "rounds_planned": plan.planned_rounds,
        "rounds_completed": end.rounds_completed,
        "rounds_lost_on_resume": [o.round for o in end.outcomes if o.status == "lost_on_resume"],
        "stopped_reason": end.stopped,
        **_privacy_fields(cfg, plan, end.epsilons, end.outcomes, guarantee),
        "participants_registered": facts.participants,
        "participants_per_round": plan.scheme.participants_per_round,
        **_final_metric(cfg, scores.final),
        **(scores.seen or _SEEN_UNKNOWN),
        **starting_fields(cfg.public.warm_start, scores.starting, scores.start),
        **model_start,
        "subspace": subspace_summary(cfg.privacy.subspace),
        "ledger": None if facts.ledger is None else _ledger_summary(facts.ledger),
        "plan": None if facts.forecast is None else _forecast_dict(facts.forecast),
        # The sum of every round's work, which follows the stage-2 counts: a private diagnostic.
        "wall_seconds": round(end.wall_seconds, 1) if _diagnostics(cfg, plan) else None,
    }


def _privacy_fields(
    cfg: Config,
    plan: RunPlan,
    epsilons: Mapping[str, Any],
    outcomes: Sequence[RoundOutcome],
    implemented: dict[str, Any] | None,
) -> dict[str, Any]:
    """The summary's guarantee and noise fields (None where a non-private run has none)."""
    p = plan.privacy
    return {
        **sample_summary(plan.level, None if p is None else p.event, cfg),  # level, its constants
        "epsilon_spent": epsilons.get("epsilon_task"),
        "epsilon_participant_level": epsilons.get("epsilon_participant"),
        "participant_level_note": None if p is None else p.participant_level_note,
        "delta": None if p is None else p.delta,
        "epsilon_budget": None if p is None else p.epsilon_budget,
        "target_epsilon": None if p is None else cfg.privacy.target_epsilon,
        "implemented_guarantee": implemented,
        "noise_multiplier": None if p is None else p.noise_multiplier,
        "noise_calibrated": None if p is None else p.noise_calibrated,
        "clip": None if p is None else p.clip,
        "adaptive_clipping": _adaptive_summary(plan, outcomes),
        "noise_secure": None if p is None else cfg.privacy.insecure_test_seed is None,
        "normaliser": None if p is None else plan.normaliser,
    }


def ledger_anchor(ledger: Ledger | None) -> dict[str, Any] | None:
    """The whole ledger's anchor (issue 39's witness); None without a ledger or for a fake."""
    return None if ledger is None else ledger.anchor()


def _ledger_summary(ledger: Ledger) -> dict[str, Any]:
    """The ledger's path, this budget's records and the whole ledger's witness (issue 39)."""
    witness = ledger_anchor(ledger)
    return {"path": str(ledger.path), "records": ledger.position(), "witness": witness}




#: A summary built without the test evaluation's seen items (a caller that passes none).
_SEEN_UNKNOWN = {"seen_fraction": None, "held_out": None, "seen_note": "not computed"}

#: The summary's word for a test evaluation an interrupted run left to its resume.
NOT_TESTED = (
    "not run: the run was interrupted; it runs when the resumed run ends (--resume), or now "
    "with `fedmeta evaluate --checkpoint DIR`"
)


def _final_metric(cfg: Config, final: Any) -> dict[str, Any]:
    """The summary's evaluation fields: the noisy model's metric on public held-out tasks."""
    if final is None:  # an interrupted run that left its test tasks to the resume
        return {"metric": _metric_name(cfg), "final_metric": None, "final_metric_ci95": None,
                "test_evaluation": NOT_TESTED, "adaptation": adaptation_summary(cfg.training),
                "test_tasks": 0}  # fmt: skip
    return {
        "metric": _metric_name(cfg),
        "final_metric": final.mean,
        # Percentile bootstrap over test tasks: within the metric's range, unlike mean +- 1.96 se.
        "final_metric_ci95": [final.ci95_low, final.ci95_high],
        "final_metric_ci95_method": "percentile bootstrap of the mean over test tasks",
        "final_metric_ci95_halfwidth": final.ci95,
        "final_metric_median": final.median,
        "adaptation_diverged_tasks": final.diverged,
        "adaptation": adaptation_summary(cfg.training),
        "final_metric_pre_adaptation": final.pre_adaptation_mean,
        "test_tasks": final.n_tasks,
    }


def implemented_guarantee(epsilon: float, delta: float, coordinates: int) -> tuple[float, float]:
    """The accountant's (epsilon, delta) with the release's floating-point residual folded in.

    The one place a reported guarantee takes it (server/fedmeta/server/noise.py ``float_residual``;
    the arithmetic
    is in docs/privacy.md): ``coordinates`` noisy values released over the ledger's spends.
    """
    return float_residual(coordinates, epsilon, delta)


def released_coordinates(plan: RunPlan, dim: int) -> int:
    """Noisy values one private round releases: the model's, plus adaptive clipping's count."""
    adaptive = plan.privacy is not None and plan.privacy.adaptive is not None
    return dim + (1 if adaptive else 0)


def _implemented(
    plan: RunPlan, epsilons: Mapping[str, Any], ledger: Any, coordinates: int | None
) -> dict[str, Any] | None:
    """The summary's guarantee of the implementation, over every spend in the ledger.

    Every spend is taken to have released ``coordinates`` values (this run's model): a federation
    whose runs used another model size must recompute it with that size.
    """
    eps = epsilons.get("epsilon_task")
    if plan.privacy is None or coordinates is None or eps is None or ledger is None:
        return None
    released = coordinates * int(ledger.position())
    epsilon, delta = implemented_guarantee(float(eps), plan.privacy.delta, released)
    return {"epsilon": epsilon, "delta": delta, "released_coordinates": released,
            "per_cell_residual": RESIDUAL_PER_COORDINATE}  # fmt: skip


def _diagnostics(cfg: Config, plan: RunPlan) -> bool:
    """Whether this run's outputs may hold private diagnostics (always in a non-private run)."""
    return not plan.private or cfg.metrics.private_diagnostics


def _adaptive_summary(plan: RunPlan, outcomes: Sequence[RoundOutcome]) -> dict[str, Any] | None:
    """Adaptive clipping's constants and the last bound used (a function of released counts)."""
    a = None if plan.privacy is None else plan.privacy.adaptive
    if a is None:
        return None
    clips = [o.clip for o in outcomes if o.clip is not None]
    return {
        "target_quantile": a.target_quantile,
        "learning_rate": a.learning_rate,
        "count_noise": a.count_noise,
        "gradient_noise_multiplier": a.gradient_noise_multiplier,
        "initial_clip": a.initial_clip,
        "last_clip": clips[-1] if clips else None,
    }


#: The held-out metric a summary reports: regression error or classification accuracy.
MetricName: TypeAlias = Literal["mse", "accuracy"]


def _metric_name(cfg: Config) -> MetricName:
    return "mse" if cfg.dataset.name == "sinusoid" else "accuracy"


def _forecast_dict(fc: BudgetForecast) -> dict[str, Any]:
    return {
        "ledger_records_before": fc.ledger_records_before,
        "epsilon_spent_before": fc.epsilon_spent_before,
        "rounds_affordable": fc.rounds_affordable,
        "rounds_to_run": fc.rounds_to_run,
        "epsilon_task_at_end": fc.epsilon_task_at_end,
        "epsilon_participant_at_end": fc.epsilon_participant_at_end,
        "epsilon_tombs2022_published_at_end_NOT_VALID": fc.epsilon_theorem3_at_end,
    }


def format_summary(s: Mapping[str, Any]) -> str:
    """The summary printed at the end."""
    lines = ["== fedmeta summary ==",
             *([experiment_line(s["experiment"])] if s.get("experiment") else []),
             f"mode: {s['mode']}",
             f"rounds completed {s['rounds_completed']} of {s['rounds_planned']} planned | "
             f"stopped: {s['stopped_reason']}"]  # fmt: skip
    if s["private"]:
        lines.append(
            f"epsilon spent ({'example' if s.get('level') == 'sample' else 'task'} level, "
            f"{s['neighbouring']}) {_e(s['epsilon_spent'])} of "
            f"budget {_e(s['epsilon_budget'], 'g')} at delta {_e(s['delta'], 'g')}"
        )
        lines.append("participant level: " + _participant_summary(s))
        if s.get("noise_secure") is False:
            lines.append("WARNING: insecure_test_seed was set - noise is reproducible, NOT private "
                         "(tests only)")  # fmt: skip
    else:
        lines.append("NON-PRIVATE: no clipping, no noise, no privacy guarantee")
    ci = s["final_metric_ci95"]
    if ci is None:
        lines.append(f"test {s['metric']}: {s.get('test_evaluation', NOT_TESTED)}")
    else:
        lines.append(_test_line(s))
    if "seen_fraction" in s:
        lines.append(seen_line(s))
    lines += _model_lines(s)
    if s.get("rounds_lost_on_resume"):
        lines.append("rounds spent but lost before a checkpoint (counted as spent): "
                     f"{s['rounds_lost_on_resume']}")  # fmt: skip
    return "\n".join(lines)


def _test_line(s: Mapping[str, Any]) -> str:
    """The summary's line on the test evaluation of the released model."""
    ci = s["final_metric_ci95"]
    return (
        f"test {s['metric']} after adaptation: {_e(s['final_metric'], '.4f')} "
        f"(95% bootstrap CI {_e(ci[0], '.4f')} .. {_e(ci[1], '.4f')}, median "
        f"{_e(s.get('final_metric_median'), '.4f')}, {s['test_tasks']} tasks, "
        f"{s.get('adaptation_diverged_tasks')} diverged); "
        + ("starting model (round 0), PUBLIC warm start before private training"
           if s.get("public_warm_start") else "starting model (round 0), untrained")
        + f": {_e(starting_metric_of(s), '.4f')}"
    )  # fmt: skip


def _model_lines(s: Mapping[str, Any]) -> list[str]:
    """The summary's lines on a public warm start, the tested model and the trained subset."""
    lines = []
    if s.get("public_warm_start"):
        lines.append(public_line(s["public_warm_start"]))
    chosen = s.get("model_selection") or {}
    if chosen.get("rule") == "best_validation":
        lines.append(f"tested model: round {chosen['round']} (best validation {s['metric']} "
                     f"{_e(chosen['validation_metric'], '.4f')} on {chosen['validation_tasks']} "
                     "server-held tasks; the starting model, round 0, validated "
                     f"{_e(chosen.get('start_validation_metric'), '.4f')})")  # fmt: skip
    if sub := s.get("subspace"):
        lines.append(f"private rounds in a subspace: noise on k = {sub['dimension']} coordinates "
                     f"spanned by PUBLIC task gradients (basis every {sub['refresh_every']} "
                     "rounds), the residual dropped")  # fmt: skip
    trained = s.get("trained_parameters")
    if trained and trained["which"] != "all":
        lines.append(trained_line(trained, public=bool(s.get("public_warm_start"))))
    return lines


def write_summary(out_dir: Path, summary: Mapping[str, Any]) -> Path:
    """``summary.json``."""
    path = Path(out_dir) / "summary.json"
    atomic_write_bytes(path, (json.dumps(summary, indent=2, default=str) + "\n").encode())
    return path


def write_all(
    out_dir: Path,
    summary: Mapping[str, Any],
    outcomes: Sequence[RoundOutcome],
    *,
    diagnostics: bool,
    plots: bool = True,
) -> list[str]:
    """All files of a finished run; their names, in the order written."""
    written = [
        write_summary(out_dir, summary).name,
        write_rounds_csv(out_dir, outcomes, bool(summary["private"]), diagnostics).name,
    ]
    if plots and write_plots(out_dir, outcomes, summary):
        written += PLOT_FILES
    return written
