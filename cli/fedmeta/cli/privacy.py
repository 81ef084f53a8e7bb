"""``fedmeta privacy epsilon|calibrate|max-rounds|compare`` (and ``plan``, from privacy_plan.py).

``--level sample`` (issue 53) hands epsilon, calibrate and max-rounds to privacy_sample.py.

Human-readable tables by default, ``--json`` for machines. The commands import only
``accounting`` (no torch, no Flower), and that loads dp-accounting and scipy only when a command
computes, so ``--help`` and a usage error answer at once.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fedmeta.accounting.calibration import calibrate_noise_multiplier, max_rounds
from fedmeta.accounting.composition import MAX_ROUNDS_LIMIT, epsilon, tombs2022_published_epsilon
from fedmeta.accounting.levels import LEVELS
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    NEIGHBOURING_RELATIONS,
    UNITS,
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    Scheme,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    Unit,
)
from fedmeta.cli.arguments import (
    DEFAULT_DELTA,
    UsageError,
    add_epsilon_arg,
    emit,
    eps_text,
    handled,
    json_eps,
)
from fedmeta.cli.privacy_plan import BudgetDelta, ConfigWriter, add_plan_parser
from fedmeta.cli.privacy_sample import (
    SAMPLE_FLAGS,
    add_sample_args,
    check_level_flags,
    sample_calibrate,
    sample_epsilon,
    sample_max_rounds,
)

PUBLISHED_LABEL = "as published, not a valid guarantee"


def _add_sampling_group(parser: argparse.ArgumentParser) -> None:
    """The sampling scheme's flags: two-stage, or single-stage where one of its flags is given."""
    group = parser.add_argument_group(
        "sampling scheme (two-stage unless a single-stage flag is given)"
    )
    group.add_argument("--participants", type=int, help="P, registered participants")
    group.add_argument(
        "--participants-per-round", type=int, help="n1, sampled per round (w/o repl.)"
    )
    group.add_argument("--task-rate", type=float, help="q2, Poisson rate per task in stage 2")
    group.add_argument(
        "--tasks-per-round",
        type=int,
        help="n2, tasks per sampled participant without replacement (needs --min-tasks)",
    )
    group.add_argument("--min-tasks", type=int, help="smallest participant's task count")
    group.add_argument(
        "--flat-poisson-rate", type=float, help="single stage: Poisson rate q over all tasks"
    )
    group.add_argument("--sample-size", type=int, help="single stage: m tasks without replacement")
    group.add_argument(
        "--population", type=int, help="single stage: n tasks in all (with --sample-size)"
    )
    group.add_argument(
        "--max-tasks-per-participant",
        type=int,
        help="cap on one participant's tasks per round (participant-level unit)",
    )


