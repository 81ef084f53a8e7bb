"""``fedmeta deploy local``: a whole deployed federation as plain processes, for a quick check.

One SuperLink (TLS, node authentication), N participants (``fedmeta deploy participant``: SuperNode
+ warm worker, each with its own registered key and bound participant id), and one
``fedmeta deploy run``, on this machine's loopback; every process is ended by its id afterwards.
The same :class:`LocalFederation` drives the multi-host test (tests/deploy), where each host is a
network namespace: a *host* is anything with ``popen``/``run``/``kill`` and an ``address``.

    fedmeta deploy local --participants 3 [--config FILE] [--set KEY=VALUE ...] [--keep DIR]

Runs deploy/tls/make-certs.sh (package data, so an installed wheel has it too), which needs openssl
and ssh-keygen.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmeta import exitcodes
from fedmeta.cli.hosts import Host, LocalHost
from fedmeta.cli.process_tree import child_commands, descendants, end_pinned, pin
from fedmeta.client import worker

#: The package data this module runs, as parts of a path in ``fedmeta.deploy`` (see deploy_file).
MAKE_CERTS = ("tls", "make-certs.sh")
PROXY_TEMPLATE = ("proxy", "fleet-only.conf.template")


def deploy_file(parts: Sequence[str]) -> Path:
    """A file of ``fedmeta.deploy`` (``deploy/`` in a checkout), as a path.

    Imported when a file is needed, so the command line's other commands never depend on it.
    """
    from fedmeta.deploy import data_file

    return data_file(parts)


BIN = Path(sys.executable).parent






def free_port() -> int:
    """A TCP port free on this machine's loopback now (loopback runs share it with others)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """``predicate()``'s first truthy value, polled every ``every`` s; TimeoutError after."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


@dataclass
class Node:
    """One participant node: its host, participant id, key and how the server knows the key."""

    host: Host
    participant_id: str
    key_name: str  # certs/nodes/<key_name>.key
    registered: bool = True  # with the SuperLink (Flower refuses an unregistered key)
    bound: bool = True  # in federation.node_keys (the server refuses an unbound key)
    runtime_port: int = 9094
    proc: subprocess.Popen[Any] | None = None


