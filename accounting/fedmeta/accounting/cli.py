"""``fedmeta privacy epsilon|calibrate|max-rounds|compare|plan`` and ``fedmeta ledger ...``.

Human-readable tables by default, ``--json`` for machines. Bad input is reported as one line naming
the flag and what it must be, with exit status 2 (argparse's convention), never a traceback. Imports
only ``accounting`` (no torch, no Flower), so the planner starts fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedmeta.accounting.composition import (
    MAX_ROUNDS_LIMIT,
    calibrate_noise_multiplier,
    epsilon,
    max_rounds,
    tombs2022_published_epsilon,
)
from fedmeta.accounting.ledger import (
    BudgetLedger,
    LedgerError,
    accept_rollback,
    backup,
    budgets,
    migrate_to_participants,
    start_new_budget,
)
from fedmeta.accounting.planner import (
    DESIGNS,
    Candidate,
    ComputeBudget,
    Design,
    Federation,
    Plan,
    PlanBudget,
    PlanRequest,
    PlanRow,
    plan,
)
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
    participant_level_note,
)

PUBLISHED_LABEL = "as published, not a valid guarantee"
#: The CLI's default delta: the configuration's default (``privacy.delta``), so a plan printed here
#: matches what a run with the default configuration enforces (a test keeps them equal).
DEFAULT_DELTA = 1e-5

# Dataclass field / argument name -> the flag a user should fix.
_FLAGS = {
    "participants": "--participants",
    "participants_per_round": "--participants-per-round",
    "task_rate": "--task-rate",
    "tasks_per_round": "--tasks-per-round",
    "min_tasks": "--min-tasks",
    "rate": "--flat-poisson-rate",
    "sample_size": "--sample-size",
    "population": "--population",
    "noise_multiplier": "--noise-multiplier",
    "max_tasks_per_participant": "--max-tasks-per-participant",
    "delta": "--delta",
    "rounds": "--rounds",
    "round count": "--rounds",
    "target_epsilon": "--epsilon",
    "epsilon_budget": "--epsilon",
    "unit": "--unit",
    "neighbouring": "--neighbouring",
}


class UsageError(Exception):
    """A user error with the flag to fix; printed as one line, exit status 2."""


def _flag_for(message: str, flags: dict[str, str] | None = None) -> str | None:
    match = re.match(r"([a-z_ ]+?) must", message)
    return (flags or _FLAGS).get(match.group(1)) if match else None


def _run(
    command: str,
    body: Callable[[argparse.Namespace], int],
    flags: dict[str, str] | None = None,
) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except BrokenPipeError:
            raise  # the reader closed the pipe (`| head`): the dispatcher ends quietly
        except (UsageError, ValueError, LedgerError, OSError) as error:
            message = str(error)
            flag = _flag_for(message, flags)
            prefix = f"{flag}: " if flag else ""
            print(f"fedmeta {command}: error: {prefix}{message}", file=sys.stderr)
            return 2

    return handler


# ------------------------------------------------------------------------------------ arguments


def _add_scheme_args(
    parser: argparse.ArgumentParser, *, noise: bool = True, rounds: bool = True
) -> None:
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
    if noise:
        parser.add_argument("--noise-multiplier", type=float, required=True, help="z (std / clip)")
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


def _emit(args: argparse.Namespace, payload: dict[str, Any], rows: list[tuple[str, str]]) -> None:
    if args.json:
        print(json.dumps(payload, indent=2, sort_keys=True))
        return
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")


def _check_rounds(value: int) -> None:
    if not 1 <= value <= MAX_ROUNDS_LIMIT:
        raise UsageError(
            f"--rounds must be an integer in [1, {MAX_ROUNDS_LIMIT}] (the accountant's range); "
            f"got {value}"
        )


def _eps(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if math.isfinite(value) else "inf (no finite bound)"


def _json_eps(value: float) -> float | None:
    # JSON has no infinity: an unbounded epsilon is null.
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------------------------ commands


def _event(args: argparse.Namespace, scheme: Scheme, z: float) -> GaussianRound:
    return GaussianRound(scheme, z, args.max_tasks_per_participant, args.neighbouring)


def _cmd_epsilon(args: argparse.Namespace) -> int:
    scheme = _scheme_from_args(args)
    _check_rounds(args.rounds)
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
        "epsilon": _json_eps(eps),
        "epsilon_rdp": _json_eps(eps_rdp),
    }
    rows = [
        ("scheme", payload["scheme"]),
        ("unit", args.unit),
        ("neighbouring", args.neighbouring),
        ("rounds", str(args.rounds)),
        ("noise multiplier", f"{args.noise_multiplier:g}"),
        ("delta", f"{args.delta:g}"),
        ("epsilon (PLD, enforced)", _eps(eps)),
        ("epsilon (RDP cross-check)", _eps(eps_rdp)),
    ]
    if (
        args.unit == "task"
        and args.neighbouring == ADD_REMOVE
        and isinstance(scheme, TwoStagePoissonScheme | TwoStageFixedScheme)
    ):
        # Theorem 3 is an add/remove statement: shown only beside an add/remove guarantee.
        published = tombs2022_published_epsilon(event, args.rounds, args.delta)
        payload["epsilon_tombs2022_published"] = _json_eps(published)
        payload["epsilon_tombs2022_published_note"] = PUBLISHED_LABEL
        rows.append((f"Tombs et al. 2022 Thm 3 ({PUBLISHED_LABEL})", _eps(published)))
    _emit(args, payload, rows)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.epsilon is not None and args.old_epsilon is not None:
        raise UsageError("--epsilon and --target-epsilon are the same flag; give one")
    args.target_epsilon = args.epsilon if args.epsilon is not None else args.old_epsilon
    if args.target_epsilon is None:
        raise UsageError("--epsilon (the target epsilon) is required")
    scheme = _scheme_from_args(args)
    _check_rounds(args.rounds)
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
    _emit(
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
            ("epsilon (PLD) at it", _eps(eps)),
        ],
    )
    return 0


def _cmd_max_rounds(args: argparse.Namespace) -> int:
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
    _emit(
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
            ("epsilon (PLD) after them", _eps(eps)),
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
                "epsilon": _json_eps(epsilon(groups, d, unit, "pld")),
                "epsilon_rdp": _json_eps(epsilon(groups, d, unit, "rdp")),
            }
        )
    if rel == ADD_REMOVE:  # Theorem 3 is an add/remove statement
        published = tombs2022_published_epsilon(GaussianRound(fixed, z), t, d)
        rows_json.append(
            {
                "design": f"Tombs et al. 2022 Thm 3, eta={eta:g} ({PUBLISHED_LABEL})",
                "unit": "task",
                "valid": False,
                "epsilon": _json_eps(published),
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


def _participant_rows(ledger: BudgetLedger, wanted: bool) -> list[dict[str, Any]] | None:
    """The per-participant table (operator only: the ledger is as private as checkpoints)."""
    if not wanted:
        return None
    return [
        {"name": p.name, "key": p.key, "rounds": p.rounds, "epsilon": p.epsilon,
         "data_versions": p.data_versions}
        for p in ledger.participants()
    ]  # fmt: skip


def _federation_report(db: str, fid: str, participants: bool = False) -> dict[str, Any]:
    """One federation of a ledger, read-only: what ``ledger show`` prints."""
    with BudgetLedger.open_readonly(db, fid) as ledger:
        groups = ledger.rounds()
        table = _participant_rows(ledger, participants)
        runs: dict[str, dict[str, int]] = {}
        for rec in ledger.records():
            # Rounds are numbered from 1, as in summary.json and rounds.csv; the ledger keeps the
            # 0-based index it was spent with.
            number = rec.round_index + 1
            run = runs.setdefault(
                rec.run_id, {"spends": 0, "first_round": number, "last_round": number}
            )
            run["spends"] += 1
            run["first_round"] = min(run["first_round"], number)
            run["last_round"] = max(run["last_round"], number)
        notes = [n for n in (participant_level_note(e) for e, _ in groups) if n is not None]
        try:
            # Participant level: RDP, as the run summary reports it (PLD would need gigabytes).
            eps_part: float | None = ledger.epsilon(unit="participant", method="rdp")
        except ValueError:  # no participants, or no recorded cap
            eps_part = None
        return {
            "federation_id": fid,
            "epsilon_budget": ledger.epsilon_budget,
            "delta": ledger.delta,
            "unit": ledger.unit,
            "neighbouring": ledger.neighbouring,
            "records": ledger.position(),
            "epsilon": ledger.epsilon(),
            "epsilon_rdp": ledger.epsilon(method="rdp"),
            "epsilon_participant": eps_part,
            "participant_level_note": notes[0] if notes else None,
            "runs": runs,
            "rounds": [{"event": e.to_dict(), "count": c} for e, c in groups],
            "participants": table,
            "public_data": [
                {"run_id": r.run_id, "recorded_on": r.created_at, **asdict(r.use)}
                for r in ledger.public_uses()
            ],
        }


def _ledger_report(db: str, federation: str | None, participants: bool = False) -> dict[str, Any]:
    info = BudgetLedger.describe(db)
    ids = [federation] if federation else list(info.federations)
    data: dict[str, list[dict[str, Any]]] = {}
    budget_of: dict[str, dict[str, Any]] = {}
    for record in budgets(db):
        entry = {
            "number": record.number,
            "federation_id": record.federation_id,
            "reason": record.reason,
            "actor": record.actor,
            "created_at": record.created_at,
        }
        data.setdefault(record.data_key, []).append(entry)
        budget_of[record.federation_id] = {"data_key": record.data_key, **entry}
    feds = []
    for fid in ids:
        report = _federation_report(db, fid, participants)
        report["budget"] = budget_of.get(fid)
        feds.append(report)
    return {
        "db": str(info.path),
        "ledger_id": info.ledger_id,
        "schema_version": info.schema_version,
        "mode": info.mode,
        "created_at": info.created_at,
        "data": [
            {"data_key": key, "current": entries[-1]["federation_id"], "budgets": entries}
            for key, entries in sorted(data.items())
            if federation is None or any(e["federation_id"] == federation for e in entries)
        ],
        "federations": feds,
    }


def _print_ledger_report(report: dict[str, Any]) -> None:
    ident = (
        f"id {report['ledger_id']}, schema {report['schema_version']}, {report['mode']} runs only"
        if report["ledger_id"]
        else "legacy, no id (written by an older fedmeta; its next writable open adds one)"
    )
    print(f"ledger {report['db']}: {ident}")
    for d in report["data"]:
        print(f"data {d['data_key']}: {len(d['budgets'])} budget(s), current {d['current']}")
        for b in d["budgets"]:
            print(
                f"  budget {b['number']} {b['federation_id']}: started {b['created_at']} by "
                f"{b['actor']}; reason: {b['reason']}"
            )
    if not report["federations"]:
        print("no federations")
    for e in report["federations"]:
        part = "-" if e["epsilon_participant"] is None else f"{e['epsilon_participant']:.4g} (RDP)"
        if e["participant_level_note"]:
            part = f"{e['participant_level_note']} (valid but vacuous bound: {part})"
        print(
            f"federation {e['federation_id']}: {e['records']} spends, epsilon {e['epsilon']:.4f} "
            f"(PLD, {e['unit']} level, most exposed participant, enforced) / "
            f"{e['epsilon_rdp']:.4f} (RDP) of budget "
            f"{e['epsilon_budget']:g} at delta {e['delta']:g}; relation {e['neighbouring']}"
        )
        if e["budget"]:
            print(f"  budget {e['budget']['number']} of data {e['budget']['data_key']}")
        print(f"  participant level: {part}")
        for run_id, run in sorted(e["runs"].items()):
            print(
                f"  run {run_id}: {run['spends']} spends, rounds "
                f"{run['first_round']}..{run['last_round']}"
            )
        for g in e["rounds"]:
            print(f"  {g['count']} x {json.dumps(g['event'], sort_keys=True)}")
        _print_participants(e["participants"])
        _print_public_data(e["public_data"])


def _print_participants(rows: list[dict[str, Any]] | None) -> None:
    if rows is None:
        return
    print(f"  {len(rows)} participant(s): name, key, rounds charged, epsilon, data versions")
    for p in rows:
        print(
            f"    {p['name']}  {p['key']}  {p['rounds']}  {p['epsilon']:.4f}  "
            f"{p['data_versions']}{'  (data edited)' if p['data_versions'] > 1 else ''}"
        )


def _print_public_data(rows: list[dict[str, Any]]) -> None:
    """Public data runs on this budget used: their results rest on it too (issue 19)."""
    if not rows:
        print("  public data: none declared (no run on this budget used public data)")
    for r in rows:
        checked = "checked" if r["disjoint_from_private"] else "NOT checked"
        print(
            f"  public data of run {r['run_id']} ({r['recorded_on']}): {r['description']}, "
            f"{r['items']} items, digest {r['digest'][:16]}, {r['use']}; disjoint from the "
            f"private data: {checked}"
        )


def _cmd_ledger_show(args: argparse.Namespace) -> int:
    report = _ledger_report(args.db, args.federation, args.participants)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_ledger_report(report)
        experiments = _experiments_line(args)
        if experiments:
            print(experiments)
    return 0


def _experiments_line(args: argparse.Namespace) -> str | None:
    """Where the default ledger is shown: experiments keep their own, and which exist."""
    where: LedgerLocations | None = getattr(args, "locations", None)
    if where is None or Path(args.db) != where.default:
        return None
    try:
        folder = where.experiment("x").parent
    except argparse.ArgumentTypeError:  # no state directory: no experiments
        return None
    names = sorted(p.stem for p in folder.glob("*.sqlite")) if folder.is_dir() else []
    found = ", ".join(names) if names else "none yet"
    return (
        "experiments on public data (fedmeta simulate --experiment NAME) spend from ledgers of "
        f"their own, not shown here: {found}; see one with `fedmeta ledger show --experiment NAME`"
    )


def _cmd_ledger_backup(args: argparse.Namespace) -> int:
    to = Path(args.to).expanduser()
    if to.is_dir():  # as cp does: a directory receives a copy under the ledger's own file name
        to = to / Path(args.db).name
    result = backup(args.db, to, force=args.force)
    payload = {
        "path": str(result.path),
        "ledger_id": result.ledger_id,
        "records": result.positions,
    }
    if args.json:
        print(json.dumps(payload, indent=2, sort_keys=True))
        return 0
    total = sum(result.positions.values())
    print(
        f"backed up ledger {result.ledger_id or '(legacy, no id)'} to {result.path}: "
        f"{len(result.positions)} federation(s), {total} record(s), verified by reopening"
    )
    return 0


def _cmd_ledger_new_budget(args: argparse.Namespace) -> int:
    new_id = start_new_budget(args.db, args.federation, args.reason, who=args.who,
                              epsilon_budget=args.epsilon, delta=args.delta)  # fmt: skip
    terms = (
        f"epsilon {args.epsilon:g}" + (f", delta {args.delta:g}" if args.delta is not None else "")
        if args.epsilon is not None
        else "terms set by the next run's privacy.epsilon_budget and privacy.delta"
    )
    if args.json:
        out = {"previous": args.federation, "federation_id": new_id,
               "epsilon_budget": args.epsilon, "delta": args.delta}  # fmt: skip
        print(json.dumps(out, indent=2))
    else:
        print(
            f"new budget {new_id} for the data of {args.federation}, {terms} "
            f"(recorded: {args.reason})"
        )
    return 0


def _cmd_ledger_accept_rollback(args: argparse.Namespace) -> int:
    found = accept_rollback(args.db, args.reason, ledger_id=args.ledger_id, head=args.head,
                            who=args.who)  # fmt: skip
    if args.json:
        print(json.dumps({"accepted": found, "reason": args.reason}, indent=2))
    else:
        print(f"accepted and recorded ({args.reason}): {found}")
    return 0


def _cmd_ledger_migrate(args: argparse.Namespace) -> int:
    carried = migrate_to_participants(args.db, who=args.who)
    if args.json:
        print(json.dumps({"carried": carried}, indent=2))
    elif carried:
        print(
            f"carried {len(carried)} whole-data budget(s) into per-participant budgets (each of "
            f"their spends counts against every participant of the same data): {', '.join(carried)}"
        )
    else:
        print(f"nothing to migrate in {args.db}: no whole-data budget holds uncarried spends")
    return 0


# ------------------------------------------------------------------------------------ plan

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
    assert counts is not None  # a required flag
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
        "epsilon": _json_eps(row.epsilon),
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
            _eps(r.epsilon),
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


def _add_plan_parser(
    psub: Any, writer: ConfigWriter | None, budget_delta: BudgetDelta | None
) -> None:
    p = psub.add_parser(
        "plan",
        help="search sampling, rounds and noise for the least noise per averaged gradient",
        description="Search participants per round, the stage-2 rate or size, rounds and the "
        "noise multiplier; rank the configurations that meet the budget and the compute caps by "
        "the noise std on the averaged gradient over sqrt(rounds) (docs/privacy.md, 'Planning "
        "a run').",
    )
    _add_epsilon_arg(p, "epsilon budget (task level)")
    p.add_argument(
        "--delta", type=float, default=None,
        help=f"delta (default: with --write-config, the delta of the budget recorded for the data "
        f"the configuration runs on; else {DEFAULT_DELTA:g}, as privacy.delta)",
    )  # fmt: skip
    p.add_argument("--neighbouring", choices=NEIGHBOURING_RELATIONS, default=ADD_REMOVE)
    p.add_argument("--participants", type=int, required=True, help="P, registered participants")
    p.add_argument(
        "--tasks-per-participant", required=True, metavar="N[,N...]",
        help="every participant's task count (one number), or one count per participant",
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
    p.set_defaults(
        func=_run("privacy plan", lambda args: _cmd_plan(args, writer, budget_delta), _PLAN_FLAGS)
    )


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


# ------------------------------------------------------------------------------------ register


def _epsilon_value(text: str) -> float:
    """``--epsilon``: a number in (0, 1000], the range ``privacy.epsilon_budget`` accepts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1000):
        raise argparse.ArgumentTypeError(
            f"must be in (0, 1000], as privacy.epsilon_budget; got {text}"
        )
    return value