def _add_scheme_args(
    parser: argparse.ArgumentParser, *, noise: bool = True, rounds: bool = True, levels: bool = True
) -> None:
    _add_sampling_group(parser)
    if noise:  # at --level sample: --inner- and --outer-noise-multiplier (privacy_sample.py)
        parser.add_argument("--noise-multiplier", type=float, required=not levels, help="z")
    if levels:
        parser.add_argument(
            "--level",
            choices=LEVELS,
            default="task",
            help="task (default): one task; sample: one example (issue 53)",
        )
        add_sample_args(parser, noise=noise)
    if rounds:
        parser.add_argument("--rounds", type=int, required=True, help="T, number of rounds")
    parser.add_argument(
        "--delta",
        type=float,
        default=DEFAULT_DELTA,
        help=f"target delta (default {DEFAULT_DELTA:g}, as privacy.delta)",
    )
    parser.add_argument(
        "--neighbouring",
        choices=NEIGHBOURING_RELATIONS,
        default=ADD_REMOVE,
        help="neighbouring relation of the task-level guarantee: add or remove one task "
        "(default), or replace one task by another (task counts public)",
    )
    parser.add_argument(
        "--unit",
        choices=UNITS,
        default="task",
        help="privacy unit (default task)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _scheme_from_args(args: argparse.Namespace) -> Scheme:
    if args.flat_poisson_rate is not None:
        return FlatPoissonScheme(args.flat_poisson_rate)
    if args.sample_size is not None or args.population is not None:
        if args.sample_size is None or args.population is None:
            raise UsageError("--sample-size and --population must be given together")
        return FixedSizeScheme(args.sample_size, args.population)
    if args.participants is None or args.participants_per_round is None:
        raise UsageError(
            "--participants and --participants-per-round must be given for a two-stage scheme "
            "(or use --flat-poisson-rate, or --sample-size with --population)"
        )
    if args.tasks_per_round is not None:
        if args.task_rate is not None:
            raise UsageError("--task-rate and --tasks-per-round must not both be given; pick one")
        if args.min_tasks is None:
            raise UsageError(
                "--min-tasks must be given with --tasks-per-round (smallest task count)"
            )
        return TwoStageFixedScheme(
            args.participants, args.participants_per_round, args.tasks_per_round, args.min_tasks
        )
    if args.task_rate is None:
        raise UsageError("--task-rate or --tasks-per-round must be given for a two-stage scheme")
    return TwoStagePoissonScheme(args.participants, args.participants_per_round, args.task_rate)


def _describe(scheme: Scheme) -> str:
    if isinstance(scheme, TwoStagePoissonScheme):
        return (
            f"two-stage: {scheme.participants_per_round} of {scheme.participants} participants, "
            f"Poisson q2={scheme.task_rate:g}"
        )
    if isinstance(scheme, TwoStageFixedScheme):
        return (
            f"two-stage: {scheme.participants_per_round} of {scheme.participants} participants, "
            f"{scheme.tasks_per_round} of >= {scheme.min_tasks} tasks w/o replacement"
        )
    if isinstance(scheme, FlatPoissonScheme):
        return f"flat Poisson q={scheme.rate:g}"
    return f"fixed-size {scheme.sample_size} of {scheme.population} w/o replacement"


def _check_rounds(value: int) -> None:
    if not 1 <= value <= MAX_ROUNDS_LIMIT:
        raise UsageError(
            f"--rounds must be an integer in [1, {MAX_ROUNDS_LIMIT}] (the accountant's range); "
            f"got {value}"
        )


def _event(args: argparse.Namespace, scheme: Scheme, z: float) -> GaussianRound:
    return GaussianRound(scheme, z, args.max_tasks_per_participant, args.neighbouring)


def _task_level(args: argparse.Namespace, *, noise: bool = True) -> bool:
    """Whether the command runs at task level; refuses flags of the other level."""
    check_level_flags(args)
    if args.level == "task" and noise and args.noise_multiplier is None:
        raise UsageError("--noise-multiplier must be given (z, noise std / clip)")
    return bool(args.level == "task")


def _cmd_epsilon(args: argparse.Namespace) -> int:
    _check_rounds(args.rounds)
    if not _task_level(args):
        return sample_epsilon(args)
    scheme = _scheme_from_args(args)
    event = _event(args, scheme, args.noise_multiplier)
    groups = [(event, args.rounds)]
    eps = epsilon(groups, args.delta, args.unit, "pld")
    eps_rdp = epsilon(groups, args.delta, args.unit, "rdp")
    payload: dict[str, Any] = {
        "scheme": _describe(scheme),
        "unit": args.unit,
        "neighbouring": args.neighbouring,
        "rounds": args.rounds,
        "noise_multiplier": args.noise_multiplier,
        "delta": args.delta,
        "epsilon": json_eps(eps),
        "epsilon_rdp": json_eps(eps_rdp),
    }
    rows = [
        ("scheme", payload["scheme"]),
        ("unit", args.unit),
        ("neighbouring", args.neighbouring),
        ("rounds", str(args.rounds)),
        ("noise multiplier", f"{args.noise_multiplier:g}"),
        ("delta", f"{args.delta:g}"),
        ("epsilon (PLD, enforced)", eps_text(eps)),
        ("epsilon (RDP cross-check)", eps_text(eps_rdp)),
    ]
    if (
        args.unit == "task"
        and args.neighbouring == ADD_REMOVE
        and isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme)
    ):
        # Theorem 3 is an add/remove statement: shown only beside an add/remove guarantee.
        published = tombs2022_published_epsilon(event, args.rounds, args.delta)
        payload["epsilon_tombs2022_published"] = json_eps(published)
        payload["epsilon_tombs2022_published_note"] = PUBLISHED_LABEL
        rows.append((f"Tombs et al. 2022 Thm 3 ({PUBLISHED_LABEL})", eps_text(published)))
    emit(args, payload, rows)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.epsilon is not None and args.old_epsilon is not None:
        raise UsageError("--epsilon and --target-epsilon are the same flag; give one")
    args.target_epsilon = args.epsilon if args.epsilon is not None else args.old_epsilon
    if args.target_epsilon is None:
        raise UsageError("--epsilon (the target epsilon) is required")
    _check_rounds(args.rounds)
    if not _task_level(args, noise=False):
        return sample_calibrate(args)
    scheme = _scheme_from_args(args)
    z = calibrate_noise_multiplier(
        scheme,
        args.rounds,
        args.target_epsilon,
        args.delta,
        args.unit,
        max_tasks_per_participant=args.max_tasks_per_participant,
        neighbouring=args.neighbouring,
    )
    eps = epsilon([(_event(args, scheme, z), args.rounds)], args.delta, args.unit)
    payload = {
        "scheme": _describe(scheme),
        "unit": args.unit,
        "neighbouring": args.neighbouring,
        "rounds": args.rounds,
        "delta": args.delta,
        "target_epsilon": args.target_epsilon,
        "noise_multiplier": z,
        "epsilon": eps,
    }
    emit(
        args,
        payload,
        [
            ("scheme", payload["scheme"]),
            ("unit", args.unit),
            ("neighbouring", args.neighbouring),
            ("rounds", str(args.rounds)),
            ("delta", f"{args.delta:g}"),
            ("target epsilon", f"{args.target_epsilon:g}"),
            ("noise multiplier", f"{z:.4f}"),
            ("epsilon (PLD) at it", eps_text(eps)),
        ],
    )
    return 0


