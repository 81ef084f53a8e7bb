"""Deployment benchmark and prototype: a SuperLink and N SuperNodes with TLS and node
authentication, on loopback or across network namespaces, running a short private fedmeta
federation.

Seconds per round and what each part costs. Presets:

* ``stock``: what a user gets today: ``flower-supernode`` (default ``--isolation subprocess``: a new
  ``flwr-clientapp`` process per message), fedmeta's ServerApp as is (``flwr run .``; Flower's
  ``Grid.send_and_receive`` polls every 3 s).
* ``fastpoll``: Flower's per-message ``flwr-clientapp`` (``--isolation process`` plus one
  ``flower-superexec`` per node), but short polls on the node
  (``deploy/prototype/fast_supernode.py``)
  and on the server (``deploy/prototype/app``: fedmeta's ``execute`` over a 50 ms-polling Grid). The
  difference to ``warm`` is the ClientApp process start and the workload set-up.
* ``warm``: ``--isolation process`` with ``deploy/prototype/warm_worker.py`` (one long-lived process
  per node that keeps torch and the workload warm), short polls on node and server.
* ``warm-stockpoll``: ``warm`` with Flower's own node polls (3 s idle): the cost of the node's poll.

Failure drills (namespaces or loopback): ``--shape 2:8mbit`` (tc tbf on participant 2's link),
``--kill 1@40`` (SIGKILL participant 1's SuperNode and worker 40 s after the run started),
``--unregistered`` (one more SuperNode whose key was never registered: it must be refused).

    python bench/deployment.py --net loopback --preset warm --rounds 15
    python bench/deployment.py --net netns --preset stock --rounds 6      # needs root and `ip`
    python bench/deployment.py --net netns --preset warm --rounds 20 --shape 2:8mbit --kill 1@40 \\
        --unregistered --participants 4 --per-round 3

Needs fedmeta installed in the interpreter's environment (flwr, flower-superlink, ... beside it).
Prints a table and writes ``results.json`` under ``--out`` (default: a temporary directory). Every
process it starts is ended by its process id, and every namespace removed, on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# bench/ holds scripts named like packages (bench/accounting.py): keep them off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from tests.deploy.netns import Host, Network, netns_unavailable  # noqa: E402

BIN = Path(sys.executable).parent
PROTO = ROOT / "deploy" / "prototype"
OBJ_CONCURRENCY = ""
PRESETS: dict[str, dict[str, Any]] = {
    "stock": {"executor": "subprocess", "fast_node": False, "app": "repo"},
    "fastpoll": {"executor": "superexec", "fast_node": True, "app": "proto"},
    "warm": {"executor": "warm", "fast_node": True, "app": "proto"},
    "warm-stockpoll": {"executor": "warm", "fast_node": False, "app": "proto"},
}


@dataclass
class LocalHost(Host):
    """The machine's own namespace (loopback runs): same interface as a namespace host."""

    @property
    def nsenter(self) -> list[str]:
        return []


@dataclass
class Topology:
    server: Host
    participants: list[Host]
    superlink_addr: str  # what the nodes dial
    close: Any = None
    extra: list[Host] = field(default_factory=list)


NGINX_CONF = """# Only the Fleet API and /health leave the server host.
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/logs/nginx-error.log warn;
daemon off;
events {{ worker_connections 512; }}
http {{
  access_log {work}/logs/nginx-access.log;
  client_body_temp_path {work}/nginx-tmp/body;
  proxy_temp_path {work}/nginx-tmp/proxy;
  fastcgi_temp_path {work}/nginx-tmp/fastcgi;
  uwsgi_temp_path {work}/nginx-tmp/uwsgi;
  scgi_temp_path {work}/nginx-tmp/scgi;
  client_max_body_size 0;
  upstream superlink {{ server 127.0.0.1:8000; keepalive 32; }}
  server {{
    listen {port} ssl;
    ssl_certificate {certs}/server.crt;
    ssl_certificate_key {certs}/server.key;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_ssl_trusted_certificate {certs}/ca.crt;
    proxy_ssl_verify on;
    proxy_ssl_name localhost;
    proxy_ssl_session_reuse on;
    proxy_read_timeout 300s;
    location /v1/fleet/ {{ proxy_pass https://superlink; }}
    location = /health {{ proxy_pass https://superlink; }}
    location / {{ return 403; }}
  }}
}}
"""


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    if OBJ_CONCURRENCY:
        # Flower's parallel object pushes and pulls per message (default 2).
        env["FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES"] = OBJ_CONCURRENCY
        env["FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS"] = OBJ_CONCURRENCY
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PATH=f"{BIN}:{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    return env