def _add_epsilon_arg(p: Any, help_text: str, old: str | None = None) -> None:
    """``--epsilon`` on every command that takes one; ``old`` is an earlier spelling, hidden."""
    p.add_argument("--epsilon", type=_epsilon_value, required=old is None, help=help_text)
    if old is not None:  # either spelling, the handler checks that one was given
        p.add_argument(old, dest="old_epsilon", type=_epsilon_value, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class LedgerLocations:
    """Where fedmeta keeps ledgers (``accounting`` cannot know): the default one, experiments'."""

    default: Path
    experiment: Callable[[str], Path]


def _add_db_arg(p: Any, help_text: str, where: LedgerLocations | None) -> None:
    """``--db``: required unless the caller knows the default ledger (fedmeta's state dir).

    With it, ``--experiment NAME`` names an experiment's own ledger instead.
    """
    if where is None:
        p.add_argument("--db", required=True, help=help_text)
        return
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--db", default=str(where.default), help=f"{help_text} (default: %(default)s)"
    )
    group.add_argument(
        "--experiment", dest="db", metavar="NAME", type=lambda name: str(where.experiment(name)),
        help="the ledger of experiment NAME (fedmeta simulate --experiment NAME)",
    )  # fmt: skip


def register(
    subparsers: Any,
    *,
    config_writer: ConfigWriter | None = None,
    default_ledger: Path | None = None,
    experiment_ledger: Callable[[str], Path] | None = None,
    budget_delta: BudgetDelta | None = None,
) -> None:
    """Add ``privacy`` and ``ledger`` to the top-level ``fedmeta`` parser.

    ``config_writer`` lets ``privacy plan --write-config`` write a run configuration; the fedmeta
    command line passes one (``fedmeta.cli.plan_config``), since ``accounting`` knows no
    configuration.
    ``default_ledger`` makes ``--db`` optional (fedmeta passes its state directory's ledger, which
    ``accounting`` cannot know); ``experiment_ledger`` maps ``--experiment NAME`` to a ledger;
    ``budget_delta`` gives ``privacy plan --write-config`` the delta of the data's budget.
    """
    privacy = subparsers.add_parser("privacy", help="privacy accounting and planning")
    psub = privacy.add_subparsers(dest="privacy_command", metavar="SUBCOMMAND")
    psub.required = True

    p = psub.add_parser("epsilon", help="epsilon after T rounds (PLD enforced, RDP cross-check)")
    _add_scheme_args(p)
    p.set_defaults(func=_run("privacy epsilon", _cmd_epsilon))

    p = psub.add_parser("calibrate", help="smallest noise multiplier meeting a target epsilon")
    _add_scheme_args(p, noise=False)
    _add_epsilon_arg(p, "target epsilon", old="--target-epsilon")
    p.set_defaults(func=_run("privacy calibrate", _cmd_calibrate))

    p = psub.add_parser("max-rounds", help="largest T within an epsilon budget (exact under PLD)")
    _add_scheme_args(p, rounds=False)
    _add_epsilon_arg(p, "epsilon budget")
    p.set_defaults(func=_run("privacy max-rounds", _cmd_max_rounds))

    p = psub.add_parser("compare", help="compare sampling designs at the same expected lot size")
    _add_scheme_args(p)
    p.set_defaults(func=_run("privacy compare", _cmd_compare))

    _add_plan_parser(psub, config_writer, budget_delta)
    where = (
        None
        if default_ledger is None
        else LedgerLocations(default_ledger, experiment_ledger or _no_experiments)
    )
    _add_ledger_parser(subparsers, where)


