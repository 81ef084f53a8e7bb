"""What a deployed run left behind, and ``fedmeta deploy status``: the live federation.

:func:`run_progress` answers, for ``fedmeta deploy run``'s summary, how far a run got and what
exists of it, from the sources of truth on the ServerApp's host: the ledger (every spend), the
checkpoint (the rounds whose update is in the saved model) and ``summary.json`` (written only
when the ServerApp finishes). After a crash of the ServerApp a round can be *spent* (its record
is in the ledger) without being *applied* (its update was after the last checkpoint): a resumed
run counts it as spent and never runs it again (server/fedmeta/server/run.py), so the two counts are
reported
separately.

``fedmeta deploy status`` shows the nodes the SuperLink knows (with their authentication keys'
fingerprints and, given ``--node-keys``, the participant each is bound to), the runs, and the
budget left in the ledger. It reads; it changes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmeta import exitcodes
from fedmeta.cli.deploy_args import add_connection_args, add_node_keys_arg, add_runs_dir_arg
from fedmeta.paths import LEDGER_NAME, STATE_DIR_ENV

#: What a run's output directory may hold, in the order the summary lists them.
OUTPUT_FILES = ("summary.json", "rounds.csv", "checkpoint.pt")


@dataclass
class Progress:
    """How far a run got. ``None``: not known from this host."""

    visible: bool  # the output directory exists here (this host is the ServerApp's)
    files: list[str] = field(default_factory=list)  # those of OUTPUT_FILES that exist
    spent: int | None = None  # this run's records in the ledger
    applied: int | None = None  # rounds whose update is in the model (summary or checkpoint)
    lost: list[int] = field(default_factory=list)  # spent, update lost (1-based round numbers)
    source: str = ""  # where the counts come from


def run_progress(out: str, ledger_path: str | None) -> Progress:
    """The counts from ``summary.json`` when the run finished, else from its checkpoint."""
    directory = Path(out)
    progress = Progress(visible=directory.is_dir())
    if not progress.visible:
        return progress
    progress.files = [name for name in OUTPUT_FILES if (directory / name).is_file()]
    if "summary.json" in progress.files:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            summary = json.loads((directory / "summary.json").read_text())
            progress.spent = int(summary["rounds_completed"])
            progress.lost = [int(r) for r in summary.get("rounds_lost_on_resume") or []]
            progress.applied = progress.spent - len(progress.lost)
            progress.source = "summary.json"
            return progress
    if "checkpoint.pt" in progress.files:
        with contextlib.suppress(Exception):  # a torn or foreign file: counts stay unknown
            _from_checkpoint(progress, directory, ledger_path)
    return progress


def _from_checkpoint(progress: Progress, directory: Path, ledger_path: str | None) -> None:
    """Spent from the ledger's records of the checkpoint's run; applied = spent before its end.

    The same rule as a resume (server/fedmeta/server/startup.py ``initial_state``): ledger rounds
    at or after the checkpoint's ``next_round`` were spent but their update is lost.
    """
    from fedmeta.checkpoint import CHECKPOINT_NAME, read_checkpoint  # torch: only when unfinished

    ckpt = read_checkpoint(directory / CHECKPOINT_NAME)
    next_round = ckpt.next_round
    earlier = ckpt.rounds_lost_on_resume()
    path = (ckpt.ledger.path if ckpt.ledger is not None else None) or ledger_path
    if not path or not Path(path).is_file():
        return
    from fedmeta.accounting import BudgetLedger

    ledger = BudgetLedger.open_readonly(path, ckpt.federation_id)
    try:
        spends = sorted(r.round_index for r in ledger.records() if r.run_id == ckpt.run_id)
    finally:
        ledger.close()
    progress.spent = len(spends)
    progress.lost = earlier + [i + 1 for i in spends if i >= next_round]
    progress.applied = progress.spent - len(progress.lost)
    progress.source = f"ledger {path} and checkpoint.pt"


def describe_progress(progress: Progress, out: str) -> list[str]:
    """The summary's lines about rounds and files (only files that exist are named)."""
    where = "(on the ServerApp's host)"
    if not progress.visible:
        return [f"outputs {where}: {out}: nothing there, or not visible from this host"]
    lines = []
    if progress.spent is not None:
        line = (f"rounds spent (privacy cost recorded in the ledger) {progress.spent}; applied to "
                f"the saved model {progress.applied}")  # fmt: skip
        if progress.lost:
            line += (f"; spent but lost in a crash (paid for, not run again) "
                     f"{_rounds(progress.lost)}")  # fmt: skip
        lines.append(f"{line} [from {progress.source}]")
    files = (
        ", ".join(progress.files) or "none yet (the ServerApp ended before its first checkpoint)"
    )
    lines.append(f"outputs {where}: {out}: {files}")
    return lines


