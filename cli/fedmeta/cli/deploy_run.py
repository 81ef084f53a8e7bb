"""``fedmeta deploy run``: submit fedmeta's ServerApp to a SuperLink, wait, exit with the outcome.

``flwr run`` exits 0 even when the ServerApp fails; this command polls the run's status (what
``flwr ls --run-id`` shows, asked in this process: control_api.py) until it finishes, then exits
with fedmeta's exit status (core/fedmeta/exitcodes.py) and prints where the outputs and the ledger
are. Every run gets its own output directory (``--runs-dir``/UTC time-random) unless ``--out``
names one, so a second run never collides with the first. What is sent: deploy_run_config.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmeta import exitcodes
from fedmeta.cli.deploy_args import add_connection_args, add_node_keys_arg, add_runs_dir_arg
from fedmeta.cli.deploy_flwr import (
    CONNECTION,
    DeployError,
    flwr,
    flwr_bin,
    flwr_home,
    json_in,
    refused,
    tls_settings,
)
from fedmeta.cli.deploy_run_config import default_out, run_config_file, run_overrides, write_app
from fedmeta.simulation.simulate import key_value

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


def register(sub: Any) -> None:
    """Add ``fedmeta deploy run``."""
    p = sub.add_parser(
        "run", help="start a run on the SuperLink and wait for it; exit status = the run's outcome",
        description="Submit fedmeta's ServerApp to a SuperLink (Control API), wait for the run to "
        "finish, print where its outputs and ledger are, and exit with fedmeta's exit status: 0 "
        "ok, 1 internal error, 2 bad input, 3 budget exhausted before any round, 4 unavailable, "
        "130 interrupted or stopped.",
    )  # fmt: skip
    add_connection_args(p, "Control API (the server host's own; never exposed)")
    p.add_argument("--config", type=Path, default=os.environ.get("FEDMETA_CONFIG") or None,
                   help="fedmeta TOML configuration, read HERE and sent with the run (default "
                   "$FEDMETA_CONFIG)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   type=key_value, help="override one key (repeatable)")  # fmt: skip
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration as TOML and exit")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print the privacy plan and exit; nothing is submitted")  # fmt: skip
    add_node_keys_arg(p, "the participant each node key is bound to, sent with the run "
                      "(deploy/tls/make-certs.sh writes node-keys.toml)")  # fmt: skip
    p.add_argument("--out", help="output directory on the ServerApp's host (default: a new one "
                   "under --runs-dir)")  # fmt: skip
    add_runs_dir_arg(p, "where new output directories go, relative to the ServerApp's "
                     "working directory")  # fmt: skip
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
        return refused("run", error)


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
