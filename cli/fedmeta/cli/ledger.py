"""``fedmeta ledger show|migrate|accept-rollback|backup|new-budget``: the budget ledger's commands.

Human-readable tables by default, ``--json`` for machines; ``show`` opens the ledger read-only.
The ledger itself, and every rule these commands apply, is ``fedmeta.accounting.ledger``'s.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedmeta.accounting.ledger import (
    BudgetLedger,
    EpsilonCache,
    accept_rollback,
    backup,
    budgets,
    end_run_reservation,
    migrate_to_participants,
    start_new_budget,
)
from fedmeta.accounting.schemes import (
    GaussianRound,
    participant_level_note,
)
from fedmeta.cli.arguments import (
    LedgerLocations,
    add_db_arg,
    epsilon_value,
    handled,
    no_experiments,
)


def _participant_rows(ledger: BudgetLedger, wanted: bool) -> list[dict[str, Any]] | None:
    """The per-participant table (operator only: the ledger is as private as checkpoints)."""
    if not wanted:
        return None
    return [
        {"name": p.name, "key": p.key, "rounds": p.rounds, "epsilon": p.epsilon,
         "data_versions": p.data_versions,
         "runs": [{"run_id": r, "charged": k, "spends": n} for r, k, n in p.runs]}
        for p in ledger.participants()
    ]  # fmt: skip


def _federation_report(
    db: str, fid: str, participants: bool = False, kept: EpsilonCache | None = None
) -> dict[str, Any]:
    """One federation of a ledger, read-only: what ``ledger show`` prints.

    ``kept``: composed epsilons found under the hash of their inputs, the records read now
    (epsilon_cache.py); without it every epsilon is composed here.
    """
    with BudgetLedger.open_readonly(db, fid) as ledger:
        if kept is not None:
            ledger.keep_epsilons(kept)
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
        rounds = [e for e, _ in groups if isinstance(e, GaussianRound)]  # not tuning releases
        notes = [n for n in (participant_level_note(e) for e in rounds) if n is not None]
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
            "level": ledger.recorded_level(),  # task, sample (one example), or None: no spends
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
            "reservations": [
                {"run_id": r.run_id, "rounds": r.rounds, "event": r.event.to_dict()}
                for r in ledger.reservations()
            ],
        }


def _ledger_report(
    db: str, federation: str | None, participants: bool = False, kept: EpsilonCache | None = None
) -> dict[str, Any]:
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
        report = _federation_report(db, fid, participants, kept)
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


def _level_text(federation: dict[str, Any]) -> str:
    """What the epsilon protects: one example at sample level (issue 53), else the unit."""
    return "example level" if federation["level"] == "sample" else f"{federation['unit']} level"


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
            f"(PLD, {_level_text(e)}, most exposed participant, enforced) / "
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
            event = g["event"]  # a tuning release by its plan, not its curve (--json has it)
            release = event.get("kind") == "tuning_release"
            text = event["description"] if release else json.dumps(event, sort_keys=True)
            print(f"  {g['count']} x {text}")
        _print_participants(e["participants"])
        _print_public_data(e["public_data"])
        for r in e["reservations"]:  # runs in progress, or crashed (docs/ledger.md)
            print(f"  run {r['run_id']} in progress: up to {r['rounds']} round(s) reserved "
                  "(`ledger end-reservation` ends it if the run will not resume)")  # fmt: skip


def _print_participants(rows: list[dict[str, Any]] | None) -> None:
    if rows is None:
        return
    print(f"  {len(rows)} participant(s): name, key, rounds charged, epsilon, data versions; "
          "(took part in ...): a run's spends it was excluded from")  # fmt: skip
    for p in rows:
        partly = [f"run {r['run_id']}: {r['charged']} of {r['spends']}" for r in p["runs"]
                  if r["charged"] < r["spends"]]  # fmt: skip
        print(
            f"    {p['name']}  {p['key']}  {p['rounds']}  {p['epsilon']:.4f}  "
            f"{p['data_versions']}{'  (data edited)' if p['data_versions'] > 1 else ''}"
            + (f"  (took part in {', '.join(partly)})" if partly else "")
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
    where: Path | None = getattr(args, "epsilon_cache", None)
    kept = None if where is None else EpsilonCache(where, read=not args.recompute)
    report = _ledger_report(args.db, args.federation, args.participants, kept)
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


def _cmd_ledger_end_reservation(args: argparse.Namespace) -> int:
    held = end_run_reservation(args.db, args.federation, args.run)
    if args.json:
        print(json.dumps({"run_id": args.run, "ended": held}, indent=2))
    elif held:
        print(f"ended the reservation of run {args.run} in federation {args.federation}")
    else:
        print(f"run {args.run} holds no reservation in federation {args.federation}: nothing "
              "to end")  # fmt: skip
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


def register(
    subparsers: Any,
    *,
    default_ledger: Path | None = None,
    experiment_ledger: Callable[[str], Path] | None = None,
    epsilon_cache: Path | None = None,
) -> None:
    """Add ``ledger`` to the top-level ``fedmeta`` parser.

    ``default_ledger`` makes ``--db`` optional (fedmeta passes its state directory's ledger);
    ``experiment_ledger`` maps ``--experiment NAME`` to an experiment's ledger; ``epsilon_cache``
    is where ``show`` keeps the epsilons it composed (None: it composes every one each time).
    """
    where = (
        None
        if default_ledger is None
        else LedgerLocations(default_ledger, experiment_ledger or no_experiments)
    )
    _add_ledger_parser(subparsers, where, epsilon_cache)


def _add_ledger_parser(
    subparsers: Any, default_ledger: LedgerLocations | None, epsilon_cache: Path | None
) -> None:
    """``fedmeta ledger show|migrate|backup|new-budget|accept-rollback|end-reservation``."""
    ledger = subparsers.add_parser("ledger", help="inspect, back up and manage a budget ledger")
    lsub = ledger.add_subparsers(dest="ledger_command", metavar="SUBCOMMAND")
    lsub.required = True
    p = lsub.add_parser(
        "show", help="every federation, budget and run with the current guarantee (read-only)"
    )
    add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--federation", help="only this federation id")
    p.add_argument(
        "--participants", action="store_true",
        help="the per-participant table: rounds charged, epsilon, data versions (private)",
    )  # fmt: skip
    p.add_argument(
        "--recompute", action="store_true",
        help="compose every epsilon afresh, reading none kept by an earlier show (each is kept "
        "only under the hash of the records it was composed from), and keep these instead",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=handled("ledger show", _cmd_ledger_show), locations=default_ledger,
                   epsilon_cache=epsilon_cache)  # fmt: skip
    p = lsub.add_parser(
        "migrate",
        help="carry whole-data (schema 2) budgets into per-participant budgets (recorded)",
    )
    add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--who", help="who migrates (default user@host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=handled("ledger migrate", _cmd_ledger_migrate))
    p = lsub.add_parser(
        "accept-rollback",
        help="accept, on record, a ledger behind its anchor or a run's checkpoint (restored copy)",
    )
    add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--reason", required=True, help="why (recorded for good)")
    p.add_argument("--ledger-id", help="the ledger id a checkpoint names (default: the anchor)")
    p.add_argument("--head", help="the hash of the last spend the checkpoint names")
    p.add_argument("--who", help="who accepts (default user@host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=handled("ledger accept-rollback", _cmd_ledger_accept_rollback))
    p = lsub.add_parser(
        "end-reservation",
        help="end the reservation of a run that crashed and will not resume (docs/ledger.md)",
    )
    add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--federation", required=True, help="the federation id the run spends from")
    p.add_argument("--run", required=True, help="the run id (`fedmeta ledger show` lists them)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=handled("ledger end-reservation", _cmd_ledger_end_reservation))
    _add_ledger_budget_parsers(lsub, default_ledger)


def _add_ledger_budget_parsers(lsub: Any, default_ledger: LedgerLocations | None) -> None:
    """``fedmeta ledger backup|new-budget``: the copies and the deliberate new budget."""
    p = lsub.add_parser(
        "backup",
        help="consistent, atomic, verified copy (also the way to restore: swap --db and --to)",
    )
    add_db_arg(p, "the ledger to copy", default_ledger)
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
    p.set_defaults(func=handled("ledger backup", _cmd_ledger_backup))
    p = lsub.add_parser(
        "new-budget",
        help="start a new budget for the data of a federation (recorded with who, when, why)",
    )
    add_db_arg(p, "path of the ledger (SQLite)", default_ledger)
    p.add_argument("--federation", required=True, help="the data's current federation id")
    p.add_argument("--reason", required=True, help="why a new budget (recorded for good)")
    p.add_argument(
        "--epsilon", type=epsilon_value,
        help="the new budget's epsilon, set now (default: the next run's privacy.epsilon_budget)",
    )  # fmt: skip
    p.add_argument(
        "--delta", type=float,
        help="the new budget's delta, fixed with it (default: the old budget's); needs --epsilon",
    )  # fmt: skip
    p.add_argument("--who", help="who starts it (default user@host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=handled("ledger new-budget", _cmd_ledger_new_budget))