def _wait_for(pred: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _overrides(args: argparse.Namespace) -> str:
    sets = [
        f"rounds={args.rounds}",
        f"federation.participants={args.participants}",
        f"sampling.participants_per_round={args.per_round}",
        "sampling.task_rate=0.2",
        "dataset.tasks_per_participant=20",
        "training.eval_every=1000000",
        "training.checkpoint_every=1000000",
        "privacy.report_every=1000000",
        "dataset.test_tasks=8",
        "dataset.validation_tasks=8",
        "dataset.probe_tasks=0",
        "output.plots=false",
        "output.progress=false",
        f"federation.round_timeout_s={args.round_timeout}",
        "federation.register_timeout_s=60",
    ]
    if args.epsilon_budget is not None:
        sets += [f"privacy.epsilon_budget={args.epsilon_budget}", "privacy.noise_multiplier=1.0"]
    return ";".join(sets)


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS[args.preset]
    work = Path(args.out or tempfile.mkdtemp(prefix="fedmeta-deploy-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    certs = work / "certs"
    net: Network | None = None
    started: list[tuple[Host, subprocess.Popen[Any]]] = []
    result: dict[str, Any] = {"preset": args.preset, **preset, "net": args.net, "work": str(work)}
    try:
        # --- hosts ----------------------------------------------------------------------------
        shaped = {}
        for spec in args.shape or []:
            idx, rate = spec.split(":")
            shaped[int(idx)] = rate
        n_hosts = args.participants + (1 if args.unregistered else 0)
        if args.net == "netns":
            reason = netns_unavailable()
            if reason:
                sys.exit(f"deployment bench: {reason}")
            net = Network(participants=n_hosts, shaped=shaped)
            topo = Topology(
                net.server, net.participants[: args.participants], f"{net.server.address}:8000"
            )
            topo.extra = net.participants[args.participants :]
            sans = [net.server.address]
        else:
            if shaped:
                sys.exit("--shape needs --net netns")
            hosts = [LocalHost(f"p{i}", "", "127.0.0.1") for i in range(n_hosts)]
            topo = Topology(
                LocalHost("server", "", "127.0.0.1"), hosts[: args.participants], "127.0.0.1:8000"
            )
            topo.extra = hosts[args.participants :]
            sans = []
        node_names = [f"participant-{i}" for i in range(n_hosts)]

        # --- certificates and keys ---------------------------------------------------------------
        cmd = ["bash", str(ROOT / "deploy/tls/make-certs.sh"), "--out", str(certs)]
        for name in node_names:
            cmd += ["--node", name]
        for san in sans:
            cmd += ["--san", san]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

        # --- SuperLink ---------------------------------------------------------------------------
        server_home = work / "server-home"
        server_home.mkdir(exist_ok=True)
        (server_home / "config.toml").write_text(
            '[superlink]\ndefault = "fm"\n\n[superlink.fm]\naddress = "127.0.0.1:8000"\n'
            f'root-certificates = "{certs / "ca.crt"}"\n'
        )
        senv = _env(server_home)
        link_cmd = [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "server.crt"),
            "--ssl-keyfile", str(certs / "server.key"),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            "--host", "0.0.0.0" if args.net == "netns" and not args.fleet_proxy
            else "127.0.0.1",
        ]  # fmt: skip
        log_dir = work / "logs"
        log_dir.mkdir(exist_ok=True)
        named: dict[str, subprocess.Popen[Any]] = {}

        def start(
            host: Host, cmd: list[str], env: dict[str, str], name: str
        ) -> subprocess.Popen[Any]:
            fh = (log_dir / f"{name}.log").open("w")
            proc = host.popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=work)
            started.append((host, proc))
            named[name] = proc
            return proc

        t0 = time.monotonic()
        start(topo.server, link_cmd, senv, "superlink")

        def flwr(*a: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
            return topo.server.run([str(BIN / "flwr"), *a], env=senv, timeout=timeout, check=False)

        _wait_for(
            lambda: flwr("ls", "fm", "--format", "json").returncode == 0, 120, "the SuperLink"
        )
        result["superlink_start_s"] = round(time.monotonic() - t0, 2)
        if args.fleet_proxy:
            # nginx on the server host's address forwards only /v1/fleet/ and /health.
            (work / "nginx-tmp").mkdir(exist_ok=True)
            conf = work / "nginx.conf"
            conf.write_text(NGINX_CONF.format(work=work, certs=certs, port=8443))
            start(topo.server, ["nginx", "-c", str(conf)], senv, "nginx")
            topo.superlink_addr = topo.superlink_addr.rsplit(":", 1)[0] + ":8443"
            time.sleep(1)

        # --- register the participants' keys (not the extra node's) -----------------------------
        for name in node_names[: args.participants]:
            res = flwr("supernode", "register", str(certs / "nodes" / f"{name}.key.pub"), "fm",
                       "--name", name, "--format", "json")  # fmt: skip
            if res.returncode != 0:
                raise RuntimeError(f"register {name}: {res.stdout}{res.stderr}")

        # --- SuperNodes (+ executors) -------------------------------------------------------------
        procs: dict[int, list[subprocess.Popen[Any]]] = {}
        all_hosts = [*topo.participants, *topo.extra]
        for i, host in enumerate(all_hosts):
            home = work / f"node{i}-home"
            home.mkdir(exist_ok=True)
            nenv = _env(home)
            nenv["FEDMETA_SUPERNODE_POLL_S"] = str(args.node_poll)
            nenv["FEDMETA_WORKER_POLL_S"] = str(args.worker_poll)
            port = 9094 if args.net == "netns" else 9101 + i
            node = [
                *([str(sys.executable), str(PROTO / "fast_supernode.py")] if preset["fast_node"]
                  else [str(BIN / "flower-supernode")]),
                "--superlink", topo.superlink_addr,
                "--root-certificates", str(certs / "ca.crt"),
                "--auth-supernode-private-key", str(certs / "nodes" / f"{node_names[i]}.key"),
                "--port", str(port),
                "--node-config", f"participant-id={i}",
                "--isolation", "subprocess" if preset["executor"] == "subprocess" else "process",
            ]  # fmt: skip
            procs[i] = [start(host, node, nenv, f"supernode{i}")]
            if preset["executor"] == "superexec":
                ex = [
                    str(BIN / "flower-superexec"),
                    "--runtime-api-address",
                    f"127.0.0.1:{port}",
                    "--insecure",
                ]
                procs[i].append(start(host, ex, nenv, f"superexec{i}"))
            elif preset["executor"] == "warm":
                ex = [str(sys.executable), str(PROTO / "warm_worker.py"),
                      "--runtime-api-address", f"127.0.0.1:{port}", "--insecure",
                      "--timings", str(work / f"worker{i}.jsonl")]  # fmt: skip
                procs[i].append(start(host, ex, nenv, f"worker{i}"))

        # The unregistered node must be refused: it exits on its own.
        if args.unregistered:
            extra_proc = procs[args.participants][0]
            try:
                code = extra_proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                code = None
            text = (log_dir / f"supernode{args.participants}.log").read_text()
            result["unregistered_node"] = {
                "exit_code": code,
                "refused": code not in (None, 0)
                and ("2004" in text or "412" in text or "not" in text.lower()),
                "log_tail": text[-400:],
            }

        def online() -> bool:
            res = flwr("supernode", "list", "fm", "--format", "json")
            if res.returncode != 0:
                return False
            nodes = json.loads(res.stdout).get("nodes", [])
            return sum(n.get("status") == "online" for n in nodes) >= args.participants

        _wait_for(online, 180, f"{args.participants} SuperNodes online")
        if args.fleet_proxy:
            # The Control and Runtime APIs must not answer a participant host through the proxy.
            probe = (
                "import ssl, urllib.error, urllib.request\n"
                f"ctx = ssl.create_default_context(cafile='{certs / 'ca.crt'}')\n"
                "for path in ('/v1/control/list-runs', '/v1/runtime/get-nodes', '/health'):\n"
                f"    url = 'https://{topo.superlink_addr}' + path\n"
                "    data = None if path == '/health' else b''\n"
                "    try:\n"
                "        res = urllib.request.urlopen(url, data=data, timeout=5, context=ctx)\n"
                "        print(path, res.status)\n"
                "    except urllib.error.HTTPError as e:\n"
                "        print(path, e.code)\n"
            )
            res = topo.participants[0].run([sys.executable, "-c", probe], timeout=60, check=False)
            result["proxy_probe_from_participant"] = (res.stdout + res.stderr).strip().splitlines()
        if preset["executor"] == "warm":
            _wait_for(
                lambda: all("warm worker ready" in (log_dir / f"worker{i}.log").read_text()
                            for i in range(args.participants)),
                300, "the warm workers' imports",
            )  # fmt: skip
        result["nodes_ready_s"] = round(time.monotonic() - t0, 2)

        # --- the run ----------------------------------------------------------------------------
        out = work / "run"
        app_dir = str(ROOT if preset["app"] == "repo" else PROTO / "app")
        run_config = f'set="{_overrides(args)}" out="{out}"'
        if preset["app"] == "proto":
            run_config += f" reply-poll-s={args.server_poll}"
        cpu0 = {name: _cpu(proc.pid) for name, proc in named.items()}
        t_run = time.monotonic()
        res = topo.server.run(
            [str(BIN / "flwr"), "run", app_dir, "fm", "--run-config", run_config,
             "--format", "json"],
            env=senv, timeout=300, check=False, cwd=str(ROOT),
        )  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"flwr run: {res.stdout}{res.stderr}")
        run_id = json.loads(res.stdout)["run-id"]
        result["run_id"] = run_id
        killed: dict[int, float] = {}
        kills = []
        for spec in args.kill or []:
            idx, at = spec.split("@")
            kills.append((int(idx), float(at)))

        def status() -> dict[str, Any] | None:
            r = flwr("ls", "fm", "--run-id", run_id, "--format", "json")
            if r.returncode != 0:
                return None
            runs = json.loads(r.stdout).get("runs", [])
            return runs[0] if runs else None

        final = None
        deadline = t_run + args.timeout
        while time.monotonic() < deadline:
            for idx, at in kills:
                if idx not in killed and time.monotonic() - t_run >= at:
                    for p in procs[idx]:
                        all_hosts[idx].kill(p, signal.SIGKILL)
                    killed[idx] = round(time.monotonic() - t_run, 2)
            st = status()
            if st and str(st.get("status", "")).startswith("finished"):
                final = st
                break
            time.sleep(1)
        result["run_wall_s"] = round(time.monotonic() - t_run, 2)
        # CPU seconds each process (with its reaped children) used during the run.
        result["cpu_s"] = {
            name: round(_cpu(proc.pid) - cpu0[name], 2)
            for name, proc in named.items()
            if proc.poll() is None
        }
        result["killed_at_s"] = killed
        if final is None:
            flwr("stop", run_id, "fm")
            raise TimeoutError(f"run {run_id} not finished after {args.timeout} s")
        result["status"] = final["status"]
        result["status_details"] = final.get("status-details")
        result.update(_collect(out, work, args.participants))
        return result
    finally:
        for host, proc in reversed(started):
            host.kill(proc, signal.SIGTERM)
        for host, proc in reversed(started):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                host.kill(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        if net is not None:
            net.close()


def _cpu(pgid: int) -> float:
    """CPU seconds (user + system, with reaped children) of the processes in group ``pgid``: a
    started process and everything it started (SuperExec, per-message ClientApps)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _collect(out: Path, work: Path, n: int) -> dict[str, Any]:
    """Per-round numbers from rounds.csv, the Grid's timings and the workers' timings."""
    import csv

    res: dict[str, Any] = {}
    summary = out / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        res["rounds_completed"] = s.get("rounds_completed")
        res["stopped"] = s.get("stopped_reason")
    rows = (
        list(csv.DictReader((out / "rounds.csv").open())) if (out / "rounds.csv").is_file() else []
    )
    res["rounds"] = [
        {
            "round": int(r["round"]),
            "round_s": round(float(r["round_seconds"]), 3),
            "server_s": round(float(r["server_overhead_seconds"]), 3),
            "sampled": int(r["participants_sampled"]),
            "replied": int(r["participants_replied"]),
            "failed": int(r["participants_failed"]),
        }
        for r in rows
    ]
    grid = []
    gpath = out / "grid_timings.jsonl"
    if gpath.is_file():
        grid = [json.loads(line) for line in gpath.read_text().splitlines() if line.strip()]
    res["grid"] = grid
    workers = []
    for i in range(n):
        p = work / f"worker{i}.jsonl"
        if p.is_file():
            workers += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    steady = res["rounds"][1:]  # round 1 includes registration-time effects
    train = [g for g in grid if g["n"] > 0][1:]  # the first send is registration
    steady_train = train[1:]
    res["median"] = {
        "round_s": _med([r["round_s"] for r in steady]),
        "server_s": _med([r["server_s"] for r in steady]),
        "push_s": _med([g["push_s"] for g in steady_train]),
        "last_reply_s": _med(
            [max((x["t"] for x in g["replies"]), default=0) for g in steady_train]
        ),
        "worker_input_s": _med([w["input"] for w in workers[1:] if "input" in w]),
        "worker_app_s": _med([w["app"] - w["input"] for w in workers[1:] if "app" in w]),
        "worker_push_s": _med([w["pushed"] - w["app"] for w in workers[1:] if "app" in w]),
    }
    res["errors"] = [
        {"round": k, "dst": x["dst"], "src": x["src"], "code": x["error"], "t": x["t"]}
        for k, g in enumerate(train, start=1)
        for x in g["replies"]
        if x["error"] is not None
    ]
    res["missing"] = [
        {"round": k, "dst": g["missing"]} for k, g in enumerate(train, start=1) if g["missing"]
    ]
    return res


def main() -> None:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--net", choices=["loopback", "netns"], default="loopback")
    p.add_argument("--preset", choices=sorted(PRESETS), default="warm")
    p.add_argument("--participants", type=int, default=4)
    p.add_argument("--per-round", type=int, default=None)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument(
        "--epsilon-budget",
        type=float,
        default=None,
        help="with noise multiplier 1.0: run until budget_exhausted (rounds is the cap)",
    )
    p.add_argument("--round-timeout", type=float, default=60)
    p.add_argument("--shape", action="append", help="IDX:RATE, e.g. 2:8mbit (netns only)")
    p.add_argument("--kill", action="append", help="IDX@SECONDS after the run started")
    p.add_argument("--unregistered", action="store_true")
    p.add_argument(
        "--fleet-proxy",
        action="store_true",
        help="netns: nodes reach the SuperLink through nginx, which forwards /v1/fleet/ only",
    )
    p.add_argument(
        "--node-poll", type=float, default=0.1, help="fast_supernode's active idle poll (s)"
    )
    p.add_argument(
        "--server-poll", type=float, default=0.05, help="prototype ServerApp's reply poll (s)"
    )
    p.add_argument(
        "--worker-poll", type=float, default=0.05, help="warm worker's AcquireTask poll (s)"
    )
    p.add_argument(
        "--obj-concurrency",
        type=int,
        default=None,
        help="FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES/PULLS for every process (Flower: 2)",
    )
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = p.parse_args()
    global OBJ_CONCURRENCY
    OBJ_CONCURRENCY = str(args.obj_concurrency or "")
    args.per_round = args.per_round or args.participants
    load0 = os.getloadavg()[0]
    result = run(args)
    result["loadavg_before"] = round(load0, 2)
    result["loadavg_after"] = round(os.getloadavg()[0], 2)
    Path(result["work"], "results.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return
    print(f"preset {args.preset} on {args.net}: status {result['status']} "
          f"({result.get('stopped')}, {result.get('rounds_completed')} rounds), "
          f"load {result['loadavg_before']} -> {result['loadavg_after']}")  # fmt: skip
    print(f"  SuperLink up {result['superlink_start_s']} s, "
          f"nodes ready {result['nodes_ready_s']} s, "
          f"run {result['run_wall_s']} s")  # fmt: skip
    print("  round  seconds  server  sampled replied failed")
    for r in result["rounds"]:
        print(f"  {r['round']:5d} {r['round_s']:8.2f} {r['server_s']:7.2f} {r['sampled']:8d} "
              f"{r['replied']:7d} {r['failed']:6d}")  # fmt: skip
    print("  medians (rounds 2..):", json.dumps(result["median"]))
    for key in (
        "cpu_s",
        "errors",
        "missing",
        "killed_at_s",
        "unregistered_node",
        "proxy_probe_from_participant",
    ):
        if result.get(key):
            print(f"  {key}: {json.dumps(result[key])[:600]}")
    print(f"  details: {result['work']}/results.json")


if __name__ == "__main__":
    main()