def _cmd_max_rounds(args: argparse.Namespace) -> int:
    if not _task_level(args):
        return sample_max_rounds(args)
    scheme = _scheme_from_args(args)
    event = _event(args, scheme, args.noise_multiplier)
    rounds = max_rounds(event, args.epsilon, args.delta, args.unit)
    eps = epsilon([(event, rounds)], args.delta, args.unit) if rounds else 0.0
    capped = rounds >= MAX_ROUNDS_LIMIT
    payload = {
        "scheme": _describe(scheme),
        "unit": args.unit,
        "neighbouring": args.neighbouring,
        "delta": args.delta,
        "epsilon_budget": args.epsilon,
        "noise_multiplier": args.noise_multiplier,
        "rounds": rounds,
        "rounds_at_limit": capped,
        "epsilon": eps,
    }
    shown = (
        f"{rounds} or more (the accountant's range ends at {MAX_ROUNDS_LIMIT})"
        if capped
        else str(rounds)
    )
    emit(
        args,
        payload,
        [
            ("scheme", payload["scheme"]),
            ("unit", args.unit),
            ("neighbouring", args.neighbouring),
            ("noise multiplier", f"{args.noise_multiplier:g}"),
            ("delta", f"{args.delta:g}"),
            ("epsilon budget", f"{args.epsilon:g}"),
            ("max rounds (PLD, exact)", shown),
            ("epsilon (PLD) after them", eps_text(eps)),
        ],
    )
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.participants is None or args.participants_per_round is None or args.min_tasks is None:
        raise UsageError(
            "--participants, --participants-per-round and --min-tasks must be given to compare "
            "designs"
        )
    _check_rounds(args.rounds)
    n2, q2 = _compare_task_rates(args)
    fixed = TwoStageFixedScheme(args.participants, args.participants_per_round, n2, args.min_tasks)
    payload = {
        "noise_multiplier": args.noise_multiplier,
        "rounds": args.rounds,
        "delta": args.delta,
        "neighbouring": args.neighbouring,
        "expected_tasks_per_round": args.participants_per_round * n2,
        "designs": _compare_rows(args, fixed, n2, q2),
    }
    if args.json:
        print(json.dumps(payload, indent=2, sort_keys=True))
        return 0
    _print_compare(payload, fixed.largest_inclusion_probability)
    return 0


def _compare_task_rates(args: argparse.Namespace) -> tuple[int, float]:
    """Stage 2 as both designs see it: ``n2`` tasks without replacement, or Poisson rate ``q2``."""
    if args.tasks_per_round is None and args.task_rate is None:
        raise UsageError("--task-rate or --tasks-per-round must be given to compare designs")
    n2 = args.tasks_per_round
    q2 = args.task_rate if args.task_rate is not None else n2 / args.min_tasks
    if n2 is None:
        n2 = round(q2 * args.min_tasks)
        if abs(n2 - q2 * args.min_tasks) > 1e-9 or n2 < 1:
            raise UsageError(
                f"--task-rate must make --min-tasks * rate a whole number of tasks for the "
                f"without-replacement row; got {q2} * {args.min_tasks}"
            )
    return n2, q2