def key_fingerprint(public_key_file: Path) -> str:
    """``SHA256:...`` of an OpenSSH public key, as ``ssh-keygen -l`` prints it."""
    import base64
    import hashlib

    blob = base64.b64decode(public_key_file.read_text().split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


NGINX_MAIN = """# fedmeta deploy local: nginx in the foreground, its files under the work directory.
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/logs/nginx-error.log warn;
daemon off;
events {{ worker_connections 512; }}
http {{
  access_log off;
  client_body_temp_path {work}/nginx-tmp/body;
  proxy_temp_path {work}/nginx-tmp/proxy;
  fastcgi_temp_path {work}/nginx-tmp/fastcgi;
  uwsgi_temp_path {work}/nginx-tmp/uwsgi;
  scgi_temp_path {work}/nginx-tmp/scgi;
{server}
}}
"""


def proxy_config(work: Path, certs: Path, listen: str, upstream: str) -> str:
    """nginx.conf around deploy/proxy/fleet-only.conf.template (the one proxy configuration)."""
    values = {
        "FEDMETA_PROXY_LISTEN": listen, "FEDMETA_SUPERLINK_UPSTREAM": upstream,
        "FEDMETA_SUPERLINK_NAME": "localhost", "FEDMETA_PROXY_CERT": str(certs / "server.crt"),
        "FEDMETA_PROXY_KEY": str(certs / "server.key"), "FEDMETA_PROXY_CA": str(certs / "ca.crt"),
    }  # fmt: skip
    server = deploy_file(PROXY_TEMPLATE).read_text()
    for key, value in values.items():
        server = server.replace("${" + key + "}", value)
    return NGINX_MAIN.format(work=work, server=server)


class LocalFederation:
    """A SuperLink and participant nodes with TLS and node authentication, on given hosts.

    ``fleet_proxy``: bind the SuperLink to the server's loopback and let participants in through
    nginx, which forwards only the Fleet API (the multi-machine layout of docs/deploy.md).
    """

    def __init__(
        self, work: Path, server: Host, *, port: int | None = None, fleet_proxy: bool = False,
        echo: Callable[[str], None] = lambda text: None,
    ) -> None:  # fmt: skip
        """Everything (certificates, logs, homes, outputs) goes under ``work``."""
        self.work, self.server, self.echo = Path(work).resolve(), server, echo
        self.certs, self.logs = self.work / "certs", self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.fleet_proxy = fleet_proxy
        self.proxy_port = free_port() if fleet_proxy else self.port
        self.nodes: list[Node] = []
        self.procs: list[tuple[Host, subprocess.Popen[Any]]] = []
        self.extra_env: dict[str, dict[str, str]] = {}  # process name -> variables (benchmarks)

    @property
    def fleet_address(self) -> str:
        """What participants dial: the proxy when there is one, else the SuperLink."""
        return f"{self.server.address}:{self.proxy_port}"

    @property
    def control_address(self) -> str:
        """What the operator's commands dial, on the server host itself."""
        return f"127.0.0.1:{self.port}"

    def env(self, name: str) -> dict[str, str]:
        """A process's environment: its own FLWR_HOME, this interpreter's tools first on PATH."""
        home = self.work / "homes" / name
        home.mkdir(parents=True, exist_ok=True)
        return dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0",
                    FLWR_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1",
                    PATH=f"{BIN}:{os.environ.get('PATH', '')}",
                    **self.extra_env.get(name, {}))  # fmt: skip

    def start(self, host: Host, name: str, cmd: Sequence[str]) -> subprocess.Popen[Any]:
        """Start ``cmd`` on ``host``, logging to logs/NAME.log."""
        log = (self.logs / f"{name}.log").open("w")
        proc = host.popen(cmd, env=self.env(name), stdout=log, stderr=subprocess.STDOUT,
                          cwd=self.work)  # fmt: skip
        self.procs.append((host, proc))
        return proc

    def make_certs(self, key_names: Sequence[str], sans: Sequence[str] = ()) -> None:
        """CA, server certificate (``sans`` added), one key pair per name (make-certs.sh)."""
        script = deploy_file(MAKE_CERTS)
        if not script.is_file():
            raise FileNotFoundError(f"{script} not found: reinstall fedmeta (package data)")
        cmd = ["bash", str(script), "--out", str(self.certs)]
        cmd += [a for n in key_names for a in ("--node", n)]
        cmd += [a for s in sans for a in ("--san", s)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """The operator's ``flwr`` on the server host, connection ``local`` (Control API)."""
        home = self.work / "homes" / "operator"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = '
            f'"{self.control_address}"\nroot-certificates = "{self.certs / "ca.crt"}"\n'
        )
        env = dict(self.env("operator"), FLWR_HOME=str(home))
        return self.server.run([str(BIN / "flwr"), *args], env=env, timeout=timeout, check=False)

    def start_superlink(
        self, timeout: float = 180, *, database: Path | None = None, proxy: bool = True,
        log_name: str = "superlink", isolation: str = "subprocess",
    ) -> subprocess.Popen[Any]:  # fmt: skip
        """The SuperLink (TLS, node auth, ServerApp in a subprocess); wait until it answers.

        ``database``: its state file (registered keys, node ids, runs), so that a restart keeps
        them (docs/deploy.md, "Certificates"); without it the state is in memory. ``proxy``: also
        start the Fleet-only proxy when this federation has one (a restart leaves it running).
        ``isolation="process"``: the ServerApp is left to a ``flower-superexec`` started apart
        (compose's ``serverapp``, the guide's server host), which the SuperExec secret admits.
        """
        bind = "127.0.0.1" if self.fleet_proxy or self.server.address == "127.0.0.1" else "0.0.0.0"
        c = self.certs
        state = ["--database", str(database)] if database is not None else []
        if isolation == "process":
            state += ["--superexec-auth-secret-file", str(c / "superexec.secret")]
        proc = self.start(self.server, log_name, [
            str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(c / "ca.crt"),
            "--ssl-certfile", str(c / "server.crt"), "--ssl-keyfile", str(c / "server.key"),
            "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--isolation", isolation, "--host", bind, "--port", str(self.port), *state,
        ])  # fmt: skip
        wait_until(lambda: self.flwr("ls", "--format", "json").returncode == 0, timeout,
                   "the SuperLink's Control API")  # fmt: skip
        if self.fleet_proxy and proxy:
            self._start_proxy()
        return proc

    def _start_proxy(self) -> None:
        nginx = shutil.which("nginx")
        if nginx is None:
            raise FileNotFoundError("nginx not found (Debian: apt-get install nginx-light)")
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.work / "nginx-tmp" / sub).mkdir(parents=True, exist_ok=True)
        conf = self.work / "nginx.conf"
        conf.write_text(proxy_config(self.work, self.certs, self.fleet_address,
                                     f"127.0.0.1:{self.port}"))  # fmt: skip
        pid_file = self.work / "nginx.pid"
        pid_file.unlink(missing_ok=True)
        proc = self.start(self.server, "nginx", [nginx, "-c", str(conf)])
        # nginx writes its pid file once it listens; one that exits first (a port in use, a bad
        # certificate) is reported with its own error, not as nodes that never come online.
        wait_until(lambda: pid_file.is_file() or proc.poll() is not None, 60, "nginx to listen")
        if proc.poll() is not None:
            logs = [self.logs / "nginx.log", self.logs / "nginx-error.log"]
            errors = " ".join(p.read_text()[-600:] for p in logs if p.is_file())
            raise RuntimeError(f"nginx (the Fleet-only proxy) exited {proc.returncode}: {errors}")

    def register(self, key_names: Sequence[str], attempts: int = 5) -> None:
        """Register node public keys with the SuperLink (Control API, from the server host).

        ``flwr supernode register`` can exit 0 without having registered anything (its JSON then
        says ``"success": false``); each key is tried until the SuperLink confirms it, or says
        the key is already registered.
        """
        for name in key_names:
            text = ""
            for attempt in range(attempts):
                res = self.flwr("supernode", "register",
                                str(self.certs / "nodes" / f"{name}.key.pub"), "local", "--name",
                                name, "--format", "json")  # fmt: skip
                text = " ".join((res.stdout + res.stderr).split())
                flat = text.replace("'", '"').replace('": ', '":').lower()
                if res.returncode == 0 and '"success":true' in flat or "already in use" in flat:
                    break
                time.sleep(1 + attempt)
            else:
                raise RuntimeError(f"registering {name}: {text[-400:]}")

    def node_keys_file(self) -> Path:
        """``[federation.node_keys]`` of the bound nodes (participant id = key fingerprint)."""
        lines = ["[federation.node_keys]"]
        for node in self.nodes:
            if node.bound:
                fp = key_fingerprint(self.certs / "nodes" / f"{node.key_name}.key.pub")
                lines.append(f'"{node.participant_id}" = "{fp}"')
        path = self.work / "node-keys.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_node(
        self, node: Node, *extra: str, root_certificates: Path | None = None
    ) -> subprocess.Popen[Any]:
        """``fedmeta deploy participant`` for ``node`` on its host.

        ``root_certificates``: what it verifies the server with (default ``certs/ca.crt``; a
        bundle of two CAs while the CA rolls over, docs/deploy.md).
        """
        name = f"node-{node.key_name}"
        data = self.work / "data" / node.participant_id
        data.mkdir(parents=True, exist_ok=True)
        roots = root_certificates or self.certs / "ca.crt"
        node.proc = self.start(node.host, name, [
            str(BIN / "fedmeta"), "deploy", "participant", "--superlink", self.fleet_address,
            "--root-certificates", str(roots),
            "--participant-id", node.participant_id, "--data-path", str(data),
            "--node-key", str(self.certs / "nodes" / f"{node.key_name}.key"),
            "--runtime-port", str(node.runtime_port),
            "--timings", str(self.logs / f"{name}.timings.jsonl"), *extra,
        ])  # fmt: skip
        return node.proc

    def online(self) -> int:
        """How many nodes the SuperLink reports online."""
        res = self.flwr("supernode", "list", "--format", "json")
        if res.returncode != 0:
            return 0
        try:
            start = res.stdout.index("{")
            nodes = json.loads(res.stdout[start:]).get("nodes", [])
        except ValueError:
            return 0
        return sum(n.get("status") == "online" for n in nodes)

    def kill_node(self, node: Node, settle_s: float = 2.0) -> None:
        """SIGKILL a participant: supervisor, worker, then (``settle_s`` later) its SuperNode.

        The worker goes first so that the SuperNode dies waiting for a reply rather than between
        sending a reply's message and its objects: Flower 1.41's ServerApp would then wait for
        those objects inside ``Grid.pull_messages`` (for up to two hours), beyond any round
        timeout of fedmeta's (docs/deploy.md, "Failure behaviour").
        """
        assert node.proc is not None
        children = child_commands(node.proc.pid)
        os.kill(node.proc.pid, signal.SIGKILL)  # the supervisor: it must not stop the others
        for pid, args in children.items():
            if worker.__name__ in args:
                os.kill(pid, signal.SIGKILL)
        time.sleep(settle_s)
        node.host.kill(node.proc, signal.SIGKILL)  # everything left in its process group
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def workers_ready(self, nodes: Sequence[Node]) -> bool:
        """Whether each node's worker has finished its imports and warm-up."""
        logs = [self.logs / f"node-{n.key_name}.log" for n in nodes]
        return all(p.is_file() and "warm worker ready" in p.read_text() for p in logs)

    def deploy_run(
        self, out: Path, *, config: Path | None = None, sets: Sequence[str] = (),
        timeout: float = 1800, node_keys: Path | None = None, log_name: str = "deploy-run",
    ) -> subprocess.Popen[Any]:  # fmt: skip
        """``fedmeta deploy run`` on the server host (bound nodes' keys sent with the run).

        ``node_keys``: the binding to send (e.g. make-certs.sh's ``node-keys.toml``); by default
        that of ``self.nodes``. Its output goes to logs/LOG_NAME.log.
        """
        cmd = [str(BIN / "fedmeta"), "deploy", "run", "--superlink", self.control_address,
               "--root-certificates", str(self.certs / "ca.crt"), "--out", str(out),
               "--poll", "0.5", "--timeout", str(timeout)]  # fmt: skip
        cmd += ["--node-keys", str(node_keys or self.node_keys_file())]
        if config is not None:
            cmd += ["--config", str(config)]
        cmd += [a for s in sets for a in ("--set", s)]
        return self.start(self.server, log_name, cmd)

    def close(self) -> None:
        """End every process started here (SIGTERM, then SIGKILL), by its process group.

        Then whatever they started in sessions of their own, which a group signal misses: the
        SuperLink's executor and its ServerApp, should the SuperLink not end them itself. They
        are pinned before any signal, while they are still known as descendants.
        """
        pinned = pin([d for _, proc in self.procs for d in descendants(proc.pid)])
        for host, proc in reversed(self.procs):
            host.kill(proc, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for host, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                host.kill(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        end_pinned(list(pinned.values()), grace_s=5.0)


# ------------------------------------------------------------------------------------ command line


def register(subparsers: Any) -> None:
    """Add ``fedmeta deploy local`` (called by fedmeta.cli.deploy.register)."""
    p = subparsers.add_parser(
        "local", help="quick check: a TLS + node-auth federation as processes on loopback",
        description="Start a SuperLink and N participants (SuperNode + warm worker) on this "
        "machine's loopback with TLS and node authentication, run one federation with `fedmeta "
        "deploy run`, end every process. Exit status: the run's.",
    )  # fmt: skip
    p.add_argument("--participants", type=int, default=3)
    p.add_argument("--config", type=Path, help="fedmeta TOML configuration")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--keep", type=Path, help="keep certificates, logs and outputs in this directory"
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.set_defaults(func=_handle)


def quick_check_sets(participants: int, work: Path) -> list[str]:
    """A small private sinusoid federation that runs to budget_exhausted in a minute or two."""
    return [
        f"federation.participants={participants}",
        f"sampling.participants_per_round={participants}",
        "rounds=1000", "privacy.epsilon_budget=3", "privacy.noise_multiplier=1.2",
        "sampling.task_rate=0.2", "dataset.tasks_per_participant=20", "dataset.test_tasks=16",
        "dataset.validation_tasks=16", "dataset.probe_tasks=0", "training.eval_every=1000000",
        "privacy.report_every=1000000", "output.plots=false", "output.progress=false",
        "federation.round_timeout_s=30", "federation.register_timeout_s=120",
        f"privacy.ledger_path={work / 'state' / 'ledger.sqlite'}",
    ]  # fmt: skip


def _handle(args: argparse.Namespace) -> int:
    if not 1 <= args.participants <= 50:
        print("fedmeta deploy local: --participants must be in [1, 50]", file=sys.stderr)
        return exitcodes.BAD_INPUT
    work = Path(args.keep or tempfile.mkdtemp(prefix="fedmeta-local-")).resolve()
    fed = LocalFederation(work, LocalHost(), echo=print)
    try:
        return _quick_check(fed, args)
    except (OSError, RuntimeError, TimeoutError, subprocess.SubprocessError) as error:
        print(f"fedmeta deploy local: {error} (logs in {fed.logs})", file=sys.stderr)
        return exitcodes.UNAVAILABLE
    finally:
        fed.close()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _quick_check(fed: LocalFederation, args: argparse.Namespace) -> int:
    names = [f"participant-{i}" for i in range(args.participants)]
    print(f"certificates and {len(names)} node keys in {fed.certs}", flush=True)
    fed.make_certs(names)
    fed.start_superlink()
    fed.register(names)
    fed.nodes = [
        Node(LocalHost(), str(i), n, runtime_port=free_port()) for i, n in enumerate(names)
    ]
    for node in fed.nodes:
        fed.start_node(node)
    wait_until(lambda: fed.online() >= len(names), 300, f"{len(names)} nodes online", every=1)
    wait_until(lambda: fed.workers_ready(fed.nodes), 600, "the workers' warm-up", every=1)
    print(f"SuperLink {fed.control_address} and {len(names)} participants up; running", flush=True)
    sets = [*quick_check_sets(args.participants, fed.work), *args.overrides]
    run = fed.deploy_run(fed.work / "runs" / "quick-check", config=args.config, sets=sets,
                         timeout=args.timeout)  # fmt: skip
    status = run.wait(timeout=args.timeout + 300)
    print((fed.logs / "deploy-run.log").read_text(), end="")
    return int(status)