def _rounds(rounds: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in rounds[:10])
    return f"rounds {shown}{', ...' if len(rounds) > 10 else ''} ({len(rounds)})"


def resume_command(args: argparse.Namespace, out: str) -> str:
    """The ``fedmeta deploy run --resume`` command line that continues this run."""
    cmd = ["fedmeta", "deploy", "run", "--resume", "--out", out, "--superlink", args.superlink]
    if args.insecure:
        cmd.append("--insecure")
    elif args.root_certificates is not None:
        cmd += ["--root-certificates", str(args.root_certificates)]
    if args.config is not None:
        cmd += ["--config", str(args.config)]
    if args.node_keys is not None:
        cmd += ["--node-keys", str(args.node_keys)]
    for override in args.overrides:
        cmd += ["--set", override]
    return shlex.join(cmd)


# ------------------------------------------------------------------------------------ status


def register(sub: Any) -> None:
    """Add ``fedmeta deploy status``."""
    p = sub.add_parser(
        "status", help="the live federation: nodes and their keys, runs, the budget left",
        description="Show the nodes the SuperLink knows (status, authentication-key fingerprint, "
        "the participant it is bound to), its runs, and the budget left in the ledger. Reads "
        "only. Uses the Control API: run it on the server host.",
    )  # fmt: skip
    add_connection_args(p, "Control API (the server host's own)")
    env = os.environ.get
    state = env(STATE_DIR_ENV)
    add_node_keys_arg(p, "show which participant each key is bound to")
    p.add_argument("--db", type=Path, default=Path(state, LEDGER_NAME) if state else None,
                   help="the budget ledger (default $FEDMETA_STATE_DIR/ledger.sqlite)")  # fmt: skip
    add_runs_dir_arg(p, "where `fedmeta deploy run` recorded its runs (its --runs-dir): "
                     "interrupted runs are shown with the command that resumes them")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=_handle_status)


def _handle_status(args: argparse.Namespace) -> int:
    from fedmeta.cli.deploy_flwr import (
        CONNECTION,
        DeployError,
        flwr,
        flwr_home,
        json_in,
        refused,
        tls_settings,
    )
    from fedmeta.cli.deploy_runs import annotate

    try:
        ca, _insecure = tls_settings(args)
        bound = _bindings(args.node_keys)
    except DeployError as error:
        return refused("status", error)
    with flwr_home(args.superlink, ca) as env:
        try:
            nodes = _nodes(env)
        except Exception as error:  # noqa: BLE001 - any failure to reach the SuperLink: one line
            print(f"fedmeta deploy status: the SuperLink at {args.superlink} did not answer: "
                  f"{' '.join(str(error).split())[:300]}", file=sys.stderr)  # fmt: skip
            return exitcodes.UNAVAILABLE
        res = flwr(env, "ls", CONNECTION, "--format", "json")
        runs = json_in(res.stdout).get("runs", []) if res.returncode == 0 else []
    runs = annotate(runs, args.runs_dir)
    status = {"superlink": args.superlink, "nodes": [{**n, "bound_to": bound.get(n["key"])}
                                                     for n in nodes],
              "runs": runs, "budget": _budget(args.db)}  # fmt: skip
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print("\n".join(_status_lines(status)))
    return exitcodes.OK


