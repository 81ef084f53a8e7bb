"""Deployment benchmark: seconds per round of a deployed federation, and what each part costs.

A SuperLink with TLS and node authentication and N participants, on loopback or across network
namespaces (one server host, one host per participant, on a bridge), run by the production pieces:
``fedmeta deploy participant`` (SuperNode + warm worker), ``fedmeta deploy run`` (fedmeta's
ServerApp, which polls for replies every 50 ms). Presets (what runs each message on a node):

* ``warm`` (default): the warm worker (client/fedmeta/client/worker.py) and the SuperNode's short
polls
  (client/fedmeta/client/supernode.py);
* ``warm-stockpoll``: the warm worker, Flower's own SuperNode polls (3 s when idle);
* ``cold``: Flower's per-message ``flwr-clientapp`` process (``--isolation subprocess``) with the
  short polls: the difference to ``warm`` is the ClientApp's start and the workload's set-up;
* ``stock``: ``flower-supernode --isolation subprocess`` as Flower ships it.

    python bench/deployment.py --net loopback --preset warm --rounds 20
    python bench/deployment.py --net netns --preset warm --rounds 20        # needs root and `ip`
    python bench/deployment.py --net netns --preset warm --shape 1:8mbit --fleet-proxy
    python bench/deployment.py --net compose --participants 3 --rounds 20   # compose already up
    python bench/deployment.py --net compose --participants 3 --compose-file docker-compose.yml \
        --compose-file deploy/compose/tls.yml                                # the TLS overlay

Per round (medians of rounds 2..): ``round_s`` (the ServerApp's round: requests out, replies in,
aggregation; ``metrics.private_diagnostics`` on for it), ``period_s`` (between the starts of
consecutive rounds on the nodes: everything, evaluation and ledger included), and for the warm
presets the worker's view: ``input_s`` (task acquired -> message in the worker), ``app_s`` (the
ClientApp's compute), ``push_s`` (reply handed to the SuperNode). The cold start of a ClientApp
process (imports) and the workload's set-up are the worker's own start-up numbers. Prints a
table; ``--out DIR`` keeps logs and ``results.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# bench/ holds scripts named like packages (bench/accounting.py): keep them off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from tests.deploy.netns import Network, netns_unavailable  # noqa: E402

from fedmeta.cli.deploy_local import (  # noqa: E402
    BIN,
    LocalFederation,
    LocalHost,
    Node,
    free_port,
    wait_until,
)

PRESETS = ("warm", "warm-stockpoll", "cold", "stock")


def settings(args: argparse.Namespace, work: Path) -> list[str]:
    """A private sinusoid federation of ``--rounds`` rounds.

    The budget (default 10: 48 rounds of 4 of 4 participants at z = 1) is kept small on purpose:
    the ServerApp's forecast searches the affordable rounds before round 1, and for a budget of
    1000 that search alone takes some 40 s.
    """
    return [
        f"rounds={args.rounds}", f"federation.participants={args.participants}",
        f"sampling.participants_per_round={args.per_round}", "sampling.task_rate=0.2",
        "dataset.tasks_per_participant=20", f"privacy.epsilon_budget={args.epsilon_budget}",
        "privacy.noise_multiplier=1.0", "training.eval_every=1000000",
        "training.checkpoint_every=1000000", "privacy.report_every=1000000",
        "dataset.test_tasks=8", "dataset.validation_tasks=8", "dataset.probe_tasks=0",
        "output.plots=false", "output.progress=false", "metrics.private_diagnostics=true",
        f"federation.round_timeout_s={args.round_timeout}", "federation.register_timeout_s=300",
        f"privacy.ledger_path={work / 'state' / 'ledger.sqlite'}",
    ]  # fmt: skip


def start_node(fed: LocalFederation, node: Node, preset: str) -> None:
    """The node as the preset runs it."""
    if preset == "warm":
        fed.start_node(node)
    elif preset == "warm-stockpoll":
        fed.start_node(node, "--stock-poll")
    else:
        c = fed.certs
        head = ([sys.executable, "-m", "fedmeta.client.supernode", "--"] if preset == "cold"
                else [str(BIN / "flower-supernode")])  # fmt: skip
        node.proc = fed.start(node.host, f"node-{node.key_name}", [
            *head, "--superlink", fed.fleet_address, "--root-certificates", str(c / "ca.crt"),
            "--auth-supernode-private-key", str(c / "nodes" / f"{node.key_name}.key"),
            "--isolation", "subprocess", "--port", str(node.runtime_port),
            "--node-config", f'participant-id="{node.participant_id}"',
        ])  # fmt: skip


def hosts(args: argparse.Namespace) -> tuple[Any, list[Any], Network | None]:
    """(server host, participant hosts, the namespaces or None)."""
    if args.net == "loopback":
        return LocalHost(), [LocalHost(f"p{i}") for i in range(args.participants)], None
    reason = netns_unavailable()
    if reason:
        sys.exit(f"deployment bench: {reason}")
    shaped = dict((int(i), r) for i, r in (s.split(":") for s in args.shape or []))
    net = Network(participants=args.participants, shaped=shaped)
    return net.server, net.participants, net


SERVER_SHIM = """# bench/deployment.py --server-pull-backoff: in every Python process of the
# SuperLink's tree (the ServerApp's included), retry a reply's missing objects after
# {backoff} s instead of Flower's 1 s.
import functools
import flwr.superlink.grid.http_grid as _grid
_grid.pull_objects = functools.partial(
    _grid.pull_objects, initial_backoff={backoff}, backoff_cap=1.0
)
"""


SERVER_TRACE = """# bench/deployment.py --trace: the ServerApp's pushes and pulls.
import json, os, time
import flwr.superlink.grid.http_grid as _grid
_path = os.environ["FEDMETA_BENCH_TRACE"]
_push, _pull = _grid.HttpGrid.push_messages, _grid.HttpGrid.pull_messages


