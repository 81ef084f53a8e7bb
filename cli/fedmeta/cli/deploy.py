"""``fedmeta deploy``: start a deployed run and wait for its outcome; run a participant node.

``fedmeta deploy run`` submits fedmeta's ServerApp to a SuperLink and exits with the run's outcome,
where ``flwr run`` exits 0 even when the ServerApp fails. It

* validates the configuration here first (a bad key is exit status 2 before anything is sent) and
  sends it *with the run*, as ``set`` overrides, so the ServerApp never reads a config file path
  that exists only on the operator's machine;
* submits a Flower app that holds no code (``pyproject.toml`` alone, named ``fedmeta/fedmeta`` at
  this fedmeta's version): the ServerApp process imports the fedmeta *installed* on the server, and
  the participants' workers accept only runs of their own fedmeta version;
* gives every run its own output directory (``--runs-dir``/UTC time-random) unless ``--out`` names
  one, so a second run never collides with the first;
* polls the run's status (what ``flwr ls --run-id`` shows, asked in this process: control_api.py)
  until it finishes, then exits with fedmeta's exit status (core/fedmeta/exitcodes.py), and prints
  where the outputs and the ledger are.

``fedmeta deploy participant`` runs one participant: a SuperNode
(``python -m fedmeta.client.supernode``, fast polls, ``--isolation process``) and its warm worker
(``python -m fedmeta.client.worker``) beside it,
sharing the node's loopback. If either ends, the other is stopped and the command exits with the
first one's status, so a supervisor (systemd, a container's restart policy) restarts both.
``fedmeta deploy worker`` runs the warm worker alone, for a SuperNode started elsewhere (Flower's
``flwr/supernode`` image: ``deploy/compose/flower-images.yml``).

Nothing here imports torch or ``server``, and Flower only to poll a run's status (control_api.py):
the commands drive subprocesses (``worker`` replaces its own process with the worker's). The modules
they launch are imported (``client.supernode``, ``client.worker``: both import Flower only when
they run), so the launched names follow the code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmeta import exitcodes
from fedmeta.client import supernode, worker
from fedmeta.simulation.simulate import key_value

CONNECTION = "fedmeta"
#: Exception names in a failed run's status details -> fedmeta's exit status (as in simulate).
_FAILURES = (
    (("RegistrationError", "RunDirectoryBusy"), exitcodes.UNAVAILABLE),
    (("ConfigError", "CheckpointError", "DataError", "LedgerError", "BudgetExhausted",
      "LedgerCorrupted", "LedgerMissing", "LedgerReadOnly", "LedgerReplaced", "LedgerUnreadable",
      "NotALedger", "LedgerUnwritable", "LedgerRolledBack", "FederationError", "PlanError",
      "PermissionError", "FileNotFoundError"),
     exitcodes.BAD_INPUT),
    (("NoRoundAffordable",), exitcodes.BUDGET_EXHAUSTED),
)  # fmt: skip


class DeployError(RuntimeError):
    """A one-line reason the command cannot go on, with the exit status it maps to."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def register(subparsers: Any) -> None:
    """Add ``fedmeta deploy`` and its commands (run, participant, worker, register, ...)."""
    deploy = subparsers.add_parser(
        "deploy", help="deployed federations (Flower SuperLink / SuperNodes): run, worker, ...",
        description="Start a run on a deployed federation and wait for it, or run a participant "
        "node. See docs/deploy.md.",
    )  # fmt: skip
    sub = deploy.add_subparsers(dest="deploy_command", metavar="COMMAND")
    sub.required = True
    _register_run(sub)
    _register_participant(sub)
    _register_worker(sub)
    _register_keys(sub)
    from fedmeta.cli import deploy_local, deploy_status

    deploy_local.register(sub)
    deploy_status.register(sub, _add_connection_args)


# ------------------------------------------------------------------------------------ connection


def _add_connection_args(p: argparse.ArgumentParser, what: str) -> None:
    env = os.environ.get
    p.add_argument("--superlink", default=env("FEDMETA_SUPERLINK", "127.0.0.1:8000"),
                   help=f"host:port of the SuperLink's {what} (default $FEDMETA_SUPERLINK or "
                   "127.0.0.1:8000)")  # fmt: skip
    p.add_argument("--root-certificates", type=Path, default=env("FEDMETA_TLS_CA") or None,
                   help="the federation's CA certificate (default $FEDMETA_TLS_CA)")  # fmt: skip
    p.add_argument("--insecure", action="store_true",
                   default=env("FEDMETA_INSECURE", "0") == "1",
                   help="no TLS: only on a private network for local tests (default "
                   "$FEDMETA_INSECURE=1)")  # fmt: skip