def _no_experiments(name: str) -> Path:
    raise argparse.ArgumentTypeError("experiments need fedmeta's state directory; use --db")


def _add_ledger_parser(subparsers: Any, default_ledger: LedgerLocations | None) -> None:
    """``fedmeta ledger show|migrate|backup|new-budget|accept-rollback``."""
    ledger = subparsers.add_parser("ledger", help="inspect, back up and manage a budget ledger")
    lsub = ledger.add_subparsers(dest="ledger_command", metavar="SUBCOMMAND")
    lsub.required = True
    p = lsub.add_parser(
        "show", help="every federation, budget and run with the current guarantee (read-only)"
    )
    _add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--federation", help="only this federation id")
    p.add_argument(
        "--participants", action="store_true",
        help="the per-participant table: rounds charged, epsilon, data versions (private)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run("ledger show", _cmd_ledger_show), locations=default_ledger)
    p = lsub.add_parser(
        "migrate",
        help="carry whole-data (schema 2) budgets into per-participant budgets (recorded)",
    )
    _add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--who", help="who migrates (default user@host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run("ledger migrate", _cmd_ledger_migrate))
    p = lsub.add_parser(
        "accept-rollback",
        help="accept, on record, a ledger behind its anchor or a run's checkpoint (restored copy)",
    )
    _add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--reason", required=True, help="why (recorded for good)")
    p.add_argument("--ledger-id", help="the ledger id a checkpoint names (default: the anchor)")
    p.add_argument("--head", help="the hash of the last spend the checkpoint names")
    p.add_argument("--who", help="who accepts (default user@host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run("ledger accept-rollback", _cmd_ledger_accept_rollback))
    _add_ledger_budget_parsers(lsub, default_ledger)


def _add_ledger_budget_parsers(lsub: Any, default_ledger: LedgerLocations | None) -> None:
    """``fedmeta ledger backup|new-budget``: the copies and the deliberate new budget."""
    p = lsub.add_parser(
        "backup",
        help="consistent, atomic, verified copy (also the way to restore: swap --db and --to)",
    )
    _add_db_arg(p, "the ledger to copy", default_ledger)
    p.add_argument(
        "--to", required=True,
        help="the copy (replaced atomically); a directory gets the ledger's file name",
    )  # fmt: skip
    p.add_argument(
        "--force",
        action="store_true",
        help="replace --to even if it is another ledger or holds spends --db lacks (forgets them)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run("ledger backup", _cmd_ledger_backup))
    p = lsub.add_parser(
        "new-budget",
        help="start a new budget for the data of a federation (recorded with who, when, why)",
    )
    _add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--federation", required=True, help="the data's current federation id")
    p.add_argument("--reason", required=True, help="why a new budget (recorded for good)")
    p.add_argument(
        "--epsilon", type=_epsilon_value,
        help="the new budget's epsilon, set now (default: the next run's privacy.epsilon_budget)",
    )  # fmt: skip
    p.add_argument(
        "--delta", type=float,
        help="the new budget's delta, fixed with it (default: the old budget's); needs --epsilon",
    )  # fmt: skip
    p.add_argument("--who", help="who starts it (default user@host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run("ledger new-budget", _cmd_ledger_new_budget))
