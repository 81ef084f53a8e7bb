"""``fedmeta deploy participant`` and ``fedmeta deploy worker``: run one participant's processes.

``participant`` runs a SuperNode (``python -m fedmeta.client.supernode``, fast polls,
``--isolation process``) and its warm worker (``python -m fedmeta.client.worker``) beside it,
sharing the node's loopback. If either ends, the other is stopped and the command exits with the
first one's status, so a supervisor (systemd, a container's restart policy) restarts both.
``worker`` runs the warm worker alone, for a SuperNode started elsewhere (Flower's
``flwr/supernode`` image: ``deploy/compose/flower-images.yml``); it replaces its own process with
the worker's. The launched modules are imported (both import Flower only when they run), so the
launched names follow the code.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedmeta import exitcodes
from fedmeta.cli.deploy_args import add_connection_args
from fedmeta.cli.deploy_flwr import DeployError, refused, tls_settings
from fedmeta.client import supernode, worker


def register(sub: Any) -> None:
    """Add ``fedmeta deploy participant`` and ``fedmeta deploy worker``."""
    _register_participant(sub)
    _register_worker(sub)


def _register_participant(sub: Any) -> None:
    env = os.environ.get
    p = sub.add_parser(
        "participant", help="run one participant: a SuperNode and its warm worker",
        description="Run a SuperNode (fast polls, --isolation process) and fedmeta's warm worker "
        "beside it on this host's loopback. Exits when either ends (status 75: restart both).",
    )  # fmt: skip
    add_connection_args(p, "Fleet API")
    p.add_argument("--node-key", type=Path, default=env("FEDMETA_NODE_KEY") or None,
                   help="this node's private authentication key (OpenSSH ECDSA; default "
                   "$FEDMETA_NODE_KEY); its .pub is what the operator registers")  # fmt: skip
    p.add_argument("--runtime-port", type=int, default=int(env("FEDMETA_RUNTIME_PORT", "9094")))
    _add_worker_args(p)
    p.add_argument("--poll", type=float, default=0.1, help="SuperNode poll while a run is active")
    p.add_argument("--stock-poll", action="store_true", help="Flower's own 3 s SuperNode polls")
    p.add_argument("extra", nargs="*", help="after --: more flower-supernode arguments")
    p.set_defaults(func=_handle_participant)


def _add_worker_args(p: argparse.ArgumentParser) -> None:
    """The participant's own settings, the same for ``participant`` and ``worker``."""
    env = os.environ.get
    p.add_argument("--participant-id", default=env("FEDMETA_PARTICIPANT_ID"),
                   help="this node's participant id (default $FEDMETA_PARTICIPANT_ID)")  # fmt: skip
    p.add_argument("--data-path", default=env("FEDMETA_DATA_PATH") or None,
                   help="this participant's own data (node config data-path; default "
                   "$FEDMETA_DATA_PATH)")  # fmt: skip
    p.add_argument("--warm-config", type=Path, default=env("FEDMETA_WARM_CONFIG") or None)
    p.add_argument("--alive-file", type=Path, default=env("FEDMETA_WORKER_ALIVE") or None)
    p.add_argument("--task-timeout", type=float, default=3600.0)
    p.add_argument("--timings", type=Path, help="the worker's per-task timings (JSON lines)")


def _register_worker(sub: Any) -> None:
    env = os.environ.get
    p = sub.add_parser(
        "worker", help="run only the warm worker, for a SuperNode that runs elsewhere",
        description="Run fedmeta's warm worker against the Runtime API of a SuperNode started "
        "elsewhere with --isolation process: Flower's flwr/supernode image "
        "(deploy/compose/flower-images.yml) or one you run yourself. The worker reads the "
        "participant's data; the SuperNode never does. Start that SuperNode with the same "
        "--node-config (participant-id, data-path) that this command prints.",
    )  # fmt: skip
    p.add_argument("--runtime-api-address", default=env("FEDMETA_RUNTIME_API", "127.0.0.1:9094"),
                   help="host:port of the SuperNode's Runtime API (its --host and --port; "
                   "default $FEDMETA_RUNTIME_API or 127.0.0.1:9094)")  # fmt: skip
    p.add_argument("--runtime-ca", type=Path, default=env("FEDMETA_RUNTIME_CA") or None,
                   help="CA of the Runtime API's certificate (the SuperNode's --ssl-certfile; "
                   "default $FEDMETA_RUNTIME_CA); without it plain HTTP")  # fmt: skip
    p.add_argument("--superexec-auth-secret-file", dest="secret_file", type=Path,
                   default=env("FEDMETA_SUPEREXEC_SECRET") or None,
                   help="the SuperNode's --superexec-auth-secret-file (default "
                   "$FEDMETA_SUPEREXEC_SECRET)")  # fmt: skip
    _add_worker_args(p)
    p.set_defaults(func=_handle_worker)


def worker_only_command(args: argparse.Namespace) -> list[str]:
    """The command of ``fedmeta deploy worker``, its arguments checked."""
    if not args.participant_id:
        raise DeployError("--participant-id (or $FEDMETA_PARTICIPANT_ID) is required",
                          exitcodes.BAD_INPUT)  # fmt: skip
    host, _, port = str(args.runtime_api_address).rpartition(":")
    if not host or not port.isdigit():
        raise DeployError(f"--runtime-api-address {args.runtime_api_address!r}: give host:port "
                          "of the SuperNode's Runtime API", exitcodes.BAD_INPUT)  # fmt: skip
    config = node_config(str(args.participant_id), args.data_path)
    return worker_command(args, args.runtime_api_address, config,
                          ("--root-certificates", args.runtime_ca),
                          ("--superexec-auth-secret-file", args.secret_file))  # fmt: skip