def tls_settings(args: argparse.Namespace) -> tuple[Path | None, bool]:
    """(CA file, insecure): exactly one of the two, checked."""
    ca, insecure = args.root_certificates, bool(args.insecure)
    if ca is not None and insecure:
        raise DeployError("give --root-certificates or --insecure, not both", exitcodes.BAD_INPUT)
    if ca is None and not insecure:
        raise DeployError(
            "--root-certificates CA (the federation's ca.crt) is required; --insecure (no TLS) "
            "only for a local test on a private network",
            exitcodes.BAD_INPUT,
        )
    if ca is not None and not Path(ca).is_file():
        raise DeployError(f"--root-certificates {ca}: no such file", exitcodes.BAD_INPUT)
    return (Path(ca).resolve() if ca is not None else None), insecure


def flwr_bin() -> str:
    """The ``flwr`` CLI beside this interpreter (the one installed with fedmeta), else on PATH."""
    beside = Path(sys.executable).parent / "flwr"
    found = str(beside) if beside.is_file() else shutil.which("flwr")
    if found is None:
        raise DeployError(
            "the flwr CLI is not installed (pip install fedmeta)", exitcodes.BAD_INPUT
        )
    return found


@contextlib.contextmanager
def flwr_home(superlink: str, ca: Path | None) -> Iterator[dict[str, str]]:
    """An environment whose ``flwr`` knows one connection, ``fedmeta``, in a temporary home."""
    with tempfile.TemporaryDirectory(prefix="fedmeta-flwr-") as home:
        tls = f"root-certificates = {json.dumps(str(ca))}" if ca else "insecure = true"
        Path(home, "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f"address = {json.dumps(superlink)}\n{tls}\n"
        )
        env = dict(os.environ, FLWR_HOME=home, FLWR_TELEMETRY_ENABLED="0",
                   FLWR_DISABLE_UPDATE_CHECK="1")  # fmt: skip
        yield env