def _log(**line):
    with open(_path, "a") as fh:
        fh.write(json.dumps(line) + "\\n")


def push_messages(self, messages):
    messages = list(messages)
    t0 = time.time()
    ids = list(_push(self, messages))
    _log(op="push", t0=t0, t1=time.time(), n=len(messages),
         groups=sorted({m.metadata.group_id for m in messages}))
    return ids


def pull_messages(self, message_ids):
    t0 = time.time()
    out = list(_pull(self, message_ids))
    if out:
        _log(op="pull", t0=t0, t1=time.time(), n=len(out))
    return out


_grid.HttpGrid.push_messages, _grid.HttpGrid.pull_messages = push_messages, pull_messages
"""


def server_shim(fed: LocalFederation, backoff: float | None, trace: bool) -> None:
    """Experiments in the ServerApp's process (through ``sitecustomize``): Flower's 1 s first
    retry of a reply's objects shortened to ``backoff``; a trace of the Grid's pushes and pulls."""
    shim = fed.work / "server-shim"
    shim.mkdir(parents=True, exist_ok=True)
    code = SERVER_SHIM.format(backoff=backoff) if backoff is not None else ""
    code += SERVER_TRACE if trace else ""
    (shim / "sitecustomize.py").write_text(code)
    fed.extra_env["superlink"] = {
        "PYTHONPATH": str(shim),
        "FEDMETA_BENCH_TRACE": str(fed.logs / "server-trace.jsonl"),
    }


def bring_up(fed: LocalFederation, args: argparse.Namespace, participant_hosts: list[Any]) -> float:
    """Certificates, SuperLink, keys, nodes; seconds until every node is ready."""
    t0 = time.monotonic()
    names = [f"participant-{i}" for i in range(args.participants)]
    fed.make_certs(names, sans=[fed.server.address])
    # --superlink-database: the SuperLink keeps its state in SQLite, as the compose file's does
    # (--database /state/superlink.db); by default `deploy local` keeps it in memory.
    fed.start_superlink(database=fed.work / "superlink.db" if args.superlink_database else None)
    fed.register(names)
    loopback = args.net == "loopback"
    fed.nodes = [Node(h, str(i), names[i], runtime_port=free_port() if loopback else 9094)
                 for i, h in enumerate(participant_hosts)]  # fmt: skip
    for node in fed.nodes:
        start_node(fed, node, args.preset)
    wait_until(lambda: fed.online() >= len(names), 300, "nodes online", 1)
    if args.preset.startswith("warm"):
        wait_until(lambda: fed.workers_ready(fed.nodes), 600, "the workers' warm-up", 1)
    return time.monotonic() - t0


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _cpu(pgid: int) -> float:
    """CPU seconds (with reaped children) of the processes in group ``pgid``."""
    total = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def collect(logs: Path, out: Path) -> dict[str, Any]:
    """Per-round numbers from rounds.csv (diagnostics) and the workers' timings."""
    rows = (
        list(csv.DictReader((out / "rounds.csv").open())) if (out / "rounds.csv").is_file() else []
    )
    rounds = [float(r["round_seconds"]) for r in rows if r.get("round_seconds")]
    agg = [float(r["aggregation_seconds"]) for r in rows if r.get("aggregation_seconds")]
    tasks = []
    for path in logs.glob("node-*.timings.jsonl"):
        tasks += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [t for t in tasks if t.get("kind") == "train" and "app" in t]
    starts: dict[str, float] = {}
    for t in train:
        starts[t["group"]] = min(starts.get(t["group"], 1e18), t["started"])
    ordered = [starts[g] for g in sorted(starts, key=int)]
    periods = [b - a for a, b in zip(ordered, ordered[1:], strict=False)]
    steady = [t for t in train if t["group"] != min(starts, key=int, default="")]
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    )
    return {
        "rounds_completed": summary.get("rounds_completed"),
        "stopped": summary.get("stopped_reason"),
        "round_s": [round(x, 3) for x in rounds],
        "median": {
            "round_s": _med(rounds[1:]), "period_s": _med(periods[1:]),
            "aggregation_s": _med(agg[1:]),
            "input_s": _med([t["input"] for t in steady]),
            "app_s": _med([t["app"] - t["input"] for t in steady]),
            "push_s": _med([t["pushed"] - t["app"] for t in steady]),
        },
        "worker_start": _worker_start(logs),
        "timeline": timeline(logs, train),
    }  # fmt: skip