def _bindings(path: Path | None) -> dict[str, str]:
    """Key fingerprint -> participant id, from a node-keys file."""
    if path is None:
        return {}
    from fedmeta.cli.deploy_run_config import node_keys

    return {fp: pid for pid, fp in node_keys(Path(path)).items()}  # read as deploy run reads it


def _nodes(env: Mapping[str, str]) -> list[dict[str, Any]]:
    """The SuperLink's nodes with their public keys, which ``flwr supernode list`` omits.

    Read through the Control API with Flower 1.41's own client, as that command does.
    """
    from flwr.proto.control_pb2 import ListNodesRequest

    from fedmeta.cli.control_api import open_client
    from fedmeta.cli.deploy_flwr import CONNECTION
    from fedmeta.server.transport import key_fingerprint

    client = open_client(env, CONNECTION)
    try:
        infos = list(client.ListNodes(ListNodesRequest()).nodes_info)
    finally:
        client.close()
    return [{"node_id": str(i.node_id), "name": i.name, "status": i.status,
             "key": key_fingerprint(bytes(i.public_key)), "last_online": i.last_activated_at}
            for i in infos if i.status != "unregistered"]  # fmt: skip


def _budget(db: Path | None) -> dict[str, Any]:
    """Per federation in the ledger: epsilon spent and left, at its delta; or why not."""
    if db is None:
        return {"ledger": None, "error": "no ledger given (--db or $FEDMETA_STATE_DIR)"}
    from fedmeta.accounting import BudgetLedger, LedgerError

    try:
        federations = BudgetLedger.describe(db).federations
        out = []
        for fid in federations:
            ledger = BudgetLedger.open_readonly(db, fid)
            try:
                spent = ledger.epsilon()
                out.append({"federation_id": fid, "unit": ledger.unit, "delta": ledger.delta,
                            "epsilon_budget": ledger.epsilon_budget, "epsilon_spent": spent,
                            "epsilon_left": max(0.0, ledger.epsilon_budget - spent),
                            "spends": ledger.position()})  # fmt: skip
            finally:
                ledger.close()
    except (LedgerError, OSError) as error:
        return {"ledger": str(db), "error": " ".join(str(error).split())}
    return {"ledger": str(db), "federations": out}


def _status_lines(status: Mapping[str, Any]) -> list[str]:
    nodes = status["nodes"]
    online = sum(n["status"] == "online" for n in nodes)
    lines = [f"SuperLink {status['superlink']}: {len(nodes)} nodes, {online} online"]
    for n in nodes:
        bound = f"participant {n['bound_to']}" if n["bound_to"] else "not bound"
        lines.append(f"  node {n['node_id']:>20}  {n['status']:<8} {n['name'] or '-':<16} "
                     f"{n['key'] or 'no key (node auth off)'}  {bound}")  # fmt: skip
    runs = status["runs"]
    lines.append(f"runs: {len(runs)}")
    # Flower lists the newest first: those five, and every interrupted run.
    for r in [r for i, r in enumerate(runs) if i < 5 or (r.get("fedmeta") or {}).get("why")]:
        when = r.get("finished-at") or r.get("running-at") or r.get("pending-at")
        ours = r.get("fedmeta") or {}
        if ours.get("why"):
            lines.append(f"  run {r.get('run-id')}  interrupted ({ours['why']})  {when}")
            lines.append(f"    continue with: {ours['resume']}")
        else:
            lines.append(f"  run {r.get('run-id')}  {r.get('status')}  {when}")
    budget = status["budget"]
    if budget.get("error"):
        lines.append(f"budget: {budget['error']}")
        return lines
    lines.append(f"budget (ledger {budget['ledger']}):")
    for f in budget["federations"]:
        lines.append(f"  {f['federation_id']}: epsilon spent {f['epsilon_spent']:.4g} of "
                     f"{f['epsilon_budget']:.4g} ({f['unit']} level, delta {f['delta']:.3g}); "
                     f"left {f['epsilon_left']:.4g}; {f['spends']} rounds recorded")  # fmt: skip
    return lines
