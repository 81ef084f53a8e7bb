"""``fedmeta evaluate``: score a meta-model on held-out tasks and the official one-shot runs.

    fedmeta evaluate --checkpoint runs/omniglot-20way-1shot [--tasks 600]
                     [--omniglot-runs all_runs.zip] [--json]

The checkpoint (a run directory or its ``checkpoint.pt``) is loaded safely (tensors and plain data
only) and its own configuration rebuilds the model and the test split, so a model is scored on the
tasks it was configured for: ``--tasks`` held-out test tasks with a 95% confidence interval
(normal approximation over tasks), and with ``--omniglot-runs`` the 20 within-alphabet 20-way
one-shot runs of Lake et al. (2015), reported per run and as the mean error (people: 4.5%). Both are
post-processing of the released model on public data: evaluating costs no privacy. The table and
the JSON carry the run summary's marks (``PUBLIC WARM START``, ``EXPERIMENT name``,
``NON-PRIVATE``).

``main(args) -> dict`` is the programmatic entry point; ``register`` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmeta import exitcodes

if TYPE_CHECKING:  # torch and pydantic: loaded by the command, not by `fedmeta --help`
    from fedmeta.checkpoint import Checkpoint
    from fedmeta.config import DatasetConfig
    from fedmeta.config_privacy import PrivacyConfig
    from fedmeta.config_training import TrainingConfig


def register(subparsers: Any) -> None:
    """Add ``fedmeta evaluate``."""
    p = subparsers.add_parser(
        "evaluate",
        help="score a checkpoint on held-out tasks and Lake et al.'s one-shot runs",
        description="Evaluate a trained meta-model: held-out test tasks with a 95% CI and, "
        "optionally, the 20 official Omniglot one-shot classification runs.",
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="run directory or .pt file")
    p.add_argument("--tasks", type=int, default=600, help="held-out test tasks (default 600)")
    p.add_argument("--omniglot-runs", type=Path, help="all_runs.zip or its unpacked folder")
    p.add_argument("--inner-steps", type=int, help="adaptation steps (default: the run's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    from fedmeta.checkpoint import CheckpointError
    from fedmeta.config import ConfigError
    from fedmeta.metalearning import DataError

    try:
        result = main(args)
    except (CheckpointError, ConfigError, DataError, ValueError) as error:
        print(f"fedmeta evaluate: {error}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return exitcodes.OK


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate ``args.checkpoint``; the JSON-ready result."""
    import torch

    from fedmeta.adaptation import inner_kwargs
    from fedmeta.checkpoint import read_checkpoint
    from fedmeta.metalearning import evaluate
    from fedmeta.workload import build_workload

    if not 1 <= args.tasks <= 100_000:
        raise ValueError(f"--tasks must be in [1, 100000]; got {args.tasks}")
    state = read_checkpoint(args.checkpoint)
    cfg = state.config
    workload = build_workload(cfg)
    model = workload.model
    params = state.released_params().to(torch.float32)  # the run's selected model
    inner = inner_kwargs(cfg.training, evaluation=True)
    if args.inner_steps is not None:
        inner["inner_steps"] = args.inner_steps
    tasks = workload.held_out("test", args.tasks)
    held_out = evaluate(model, params, tasks, device="auto", chunk_size=cfg.training.chunk_size,
                        **inner)  # fmt: skip
    result: dict[str, Any] = {
        "checkpoint": str(args.checkpoint),
        "private": state.private,
        "rounds": state.next_round,
        "metric": held_out.metric,
        "mean": held_out.mean,
        "ci95": [held_out.ci95_low, held_out.ci95_high],
        "ci95_method": "percentile bootstrap of the mean over test tasks",
        "median": held_out.median,
        "diverged_tasks": held_out.diverged,
        "tasks": held_out.n_tasks,
        **privacy_of(state, cfg.privacy),
        **marks_of(state, cfg.privacy.experiment,
                   workload.public_summary() if cfg.public.warm_start else None),
    }
    runs = None
    if args.omniglot_runs is not None:
        official, runs = _official_runs(cfg.dataset, model, params, args.omniglot_runs, inner)
        result.update(official)
    chunk = cfg.training.chunk_size
    score = lambda t: evaluate(model, params, t, device="auto", chunk_size=chunk, **inner)  # noqa: E731
    result.update(_seen(cfg.training, workload, result, runs, score))
    return result


def _seen(
    training: TrainingConfig,
    workload: Any,
    result: dict[str, Any],
    runs: Any,
    evaluate_tasks: Any,
) -> dict[str, Any]:
    """``seen_fraction`` and ``held_out`` (core/fedmeta/seen.py; issue 42).

    JSON: ``seen_fraction`` over the distinct items scored (the test tasks' pool and, with
    ``--omniglot-runs``, the runs' 800 drawings; ``null`` with ``seen_note`` when unknown), per
    part ``seen_fraction_test`` / ``seen_fraction_runs``, and ``held_out``: the same metrics over
    unseen items only (the test classes none of whose drawings were seen; the runs none of whose
    40 drawings were seen).
    """
    from fedmeta import seen

    trained, note = seen.trained_or_note(training, workload)
    if trained is None:
        return seen.unknown(note or "seen_fraction unknown")
    parts, test_items = seen.part_of_test_classes(trained, workload, evaluate_tasks, result)
    groups = [test_items] if len(test_items) else []
    if runs is not None:
        run_fields, run_groups = seen.part_of_runs(trained, runs, result["run_errors"])
        parts.update(run_fields)
        groups += run_groups
    return seen.combined(parts, groups, trained)