def timeline(logs: Path, train: list[dict[str, Any]]) -> dict[str, float | None]:
    """A round's timeline (medians, seconds after the ServerApp started pushing its requests)."""
    path = logs / "server-trace.jsonl"
    if not path.is_file():
        return {}
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pushes = [e for e in events if e["op"] == "push" and e["groups"] != ["register"]]
    rows = []
    for k, push in enumerate(pushes[1:-1], start=1):  # steady rounds
        end = pushes[k + 1]["t0"]
        pulls = [e for e in events if e["op"] == "pull" and push["t0"] <= e["t0"] < end]
        tasks = [t for t in train if t["group"] in push["groups"]]
        if not pulls or not tasks:
            continue
        t0 = push["t0"]
        rows.append({
            "push_s": push["t1"] - t0,
            "first_task_s": min(t["started"] for t in tasks) - t0,
            "last_task_s": max(t["started"] for t in tasks) - t0,
            "last_handed_back_s": max(t["started"] + t["pushed"] for t in tasks) - t0,
            "last_reply_s": max(e["t1"] for e in pulls) - t0,
            "pull_objects_s": max(e["t1"] - e["t0"] for e in pulls),
        })  # fmt: skip
    return {k: _med([r[k] for r in rows]) for k in rows[0]} if rows else {}