def _handle_worker(args: argparse.Namespace) -> int:
    try:
        command = worker_only_command(args)
    except DeployError as error:
        return refused("worker", error)
    config = command[command.index("--node-config") + 1]
    print(f"fedmeta deploy worker: Runtime API {args.runtime_api_address}; the SuperNode's "
          f"--node-config must be '{config}'", file=sys.stderr)  # fmt: skip
    host = str(args.runtime_api_address).rpartition(":")[0]
    if args.runtime_ca is None and host not in ("127.0.0.1", "localhost", "[::1]"):
        print("fedmeta deploy worker: plain HTTP to the Runtime API: keep it on a network that "
              "only this SuperNode and its worker share, or give --runtime-ca", file=sys.stderr)
    sys.stderr.flush()
    os.execv(command[0], command)  # the worker's exit status and signals are this command's
    return exitcodes.UNAVAILABLE  # not reached


def node_config(participant_id: str, data_path: str | None) -> str:
    """The SuperNode's ``--node-config``: ``participant-id`` and, if given, ``data-path``."""
    pairs = {"participant-id": participant_id}
    if data_path:
        pairs["data-path"] = str(Path(data_path).expanduser().resolve())
    for key, value in pairs.items():
        if '"' in value or "\\" in value or not value.strip():
            raise DeployError(f"{key} {value!r}: give a value without quotes or backslashes",
                              exitcodes.BAD_INPUT)  # fmt: skip
    return " ".join(f'{k}="{v}"' for k, v in pairs.items())


def participant_commands(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(SuperNode command, worker command) for ``fedmeta deploy participant``."""
    if not args.participant_id:
        raise DeployError("--participant-id (or $FEDMETA_PARTICIPANT_ID) is required",
                          exitcodes.BAD_INPUT)  # fmt: skip
    ca, insecure = tls_settings(args)
    config = node_config(str(args.participant_id), args.data_path)
    link = ["--superlink", args.superlink,
            *(["--insecure"] if insecure else ["--root-certificates", str(ca)])]  # fmt: skip
    if args.node_key is not None:
        if not Path(args.node_key).is_file():
            raise DeployError(f"--node-key {args.node_key}: no such file", exitcodes.BAD_INPUT)
        link += ["--auth-supernode-private-key", str(Path(args.node_key).resolve())]
    local = ["--isolation", "process", "--host", "127.0.0.1", "--port", str(args.runtime_port),
             "--node-config", config]  # fmt: skip
    py = sys.executable
    shim = [py, "-m", supernode.__name__, "--poll", str(args.poll),
            "--reply-timeout", str(args.task_timeout + 60), "--"]  # fmt: skip
    node = [*([str(Path(py).parent / "flower-supernode")] if args.stock_poll else shim),
            *link, *local, *args.extra]  # fmt: skip
    return node, worker_command(args, f"127.0.0.1:{args.runtime_port}", config)


def worker_command(
    args: argparse.Namespace, address: str, config: str, *more: tuple[str, Path | None]
) -> list[str]:
    """The warm worker's command.

    Its Runtime API is at ``address``, its node config ``config``; ``more`` holds further
    ``(flag, path)`` pairs, each passed where its path is given.
    """
    warm = [sys.executable, "-m", worker.__name__, "--runtime-api-address", address,
            "--node-config", config, "--task-timeout", str(args.task_timeout)]  # fmt: skip
    for flag, value in (("--warm-config", args.warm_config), ("--alive-file", args.alive_file),
                        ("--timings", args.timings), *more):  # fmt: skip
        if value is not None:
            warm += [flag, str(value)]
    return warm


def _handle_participant(args: argparse.Namespace) -> int:
    try:
        node, warm = participant_commands(args)
    except DeployError as error:
        return refused("participant", error)
    if args.insecure:
        print("fedmeta deploy participant: WARNING: no TLS to the SuperLink (--insecure); local "
              "tests on a private network only", file=sys.stderr)  # fmt: skip
    return supervise({"supernode": node, "worker": warm})


def supervise(commands: Mapping[str, Sequence[str]], grace_s: float = 15.0) -> int:
    """Run the commands side by side; when one ends (or on SIGTERM/SIGINT), end the others.

    Returns the status of the first to end (143 for a signal), so a supervisor restarts them all.
    Each child runs in a session of its own, so that a signal to this process's group (Ctrl-C in
    its terminal) reaches it once, from here: Flower's SuperNode restores the default action after
    its first SIGTERM, and a second one would end it before it tells the SuperLink it is leaving
    (the node then shows offline only after two missed heartbeats, about 60 s).
    """
    procs = {name: subprocess.Popen(list(cmd), start_new_session=True)
             for name, cmd in commands.items()}  # fmt: skip
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = None
        while status is None and not stopping:
            for name, proc in procs.items():
                if (code := proc.poll()) is not None:
                    print(f"fedmeta deploy participant: {name} exited with status {code}; "
                          "stopping the rest", file=sys.stderr)  # fmt: skip
                    status = code
                    break
            else:
                time.sleep(0.5)
        return stopping[0] if stopping else int(status or 0)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
