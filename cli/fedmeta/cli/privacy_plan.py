"""``fedmeta privacy plan``: search sampling, rounds and noise for the least noise per gradient.

The search is ``fedmeta.accounting.planner``'s; this module reads the flags, prints the ranked rows
and, with ``--write-config``, hands the chosen row to the configuration writer it is given
(``fedmeta.cli.plan_config.write_config``, which knows the configuration schema).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedmeta.accounting.plan_request import (
    DESIGNS,
    Candidate,
    ComputeBudget,
    Design,
    Federation,
    Plan,
    PlanBudget,
    PlanRequest,
    PlanRow,
)
from fedmeta.accounting.planner import plan
from fedmeta.accounting.schemes import (
    ADD_REMOVE,
    NEIGHBOURING_RELATIONS,
)
from fedmeta.cli.arguments import (
    DEFAULT_DELTA,
    UsageError,
    add_epsilon_arg,
    eps_text,
    handled,
    json_eps,
)
from fedmeta.cli.privacy_sample_plan import (
    SAMPLE_PLAN_FLAGS,
    add_sample_plan_args,
    check_plan_level_flags,
    sample_plan,
)

#: Planner field -> the ``privacy plan`` flag a user should fix.
_PLAN_FLAGS = {
    "epsilon": "--epsilon",
    "delta": "--delta",
    "neighbouring": "--neighbouring",
    "participants": "--participants",
    "tasks_per_participant": "--tasks-per-participant",
    "max_tasks_per_round": "--max-tasks-per-round",
    "max_task_gradients": "--max-task-gradients",
    "max_participants_per_round": "--max-participants-per-round",
    "rounds": "--rounds",
    "participants_per_round": "--participants-per-round",
    "designs": "--designs",
    "clip": "--clip",
    "adaptive_count_noise": "--adaptive-count-noise",
    "dimension": "--dimension",
    "signal_norm": "--signal-norm",
    "top": "--top",
    "workers": "--jobs",
    "baseline": "--baseline",
}


_DESIGN_LABELS = {
    "flat_poisson": "all participants, Poisson",
    "two_stage_poisson": "two-stage, Poisson",
    "two_stage_fixed": "two-stage, fixed size",
}


@dataclass(frozen=True)
class WrittenConfig:
    """What a :data:`ConfigWriter` wrote: the file, and a line per setting it chose beyond the plan.

    The notes are the writer's (fedmeta's training advice, for example); accounting prints them.
    """

    path: str
    notes: tuple[str, ...] = ()


#: Writes a plan's row as a configuration file: ``(path, row, request, base_config) -> written``.
ConfigWriter = Callable[[str, PlanRow, PlanRequest, "str | None"], WrittenConfig]


#: The delta of the budget recorded for the data a written plan runs on (``base_config`` -> delta,
#: None when that data has no budget yet): a budget's delta is fixed, so the plan uses it.
BudgetDelta = Callable[["str | None"], "float | None"]


def _ints(flag: str, text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} must be integers separated by commas; got {text!r}") from None


def _baseline(text: str | None, request_rounds: tuple[int, ...] | None) -> Candidate | None:
    """``participants_per_round=5,task_rate=0.05[,rounds=400]`` (or ``tasks_per_round=10``)."""
    if text is None:
        return None
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("participants_per_round", "task_rate",
                                           "tasks_per_round", "rounds"):  # fmt: skip
            raise UsageError(
                "--baseline must be key=value pairs of participants_per_round, task_rate or "
                f"tasks_per_round, and rounds, separated by commas; got {item!r}"
            )
        fields[key.strip()] = value.strip()
    try:
        rounds = int(fields["rounds"]) if "rounds" in fields else (request_rounds or (0,))[0]
        n1 = int(fields["participants_per_round"])
        n2 = int(fields["tasks_per_round"]) if "tasks_per_round" in fields else None
        q2 = float(fields["task_rate"]) if "task_rate" in fields else None
    except (KeyError, ValueError) as error:
        raise UsageError(
            f"--baseline must give participants_per_round and numbers; got {text!r} ({error})"
        ) from None
    design: Design = "two_stage_fixed" if n2 is not None else "two_stage_poisson"
    try:
        return Candidate(design, n1, rounds, task_rate=q2, tasks_per_round=n2)
    except ValueError as error:
        raise UsageError(f"--baseline: {error}") from None


def _plan_request(args: argparse.Namespace) -> PlanRequest:
    counts = _ints("--tasks-per-participant", args.tasks_per_participant)
    if counts is None:
        raise UsageError("--tasks-per-participant must be given at task level")
    designs: Any = tuple(d.strip() for d in args.designs.split(",")) if args.designs else DESIGNS
    rounds = _ints("--rounds", args.rounds)
    return PlanRequest(
        budget=PlanBudget(args.epsilon, args.delta, args.neighbouring),
        federation=Federation(args.participants, counts),
        compute=ComputeBudget(
            args.max_tasks_per_round, args.max_task_gradients, args.max_participants_per_round
        ),
        rounds=rounds,
        participants_per_round=_ints("--participants-per-round", args.participants_per_round),
        designs=designs,  # PlanRequest validates the names
        clip=args.clip,
        adaptive_count_noise=args.adaptive_count_noise,
        baseline=_baseline(args.baseline, rounds),
        dimension=args.dimension,
        signal_norm=args.signal_norm,
    )


def _stage2(c: Candidate, min_tasks: int) -> str:
    if c.tasks_per_round is not None:
        return f"{c.tasks_per_round} of >= {min_tasks}"
    return f"q2={c.task_rate:g}" if c.design != "flat_poisson" else f"q={c.task_rate:g}"


def _row_json(row: PlanRow, request: PlanRequest, baseline: PlanRow | None) -> dict[str, Any]:
    c = row.candidate
    return {
        "design": c.design,
        "participants": request.federation.participants,
        "participants_per_round": c.participants_per_round,
        "stage2": "fixed" if c.tasks_per_round is not None else "poisson",
        "task_rate": c.task_rate,
        "tasks_per_round": c.tasks_per_round,
        "min_tasks": request.federation.min_tasks,
        "rounds": c.rounds,
        "expected_lot": row.expected_lot,
        "noise_multiplier": row.noise_multiplier,
        "gradient_noise_multiplier": row.gradient_noise_multiplier,
        "clip": row.clip,
        "noise_std": row.noise_std,
        "proxy": row.proxy,
        "round_snr": row.round_snr,
        "run_snr": row.run_snr,
        "epsilon": json_eps(row.epsilon),
        "task_gradients": row.task_gradients,
        "noise_vs_baseline": baseline.noise_std / row.noise_std if baseline else None,
        "event": row.event.to_dict(),
    }


_RANKED_BY_NOISE = (
    "ranked by noise std on the averaged gradient z_grad*C/E[lot], divided by sqrt(T)"
)


_RANKED_BY_SNR = (
    "ranked by signal-to-noise SNR*sqrt(T), SNR = G / sqrt(d*std^2 + (C^2-G^2)/E[lot]) with d={d} "
    "and G={g:g}: a heuristic for accuracy, not a privacy quantity (docs/privacy.md)"
)


def _print_plan(result: Plan, written: WrittenConfig | None, row: int) -> None:
    req = result.request
    b, f, c = req.budget, req.federation, req.compute
    counts = f.tasks_per_participant
    tasks = f"{counts[0]} tasks each" if f.uniform else f"{f.min_tasks}..{max(counts)} tasks"
    caps = ", ".join(
        f"{name} {value:g}"
        for name, value in (("lot <=", c.max_tasks_per_round), ("task-gradients <=",
                            c.max_task_gradients), ("n1 <=", c.max_participants_per_round))
        if value is not None
    )  # fmt: skip
    print(
        f"budget: epsilon {b.epsilon:g}, delta {b.delta:g}, {b.neighbouring}; federation: "
        f"{f.participants} participants, {tasks} ({f.total_tasks} in all); compute: "
        f"{caps or 'no cap'}; clip C={req.clip:g}"
    )
    snr = req.signal_norm is not None
    print(_RANKED_BY_SNR.format(d=req.dimension, g=req.signal_norm) if snr else _RANKED_BY_NOISE)
    adaptive = req.adaptive_count_noise is not None
    head = ["#", "design", "n1/P", "stage 2", "E[lot]", "T", "z"]
    head += ["z_grad"] if adaptive else []
    head += ["noise std", "std/sqrtT"] + (["SNR/round", "SNR*sqrtT"] if snr else [])
    head += ["epsilon", "task-grads"]
    head += ["x less noise"] if result.baseline else []
    lines = [head]
    listed = [(str(i), r) for i, r in enumerate(result.rows, 1)]
    listed += [("base", result.baseline)] if result.baseline else []
    for rank, r in listed:
        k = r.candidate
        cells = [rank, _DESIGN_LABELS[k.design], f"{k.participants_per_round}/{f.participants}",
                 _stage2(k, f.min_tasks), f"{r.expected_lot:.4g}", str(k.rounds),
                 f"{r.noise_multiplier:.4f}"]  # fmt: skip
        cells += [f"{r.gradient_noise_multiplier:.4f}"] if adaptive else []
        cells += [
            f"{r.noise_std:.4g}",
            f"{r.proxy:.3g}",
            *([f"{r.round_snr:.3g}", f"{r.run_snr:.3g}"] if snr else []),
            eps_text(r.epsilon),
            f"{r.task_gradients:.0f}",
        ]
        if result.baseline:
            cells.append(f"{result.baseline.noise_std / r.noise_std:.2f}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.ljust(w) if i < 4 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(line, widths, strict=True))))  # fmt: skip
    for note in result.notes:
        print(f"not feasible: {note}")
    if written:
        path = written.path
        print(f"wrote row {row} to {path}: run it with fedmeta simulate --config {path}")
        for note in written.notes:
            print(f"  {note}")


def _progress_line(stream: Any) -> Callable[[str, int, int], None]:
    """The planner's progress on stderr, terminal or not, while it searches.

    On a terminal one redrawn line; else (a log) a line when a stage starts, at each tenth of it
    and when it is done.
    """
    tty = bool(getattr(stream, "isatty", lambda: False)())

    def show(stage: str, done: int, total: int) -> None:
        if tty:
            end = "\n" if done == total else ""
            stream.write(f"\r{stage}: {done}/{total} calibrations{end}")
        elif done == total:
            stream.write(f"{stage}: {total} calibrations done\n")
        elif done * 10 // total > (done - 1) * 10 // total or done == 0:
            stream.write(f"{stage}: {done}/{total} calibrations\n")
        stream.flush()

    return show


def _plan_delta(args: argparse.Namespace, budget_delta: BudgetDelta | None) -> float:
    """``--delta``: given, else the budget's of the data a written plan runs on, else the default.

    A plan written for data whose budget has another delta would be refused by the run, so an
    explicit ``--delta`` that differs is refused here already.
    """
    recorded = budget_delta(args.base_config) if args.write_config and budget_delta else None
    if args.delta is None:
        return DEFAULT_DELTA if recorded is None else recorded
    if recorded is not None and args.delta != recorded:
        raise UsageError(
            f"--delta {args.delta:g} is not the delta of the budget recorded for this data "
            f"({recorded:g}; delta is fixed per budget): leave --delta out to plan at it, or "
            "start a separate budget with `fedmeta ledger new-budget`"
        )
    return float(args.delta)


def _cmd_plan(
    args: argparse.Namespace, writer: ConfigWriter | None, budget_delta: BudgetDelta | None
) -> int:
    check_plan_level_flags(args)
    if args.level == "sample":
        return sample_plan(args)
    if args.base_config and not args.write_config:
        raise UsageError("--base-config must come with --write-config")
    if args.write_config and writer is None:
        raise UsageError("--write-config must be run as `fedmeta privacy plan` (needs fedmeta)")
    args.delta = _plan_delta(args, budget_delta)
    request = _plan_request(args)
    result = plan(request, top=args.top, workers=args.jobs, progress=_progress_line(sys.stderr))
    written = None
    if args.write_config:
        if not 1 <= args.row <= len(result.rows):
            raise UsageError(f"--row must be in [1, {len(result.rows)}]; got {args.row}")
        assert writer is not None
        written = writer(args.write_config, result.rows[args.row - 1], request, args.base_config)
    if args.json:
        payload = {
            "budget": vars(request.budget),
            "federation": {
                "participants": request.federation.participants,
                "tasks_per_participant": list(request.federation.tasks_per_participant),
                "total_tasks": request.federation.total_tasks,
            },  # fmt: skip
            "compute": vars(request.compute),
            "clip": request.clip,
            "adaptive_count_noise": request.adaptive_count_noise,
            "proxy": "noise_std / sqrt(rounds), noise_std = gradient_noise_multiplier * clip / "
            "expected_lot",
            "dimension": request.dimension,
            "signal_norm": request.signal_norm,
            "ranked_by": "run_snr = round_snr * sqrt(rounds), round_snr = signal_norm / "
            "sqrt(dimension * noise_std^2 + (clip^2 - signal_norm^2) / expected_lot)"
            if request.signal_norm is not None
            else "proxy",
            "rows": [_row_json(r, request, result.baseline) for r in result.rows],
            "baseline": _row_json(result.baseline, request, result.baseline)
            if result.baseline
            else None,
            "notes": list(result.notes),
            "config_written": written.path if written else None,
            "config_notes": list(written.notes) if written else [],
        }
        print(json.dumps(payload, indent=2, sort_keys=True))
    else:
        _print_plan(result, written, args.row)
    return 0


def add_plan_parser(
    psub: Any, writer: ConfigWriter | None, budget_delta: BudgetDelta | None
) -> None:
    """Add ``plan`` below ``privacy``; ``--write-config`` calls ``writer`` (None: refused)."""
    p = psub.add_parser(
        "plan",
        help="search sampling, rounds and noise for the least noise per averaged gradient",
        description="Search participants per round, the stage-2 rate or size, rounds and the "
        "noise multiplier; rank the configurations that meet the budget and the compute caps by "
        "the noise std on the averaged gradient over sqrt(rounds) (docs/privacy.md, 'Planning "
        "a run').",
    )
    add_epsilon_arg(p, "epsilon budget")
    p.add_argument(
        "--delta", type=float, default=None,
        help=f"delta (default: with --write-config, the delta of the budget recorded for the data "
        f"the configuration runs on; else {DEFAULT_DELTA:g}, as privacy.delta)",
    )  # fmt: skip
    p.add_argument("--neighbouring", choices=NEIGHBOURING_RELATIONS, default=ADD_REMOVE)
    p.add_argument("--participants", type=int, required=True, help="P, registered participants")
    p.add_argument(
        "--tasks-per-participant", metavar="N[,N...]",
        help="every participant's task count (one number), or one count per participant "
        "(required at task level)",
    )  # fmt: skip
    p.add_argument("--max-tasks-per-round", type=float, help="cap on the expected lot")
    p.add_argument("--max-task-gradients", type=float, help="cap on rounds * expected lot")
    p.add_argument("--max-participants-per-round", type=int, help="cap on n1 (communication)")
    p.add_argument("--rounds", metavar="T[,T...]",
                   help="candidate rounds (default: a grid around max-task-gradients / "
                   "max-tasks-per-round)")  # fmt: skip
    p.add_argument("--participants-per-round", metavar="N1[,N1...]",
                   help="candidate n1 (default P, then halving to 1)")  # fmt: skip
    p.add_argument("--designs", help=f"comma-separated subset of {','.join(DESIGNS)}")
    p.add_argument("--clip", type=float, default=1.0, help="clip bound C (default 1.0)")
    p.add_argument("--adaptive-count-noise", type=float,
                   help="adaptive clipping's count noise sigma_b (shows its cost)")  # fmt: skip
    _add_signal_args(p)
    p.add_argument("--baseline", metavar="KEY=VALUE,...",
                   help="a configuration to compare, e.g. participants_per_round=5,task_rate=0.05,"
                   "rounds=400")  # fmt: skip
    p.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes for the calibrations (default: up to 4 cores)")  # fmt: skip
    p.add_argument(
        "--write-config",
        metavar="PATH",
        help="write the chosen row as a configuration for fedmeta simulate --config",
    )
    p.add_argument("--row", type=int, default=1, help="which row --write-config writes")
    p.add_argument("--base-config", metavar="PATH",
                   help="TOML configuration whose other keys the written one keeps")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_sample_plan_args(p)

    def body(args: argparse.Namespace) -> int:
        return _cmd_plan(args, writer, budget_delta)

    p.set_defaults(func=handled("privacy plan", body, {**SAMPLE_PLAN_FLAGS, **_PLAN_FLAGS}))


def _add_signal_args(p: Any) -> None:
    """``--dimension`` and ``--signal-norm``: the inputs of the signal-to-noise ranking."""
    p.add_argument(
        "--dimension",
        type=int,
        metavar="D",
        help="trained parameters d; with --signal-norm, rank by signal-to-noise",
    )
    p.add_argument(
        "--signal-norm",
        type=float,
        metavar="G",
        help="norm of the mean clipped per-task gradient at --clip, measured on public "
        "or synthetic tasks (python bench/signal_norm.py); with --dimension",
    )