def flwr(
    env: Mapping[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``flwr ARGS`` with a timeout; a timeout is a failed call (returncode 124)."""
    cmd = [flwr_bin(), *args]
    try:
        return subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(
            cmd, 124, "", f"flwr {args[0]}: no answer in {timeout} s"
        )


def json_in(text: str) -> dict[str, Any]:
    """The JSON object in ``flwr --format json`` output (it may print lines before it)."""
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in flwr's output: {text[-300:]!r}")
    loaded: dict[str, Any] = json.loads(text[start:])
    return loaded


# ------------------------------------------------------------------------------------ run config


def flatten(data: Mapping[str, Any]) -> list[str]:
    """``section.key=value`` overrides that rebuild a configuration file's ``data``."""
    from fedmeta.config_io import toml_value

    out: list[str] = []
    for key, value in data.items():
        if isinstance(value, Mapping):  # a section; tables inside it travel as inline tables
            out += [f"{key}.{k}={toml_value(v)}" for k, v in value.items()]
        else:
            out.append(f"{key}={toml_value(value)}")
    return out


def node_keys_override(path: Path) -> str:
    """``federation.node_keys={...}`` from a file of ``[federation.node_keys]`` (make-certs.sh)."""
    import tomllib

    from fedmeta.config_io import toml_value

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise DeployError(f"--node-keys {path}: {error}", exitcodes.BAD_INPUT) from None
    keys = data.get("federation", {}).get("node_keys", data.get("node_keys"))
    if not isinstance(keys, dict) or not keys:
        raise DeployError(
            f"--node-keys {path}: no [federation.node_keys] table (participant id = "
            '"SHA256:..."); deploy/tls/make-certs.sh writes one',
            exitcodes.BAD_INPUT,
        )
    return f"federation.node_keys={toml_value({str(k): str(v) for k, v in keys.items()})}"


def run_overrides(args: argparse.Namespace) -> tuple[list[str], Any]:
    """The run's overrides and the configuration they make, checked as the ServerApp reads them."""
    import tomllib

    from fedmeta.config import ConfigError
    from fedmeta.config_io import apply_overrides, config_from_dict, load_config

    data: dict[str, Any] = {}
    if args.config is not None:
        try:
            data = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise DeployError(f"--config {args.config}: {error}", exitcodes.BAD_INPUT) from None
    given = [*args.overrides]
    if args.node_keys is not None:
        given.append(node_keys_override(Path(args.node_keys)))
    try:
        wanted = load_config(args.config, given)  # first: what it refuses never reaches flatten
        sets = [*flatten(data), *given]
        sent = config_from_dict(apply_overrides({}, sets))
    except ConfigError as error:
        raise DeployError(str(error), exitcodes.BAD_INPUT) from None
    if sent != wanted:
        raise DeployError("the configuration does not survive the trip as overrides; report this "
                          "with the config file", exitcodes.INTERNAL_ERROR)  # fmt: skip
    bad = [s for s in sets if ";" in s]
    if bad:
        raise DeployError(f"a value holds ';', which the run's 'set' cannot carry: {bad[0][:80]}",
                          exitcodes.BAD_INPUT)  # fmt: skip
    return sets, sent


def default_out(runs_dir: str) -> str:
    """A fresh output directory under ``runs_dir`` (ServerApp host): a time and 48 random bits."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{runs_dir.rstrip('/')}/run-{stamp}-{secrets.token_hex(6)}"


APP_PYPROJECT = """# Generated by `fedmeta deploy run`: fedmeta's app without code. The ServerApp
# process imports the fedmeta installed on the server; participants' workers run their own
# installed fedmeta and accept only this name and version.
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "fedmeta"
version = "{version}"
dependencies = []

[tool.flwr.app]
publisher = "fedmeta"

[tool.flwr.app.components]
serverapp = "fedmeta.server.app:app"
clientapp = "fedmeta.client.app:app"

[tool.flwr.app.config]
config-file = ""
set = ""
out = ""
resume = false
"""


def write_app(directory: Path) -> Path:
    """The code-free Flower app of this fedmeta version in ``directory``."""
    from importlib import metadata

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(
        APP_PYPROJECT.format(version=metadata.version("fedmeta"))
    )
    return directory


def run_config_file(path: Path, sets: Sequence[str], out: str, resume: bool) -> Path:
    """The ``flwr run --run-config`` TOML file (no shell quoting of the overrides involved)."""
    path.write_text(
        f"set = {json.dumps(';'.join(sets))}\nout = {json.dumps(out)}\n"
        f'resume = {"true" if resume else "false"}\nconfig-file = ""\n'
    )
    return path


# ------------------------------------------------------------------------------------ run and wait


@dataclass
class Outcome:
    """How a run ended, as far as this command can tell."""

    run_id: str
    status: str  # finished:completed | finished:failed | finished:stopped | timeout
    details: str = ""
    stopped_reason: str | None = None
    rounds_completed: int | None = None
    out: str | None = None
    ledger: str | None = None
    error: str = ""  # the ServerApp's exception class, from its log


#: flwr's words for any failed request to the SuperLink (connect, read or write).
_UNREACHABLE = "Connection to the SuperLink is unavailable"
#: A failure faster than this was a connect or name-lookup failure: the request never reached the
#: SuperLink. One it received fails only after the CLI's 30 s read timeout.
_CONNECT_FAILURE_S = 5.0


def submit(env: Mapping[str, str], app: Path, config_file: Path, reach_s: float = 60.0) -> str:
    """Submit the run; its id. A SuperLink that does not answer is UNAVAILABLE.

    One that cannot be reached is tried again for ``reach_s``: right after `docker compose up`
    the SuperLink's own health check passes before the compose network's name service answers
    other containers (seen once on a fresh podman). flwr says the same for a request that timed
    out after the SuperLink may have accepted it, so only a fast failure is retried; were a run
    still submitted twice, both would name the same output directory, whose lock and checkpoint
    check refuse the second before it spends (server/fedmeta/server/rundir.py,
    server/fedmeta/server/run.py).
    """
    deadline = time.monotonic() + reach_s
    while True:
        started = time.monotonic()
        res = flwr(env, "run", str(app), CONNECTION, "--run-config", str(config_file),
                   "--format", "json", timeout=300)  # fmt: skip
        try:
            return str(json_in(res.stdout)["run-id"])
        except (ValueError, KeyError):
            text = " ".join((res.stdout + res.stderr).split())
        fast = time.monotonic() - started < _CONNECT_FAILURE_S
        if _UNREACHABLE not in text or not fast or time.monotonic() >= deadline:
            raise DeployError(f"the SuperLink did not accept the run: {text[-400:]}",
                              exitcodes.UNAVAILABLE) from None  # fmt: skip
        time.sleep(2.0)


def wait_for(env: Mapping[str, str], run_id: str, timeout: float, poll: float) -> tuple[str, str]:
    """Poll until the run finishes or ``timeout`` passes (then the run is stopped).

    In this process, through Flower's Control API client (control_api.py): a ``flwr ls`` process
    per poll cost about 1.3 CPU-seconds each time.
    """
    from fedmeta.cli.control_api import RunStatus

    run_status = RunStatus(env, CONNECTION)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, details = run_status(run_id)
            if status.startswith("finished"):
                return status, details
            time.sleep(poll)
    finally:
        run_status.close()
    flwr(env, "stop", run_id, CONNECTION)
    return "timeout", f"not finished after {timeout:.0f} s; stopped"


_SUMMARY = re.compile(r"rounds completed (\d+) of \d+ planned \| stopped: (\w+)")
_OUTPUTS = re.compile(r"outputs: (\S+)/summary\.json")
_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.+)$", re.MULTILINE)
_DETAILS_PREFIX = "ServerApp failed with exception: "


def read_outcome(
    env: Mapping[str, str], run_id: str, status: str, details: str, out: str
) -> Outcome:
    """The outcome, from the run's summary.json when this host sees it, and from its log.

    Flower's status details carry a failed ServerApp's message but not its exception's class; the
    log's traceback does (``server.transport.RegistrationError: ...``): the class is taken from
    there, for the exit status.
    """
    outcome = Outcome(run_id, status, details.removeprefix(_DETAILS_PREFIX), out=out)
    summary = Path(out) / "summary.json"
    if summary.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError):
            s = json.loads(summary.read_text())
            outcome.stopped_reason = s["stopped_reason"]
            outcome.rounds_completed = s["rounds_completed"]
            outcome.ledger = (s.get("ledger") or {}).get("path")
            if status == "finished:completed":
                return outcome
    text = flwr(env, "log", run_id, CONNECTION, "--show", timeout=120).stdout
    if outcome.rounds_completed is None and (match := _SUMMARY.search(text)):
        outcome.rounds_completed, outcome.stopped_reason = int(match.group(1)), match.group(2)
    if match := _OUTPUTS.search(text):
        outcome.out = match.group(1)
    raised = [m for m in _RAISED.finditer(text) if m.group(2).strip() == outcome.details.strip()]
    if raised and status == "finished:failed":
        outcome.error = raised[-1].group(1).rsplit(".", 1)[-1]
    return outcome


def exit_status(outcome: Outcome) -> int:
    """The exit status for how the run ended (the same meanings as ``fedmeta simulate``)."""
    if outcome.status == "finished:completed":
        if outcome.stopped_reason == "budget_exhausted" and outcome.rounds_completed == 0:
            return exitcodes.BUDGET_EXHAUSTED
        if outcome.stopped_reason == "interrupted":
            return exitcodes.INTERRUPTED
        return exitcodes.OK
    if outcome.status in ("finished:stopped", "timeout"):
        return exitcodes.INTERRUPTED
    for names, status in _FAILURES:
        if outcome.error in names:
            return status
    return exitcodes.INTERNAL_ERROR


def report(outcome: Outcome, status: int, args: argparse.Namespace | None = None) -> None:
    """What happened and where everything is: stdout, and one line on stderr for a failure.

    Rounds *spent* (ledger) and rounds *applied* (in the saved model) are counted separately:
    after a ServerApp crash they differ (deploy_status.run_progress). Only files that exist are
    named; an unfinished run is followed by the command that resumes it.
    """
    from fedmeta.cli.deploy_status import describe_progress, resume_command, run_progress

    out = outcome.out or ""
    progress = run_progress(out, outcome.ledger)
    if outcome.rounds_completed is not None:
        print(f"run {outcome.run_id}: {outcome.status}; rounds completed "
              f"{outcome.rounds_completed}, stopped: {outcome.stopped_reason}")  # fmt: skip
    else:
        print(f"run {outcome.run_id}: {outcome.status}")
    for line in describe_progress(progress, out):
        print(line)
    where = "(on the ServerApp's host)"
    ledger = outcome.ledger or "privacy.ledger_path, else $FEDMETA_STATE_DIR/ledger.sqlite"
    print(f"ledger {where}: {ledger} (back it up with `fedmeta ledger backup`)")
    if outcome.status != "finished:completed":
        error = f"{outcome.error}: " if outcome.error else ""
        print(f"fedmeta deploy run: {error}{outcome.details or outcome.status} (exit status "
              f"{status})", file=sys.stderr)  # fmt: skip
    unfinished = status == exitcodes.INTERRUPTED or outcome.status != "finished:completed"
    # Bad input and a budget that affords no round ran nothing: there is no run to resume.
    nothing_ran = status in (exitcodes.BAD_INPUT, exitcodes.BUDGET_EXHAUSTED)
    if unfinished and args is not None and not nothing_ran:
        if progress.visible and "checkpoint.pt" not in progress.files:
            print("nothing to resume (no checkpoint was written): start a new run with the same "
                  "command; what was spent stays in the ledger", file=sys.stderr)  # fmt: skip
        else:
            print(f"continue with: {resume_command(args, out)}", file=sys.stderr)


def _register_run(sub: Any) -> None:
    p = sub.add_parser(
        "run", help="start a run on the SuperLink and wait for it; exit status = the run's outcome",
        description="Submit fedmeta's ServerApp to a SuperLink (Control API), wait for the run to "
        "finish, print where its outputs and ledger are, and exit with fedmeta's exit status: 0 "
        "ok, 1 internal error, 2 bad input, 3 budget exhausted before any round, 4 unavailable, "
        "130 interrupted or stopped.",
    )  # fmt: skip
    _add_connection_args(p, "Control API (the server host's own; never exposed)")
    p.add_argument("--config", type=Path, default=os.environ.get("FEDMETA_CONFIG") or None,
                   help="fedmeta TOML configuration, read HERE and sent with the run (default "
                   "$FEDMETA_CONFIG)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   type=key_value, help="override one key (repeatable)")  # fmt: skip
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration as TOML and exit")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print the privacy plan and exit; nothing is submitted")  # fmt: skip
    p.add_argument("--node-keys", type=Path, default=os.environ.get("FEDMETA_NODE_KEYS") or None,
                   help="[federation.node_keys] TOML (deploy/tls/make-certs.sh writes "
                   "node-keys.toml; default $FEDMETA_NODE_KEYS)")  # fmt: skip
    p.add_argument("--out", help="output directory on the ServerApp's host (default: a new one "
                   "under --runs-dir)")  # fmt: skip
    p.add_argument("--runs-dir", default=os.environ.get("FEDMETA_RUNS_DIR", "runs"),
                   help="where new output directories go (default $FEDMETA_RUNS_DIR or runs, "
                   "relative to the ServerApp's working directory)")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--timeout", type=float, default=7 * 86400.0,
                   help="stop the run after this many seconds (default 7 days)")  # fmt: skip
    p.add_argument("--poll", type=float, default=2.0, help="seconds between status checks")
    p.add_argument("--stream", action="store_true", help="show the ServerApp's log meanwhile")
    p.set_defaults(func=_handle_run)


def _handle_run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except DeployError as error:
        print(f"fedmeta deploy run: {error}", file=sys.stderr)
        return error.status


def _run(args: argparse.Namespace) -> int:
    if args.resume and not args.out:
        raise DeployError("--resume needs --out: the output directory of the run to continue",
                          exitcodes.BAD_INPUT)  # fmt: skip
    if not (args.timeout > 0 and args.poll > 0):
        raise DeployError("--timeout and --poll must be > 0 seconds", exitcodes.BAD_INPUT)
    sets, cfg = run_overrides(args)
    if args.print_config or args.dry_run:  # nothing is sent: no connection settings needed
        return _preview(cfg, args.print_config, args.dry_run)
    ca, _insecure = tls_settings(args)
    out = args.out or default_out(args.runs_dir)
    with flwr_home(args.superlink, ca) as env, tempfile.TemporaryDirectory() as tmp:
        app = write_app(Path(tmp, "app"))
        run_id = submit(env, app, run_config_file(Path(tmp, "run.toml"), sets, out, args.resume))
        print(f"run {run_id} submitted to {args.superlink}; outputs will be in {out} on the "
              "ServerApp's host", flush=True)  # fmt: skip
        remember_run(args, run_id, out)  # for `deploy status`, should this command die
        follower = _follow(env, run_id) if args.stream else None
        try:
            status, details = wait_for(env, run_id, args.timeout, args.poll)
        except KeyboardInterrupt:
            flwr(env, "stop", run_id, CONNECTION)
            status, details = "finished:stopped", "interrupted here (flwr stop sent)"
        finally:
            _stop(follower)
        outcome = read_outcome(env, run_id, status, details, out)
    outcome.ledger = outcome.ledger or cfg.privacy.ledger_path
    code = exit_status(outcome)
    report(outcome, code, args)
    return code


def remember_run(args: argparse.Namespace, run_id: str, out: str) -> None:
    """Record the run's output directory and resume command under --runs-dir (deploy_runs)."""
    from fedmeta.cli.deploy_runs import remember
    from fedmeta.cli.deploy_status import resume_command

    remember(args.runs_dir, run_id, out, resume_command(args, out))


def _preview(cfg: Any, print_config: bool, dry_run: bool) -> int:
    """``--print-config`` / ``--dry-run``: what would be sent and what it would cost."""
    from fedmeta.config_io import to_toml
    from fedmeta.simulation.dry_run import dry_run_plan

    if print_config:
        print(to_toml(cfg.to_dict()), end="")
    if dry_run:
        print(dry_run_plan(cfg))
    return exitcodes.OK


def _follow(env: Mapping[str, str], run_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([flwr_bin(), "log", run_id, CONNECTION, "--stream"], env=dict(env))


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# ------------------------------------------------------------------------------------ participant


def _register_participant(sub: Any) -> None:
    env = os.environ.get
    p = sub.add_parser(
        "participant", help="run one participant: a SuperNode and its warm worker",
        description="Run a SuperNode (fast polls, --isolation process) and fedmeta's warm worker "
        "beside it on this host's loopback. Exits when either ends (status 75: restart both).",
    )  # fmt: skip
    _add_connection_args(p, "Fleet API")
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
        print(f"fedmeta deploy worker: {error}", file=sys.stderr)
        return error.status
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
        print(f"fedmeta deploy participant: {error}", file=sys.stderr)
        return error.status
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


# ------------------------------------------------------------------------------------ node keys


def _register_keys(sub: Any) -> None:
    p = sub.add_parser(
        "register", help="register node public keys with the SuperLink (idempotent)",
        description="Register each node's public key (OpenSSH, NAME.key.pub) with a SuperLink "
        "started with --enable-supernode-auth, under the name NAME; a key already registered is "
        "reported, not an error. Uses the Control API: run it on the server host.",
    )  # fmt: skip
    _add_connection_args(p, "Control API (the server host's own)")
    p.add_argument("keys", nargs="+", type=Path, help="NAME.key.pub files, or directories of them")
    p.set_defaults(func=_handle_register)


def _public_keys(paths: Sequence[Path]) -> list[Path]:
    keys: list[Path] = []
    for path in paths:
        keys += sorted(path.glob("*.key.pub")) if path.is_dir() else [path]
    missing = [str(k) for k in keys if not k.is_file()]
    if missing or not keys:
        raise DeployError(f"no such public key file: {', '.join(missing) or paths}",
                          exitcodes.BAD_INPUT)  # fmt: skip
    return keys


def _handle_register(args: argparse.Namespace) -> int:
    try:
        ca, _insecure = tls_settings(args)
        keys = _public_keys(args.keys)
    except DeployError as error:
        print(f"fedmeta deploy register: {error}", file=sys.stderr)
        return error.status
    failed = 0
    with flwr_home(args.superlink, ca) as env:
        for key in keys:
            name = key.name.removesuffix(".pub").removesuffix(".key")
            res = flwr(env, "supernode", "register", str(key), CONNECTION, "--name", name,
                       "--format", "json")  # fmt: skip
            text = " ".join((res.stdout + res.stderr).split())
            if res.returncode == 0 and '"success": true' in text.replace("'", '"').lower():
                print(f"registered {name}")
            elif "already in use" in text.lower():
                print(f"already    {name}")
            else:
                failed += 1
                print(f"FAILED     {name}: {text[-300:]}", file=sys.stderr)
    return exitcodes.UNAVAILABLE if failed else exitcodes.OK