def _worker_start(logs: Path) -> dict[str, float | None]:
    """The warm workers' one-off costs: imports (a cold ClientApp's start) and the warm-up."""
    imports, warm = [], []
    for log in logs.glob("node-*.log"):
        for line in log.read_text().splitlines():
            if "fedmeta.worker INFO imports" in line:
                imports.append(float(line.split("imports ")[1].split(" s")[0]))
            elif "fedmeta.worker INFO warm-up" in line:
                warm.append(float(line.split("warm-up ")[1].split(" s")[0]))
    return {"imports_s": _med(imports), "warm_up_s": _med(warm)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Bring the federation up, run it once, measure, tear everything down."""
    work = Path(args.out or tempfile.mkdtemp(prefix="fedmeta-bench-")).resolve()
    server, participant_hosts, net = hosts(args)
    fed = LocalFederation(work, server, port=None if args.net == "loopback" else 8000,
                          fleet_proxy=args.fleet_proxy)  # fmt: skip
    result: dict[str, Any] = {
        "preset": args.preset,
        "net": args.net,
        "work": str(work),
        "participants": args.participants,
        "per_round": args.per_round,
        "superlink_database": args.superlink_database,
    }
    if args.server_pull_backoff is not None or args.trace:
        server_shim(fed, args.server_pull_backoff, args.trace)
        result["server_pull_backoff_s"] = args.server_pull_backoff
    try:
        result["ready_s"] = round(bring_up(fed, args, participant_hosts), 1)
        cpu0 = {f"{h.name}:{Path(str(p.args[0])).name}:{p.pid}": (p.pid, _cpu(p.pid))
                for h, p in fed.procs}  # fmt: skip
        t0 = time.monotonic()
        proc = fed.deploy_run(work / "runs" / "bench", sets=settings(args, work), timeout=3600)
        result["exit_status"] = proc.wait(timeout=4000)
        result["run_wall_s"] = round(time.monotonic() - t0, 1)
        result["cpu_s"] = {k: round(_cpu(pid) - c, 1) for k, (pid, c) in cpu0.items()}
        result.update(collect(fed.logs, work / "runs" / "bench"))
        return result
    finally:
        fed.close()
        if net is not None:
            net.close()


def compose_command(files: list[str]) -> list[str]:
    """``docker compose -f ...``, or the Compose binary podman-setup links where the Docker CLI
    has no compose plugin (docs/deploy.md)."""
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if probe.returncode == 0:
        head = ["docker", "compose"]
    else:
        found = subprocess.run(["bash", str(ROOT / "scripts" / "podman-setup.sh"), "compose-bin"],
                               capture_output=True, text=True, check=False)  # fmt: skip
        if found.returncode != 0 or not found.stdout.strip():
            sys.exit(
                "deployment bench: no `docker compose` and no Compose binary from "
                "scripts/podman-setup.sh compose-bin; set up the engine first (docs/deploy.md)"
            )
        head = [found.stdout.strip()]
    return head + [a for f in files for a in ("-f", f)]


def run_compose(args: argparse.Namespace) -> dict[str, Any]:
    """The same run on a compose federation that is already up (``docker compose up -d``):
    ``docker compose exec serverapp fedmeta deploy run`` with :func:`settings`, the ledger an
    experiment's own file in the ``ledger`` volume; rounds.csv and summary.json copied out."""
    work = Path(args.out or tempfile.mkdtemp(prefix="fedmeta-bench-")).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    dc = compose_command([str(Path(f).resolve()) for f in args.compose_file])
    listed = subprocess.run([*dc, "config", "--services"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)  # fmt: skip
    nodes = sum(1 for line in listed.stdout.split() if line.startswith("participant-"))
    if nodes != args.participants:
        sys.exit(
            f"deployment bench: the compose federation has {nodes} participant services; "
            f"give --participants {nodes} (deploy/compose/participants.py N changes them)"
        )
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    remote = f"/runs/bench-{stamp}"
    sets = [s for s in settings(args, work) if not s.startswith("privacy.ledger_path=")]
    # The compose configuration's live metrics endpoint is the one setting `deploy local` lacks.
    sets += [f"privacy.ledger_path=/ledger/bench-{stamp}.sqlite", "metrics.port=none"]
    cmd = [*dc, "exec", "-T", "serverapp", "fedmeta", "deploy", "run", "--out", remote,
           "--poll", "0.5", "--timeout", "3600"]  # fmt: skip
    cmd += [a for x in sets for a in ("--set", x)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=4000, check=False)
    result: dict[str, Any] = {
        "preset": "compose", "net": "compose", "compose_files": args.compose_file,
        "work": str(work), "participants": args.participants, "per_round": args.per_round,
        "exit_status": proc.returncode, "run_wall_s": round(time.monotonic() - t0, 1),
        "ready_s": None, "cpu_s": {}, "superlink_database": True,  # the compose file's
    }  # fmt: skip
    (work / "logs" / "deploy-run.log").write_text(proc.stdout + proc.stderr)
    local = work / "runs" / "bench"
    local.mkdir(parents=True, exist_ok=True)
    for name in ("rounds.csv", "summary.json"):
        got = subprocess.run([*dc, "exec", "-T", "serverapp", "cat", f"{remote}/{name}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        if got.returncode == 0:
            (local / name).write_text(got.stdout)
    result.update(collect(work / "logs", local))
    return result


def main() -> None:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--net",
        choices=["loopback", "netns", "compose"],
        default="loopback",
        help="compose: a compose federation already up (its participants)",
    )
    p.add_argument(
        "--compose-file",
        action="append",
        default=None,
        help="with --net compose: the compose files (default docker-compose.yml); --preset "
        "does not apply (the compose participants run the warm worker)",
    )
    p.add_argument("--preset", choices=PRESETS, default="warm")
    p.add_argument("--participants", type=int, default=4)
    p.add_argument("--per-round", type=int, default=None)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--round-timeout", type=float, default=120)
    p.add_argument("--epsilon-budget", type=float, default=10.0)
    p.add_argument(
        "--trace",
        action="store_true",
        help="record when the ServerApp pushes and pulls (the round's timeline)",
    )
    p.add_argument("--server-pull-backoff", type=float, default=None,
                   help="experiment: the ServerApp retries a reply's missing objects after this "
                   "many seconds (Flower: 1 s)")  # fmt: skip
    p.add_argument("--shape", action="append", help="IDX:RATE, e.g. 1:8mbit (netns only)")
    p.add_argument(
        "--fleet-proxy", action="store_true", help="participants dial nginx (Fleet only)"
    )
    p.add_argument(
        "--superlink-database",
        action="store_true",
        help="the SuperLink's state in a SQLite file (as in compose), not in memory",
    )
    p.add_argument("--out", help="keep logs and results.json here")
    args = p.parse_args()
    args.per_round = args.per_round or args.participants
    load0 = os.getloadavg()
    args.compose_file = args.compose_file or ["docker-compose.yml"]
    result = run_compose(args) if args.net == "compose" else run(args)
    result["loadavg_before"], result["loadavg_after"] = load0[0], os.getloadavg()[0]
    Path(result["work"], "results.json").write_text(json.dumps(result, indent=1))
    m = result["median"]
    print(f"{result['preset']} on {args.net}, {args.participants} participants "
          f"({args.per_round} per "
          f"round): exit {result['exit_status']}, {result['rounds_completed']} rounds "
          f"({result['stopped']}), load {load0[0]:.1f} -> "
          f"{result['loadavg_after']:.1f}")  # fmt: skip
    print(
        f"  ready {result['ready_s']} s, run {result['run_wall_s']} s; medians (rounds 2..): "
        + ", ".join(f"{k} {v}" for k, v in m.items())
    )
    print(f"  worker start: {result['worker_start']}; round_s {result['round_s']}")
    if result.get("timeline"):
        print(f"  timeline (medians, s after the requests' push began): {result['timeline']}")
    print(f"  cpu_s: {result['cpu_s']}")
    print(f"  details: {result['work']}/results.json")


if __name__ == "__main__":
    main()