def _compare_rows(
    args: argparse.Namespace, fixed: TwoStageFixedScheme, n2: int, q2: float
) -> list[dict[str, Any]]:
    """One row per design (valid PLD and RDP epsilons), then Theorem 3 as published, not valid."""
    z, t, d, rel = args.noise_multiplier, args.rounds, args.delta, args.neighbouring
    poisson = TwoStagePoissonScheme(args.participants, args.participants_per_round, q2)
    eta = fixed.largest_inclusion_probability
    cap = args.max_tasks_per_participant or n2
    designs: list[tuple[str, GaussianRound, Unit]] = [
        (
            f"flat Poisson over all tasks, q={eta:g}",
            GaussianRound(FlatPoissonScheme(eta), z, None, rel),
            "task",
        ),
        (f"two-stage, Poisson q2={q2:g}", GaussianRound(poisson, z, None, rel), "task"),
        (
            f"two-stage, {n2} of {args.min_tasks} w/o replacement",
            GaussianRound(fixed, z, None, rel),
            "task",
        ),
        (
            f"participant-level (two-stage, cap {cap} tasks)",
            GaussianRound(fixed, z, cap, rel),
            "participant",
        ),
    ]
    rows_json: list[dict[str, Any]] = []
    for label, event, unit in designs:
        groups = [(event, t)]
        rows_json.append(
            {
                "design": label,
                "unit": unit,
                "valid": True,
                "epsilon": json_eps(epsilon(groups, d, unit, "pld")),
                "epsilon_rdp": json_eps(epsilon(groups, d, unit, "rdp")),
            }
        )
    if rel == ADD_REMOVE:  # Theorem 3 is an add/remove statement
        published = tombs2022_published_epsilon(GaussianRound(fixed, z), t, d)
        rows_json.append(
            {
                "design": f"Tombs et al. 2022 Thm 3, eta={eta:g} ({PUBLISHED_LABEL})",
                "unit": "task",
                "valid": False,
                "epsilon": json_eps(published),
                "epsilon_rdp": None,
            }
        )
    return rows_json


def _print_compare(payload: dict[str, Any], eta: float) -> None:
    rows_json: list[dict[str, Any]] = payload["designs"]
    z, t, d, rel = (payload[k] for k in ("noise_multiplier", "rounds", "delta", "neighbouring"))
    print(
        f"z={z:g}, T={t}, delta={d:g}, neighbouring {rel}, expected tasks per round "
        f"{payload['expected_tasks_per_round']} (flat rate = eta = {eta:g})"
    )
    width = max(len(str(r["design"])) for r in rows_json)
    print(f"{'design'.ljust(width)}  {'unit':11}  {'eps (PLD)':>10}  {'eps (RDP)':>10}")
    for r in rows_json:
        cells = ["-" if r[k] is None else f"{r[k]:.3f}" for k in ("epsilon", "epsilon_rdp")]
        print(f"{str(r['design']).ljust(width)}  {r['unit']:11}  {cells[0]:>10}  {cells[1]:>10}")


def register(
    subparsers: Any,
    *,
    config_writer: ConfigWriter | None = None,
    budget_delta: BudgetDelta | None = None,
) -> None:
    """Add ``privacy`` to the top-level ``fedmeta`` parser.

    ``config_writer`` lets ``privacy plan --write-config`` write a run configuration and
    ``budget_delta`` gives it the delta of the data's budget; the fedmeta command line passes both
    (``fedmeta.cli.plan_config``), which know the configuration schema.
    """
    privacy = subparsers.add_parser("privacy", help="privacy accounting and planning")
    psub = privacy.add_subparsers(dest="privacy_command", metavar="SUBCOMMAND")
    psub.required = True

    p = psub.add_parser("epsilon", help="epsilon after T rounds (PLD enforced, RDP cross-check)")
    _add_scheme_args(p)
    p.set_defaults(func=handled("privacy epsilon", _cmd_epsilon, SAMPLE_FLAGS))

    p = psub.add_parser("calibrate", help="smallest noise multiplier meeting a target epsilon")
    _add_scheme_args(p, noise=False)
    add_epsilon_arg(p, "target epsilon", old="--target-epsilon")
    p.set_defaults(func=handled("privacy calibrate", _cmd_calibrate, SAMPLE_FLAGS))

    p = psub.add_parser("max-rounds", help="largest T within an epsilon budget (exact under PLD)")
    _add_scheme_args(p, rounds=False)
    add_epsilon_arg(p, "epsilon budget")
    p.set_defaults(func=handled("privacy max-rounds", _cmd_max_rounds, SAMPLE_FLAGS))

    p = psub.add_parser("compare", help="compare sampling designs at the same expected lot size")
    _add_scheme_args(p, levels=False)
    p.set_defaults(func=handled("privacy compare", _cmd_compare))

    add_plan_parser(psub, config_writer, budget_delta)