def privacy_of(state: Checkpoint, privacy: PrivacyConfig) -> dict[str, Any]:
    """The guarantee the checkpointed model was released under: epsilon, delta, the relation.

    Epsilon is the latest the run recorded (its rounds' records in the checkpoint), at the task
    level (enforced) and the participant level (reported); a non-private model has none.
    """
    experiment = privacy.experiment  # an experiment's model says so wherever it goes
    if not state.private:
        return {"epsilon": None, "epsilon_participant": None, "delta": None, "neighbouring": None,
                "experiment": experiment}  # fmt: skip
    last = state.last_epsilon()
    return {
        "epsilon": None if last is None else _implemented_epsilon(state, last.epsilon_task,
                                                                  privacy.delta),
        "epsilon_participant": None if last is None else last.epsilon_participant,
        "epsilon_at_round": None if last is None else last.round,
        "delta": privacy.delta,
        "neighbouring": privacy.neighbouring,
        "experiment": experiment,
    }


def marks_of(
    state: Checkpoint, experiment: str | None, public: dict[str, Any] | None
) -> dict[str, Any]:
    """The summary's marks for this model (PUBLIC / EXPERIMENT / NON-PRIVATE) and its public data.

    ``experiment``: ``privacy.experiment``; ``public``: the public warm start's summary (None:
    none). The same marks as the run's summary.json and plots (server/fedmeta/server/outputs.py).
    """
    from fedmeta.server.marks import marks

    return {
        "marks": marks(
            private=state.private,
            experiment=experiment,
            public=public is not None,
        ),
        "public_warm_start": public,
    }


def _implemented_epsilon(state: Checkpoint, eps: float, delta: float) -> float:
    """The implemented guarantee, as the summary and the exporter report it (issue 39, item 6).

    The accountant's epsilon with the release's floating-point residual folded in over every
    noisy value the ledger's spends released (server/fedmeta/server/outputs.py). A checkpoint
    from before it recorded its released coordinates gives the accountant's value.
    """
    from fedmeta.server.outputs import implemented_guarantee

    released = state.released_values()
    if released is None:
        return eps
    return implemented_guarantee(eps, delta, released)[0]


def _official_runs(
    dataset: DatasetConfig, model: Any, params: Any, path: Path, inner: dict[str, Any]
) -> tuple[dict[str, Any], Any]:
    """The official runs' errors, adapting as the held-out tasks do (``inner``)."""
    from fedmeta.metalearning import evaluate_oneshot_runs, load_oneshot_runs
    from fedmeta.metalearning.oneshot_runs import HUMAN_ERROR_RATE

    if dataset.name != "omniglot":
        raise ValueError(
            f"--omniglot-runs needs an Omniglot model; this checkpoint's dataset.name is "
            f"{dataset.name!r}"
        )
    runs = load_oneshot_runs(path, image_size=dataset.image_size)
    scored = evaluate_oneshot_runs(model, params, runs, image_size=dataset.image_size,
                                   **inner)  # fmt: skip
    return {
        "run_errors": [float(e) for e in scored.errors],
        "mean_error": float(scored.mean_error),
        "human_mean_error": HUMAN_ERROR_RATE,
    }, runs


def _table(result: dict[str, Any]) -> str:
    from fedmeta.seen import seen_line

    lo, hi = result["ci95"]
    guarantee = "NON-PRIVATE"
    if result["private"]:
        eps = "-" if result["epsilon"] is None else f"{result['epsilon']:.4g}"
        guarantee = f"private: epsilon {eps}, delta {result['delta']:g}, {result['neighbouring']}"
    if result.get("experiment"):
        guarantee += f"; EXPERIMENT {result['experiment']}"
    lines = [
        *([" ".join(f"[{mark}]" for mark in result["marks"])] if result.get("marks") else []),
        f"checkpoint {result['checkpoint']} ({guarantee}, {result['rounds']} rounds)",
        f"held-out test {result['metric']}: {result['mean']:.4f} (95% bootstrap CI {lo:.4f} .. "
        f"{hi:.4f}, median {result['median']:.4f}, {result['tasks']} tasks, "
        f"{result['diverged_tasks']} diverged)",
    ]
    if "run_errors" in result:
        errors = " ".join(f"{e:.2f}" for e in result["run_errors"])
        lines.append(f"official one-shot runs, error per run: {errors}")
        lines.append(
            f"mean error {result['mean_error']:.4f} (people: {result['human_mean_error']})"
        )
    lines.append(seen_line(result))
    return "\n".join(lines)
