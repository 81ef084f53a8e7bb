"""A ServerApp killed mid-run: the summaries say what happened, and the printed command resumes.

A SuperLink (TLS, node authentication) and two participants on this machine's loopback
(``LocalFederation``), a private run with a checkpoint every 3 rounds; once the ledger holds at
least 5 of the run's spends, the ServerApp process (``flwr-serverapp``, the SuperLink's child) is
SIGKILLed. Checked:

* ``fedmeta deploy run`` reports the rounds *spent* (the ledger's records of the run) and the rounds
  *applied* (in the checkpoint) separately and as the ledger and checkpoint say, names only files
  that exist, and prints the command that resumes;
* that command, run as printed, finishes the run to ``budget_exhausted``; its summary counts the
  rounds spent after the last checkpoint as spent and lost (never run again);
* ``fedmeta deploy status`` shows both nodes with their keys' fingerprints bound to their
  participants, the runs, and the budget left, as the ledger says.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.deploy.spends import ledger_spends

from fedmeta.cli.deploy_local import (
    LocalFederation,
    LocalHost,
    Node,
    free_port,
    key_fingerprint,
    quick_check_sets,
    wait_until,
)

pytestmark = [pytest.mark.deploy, pytest.mark.e2e, pytest.mark.slow]

BIN = Path(sys.executable).parent
NAMES = ["participant-0", "participant-1"]


def _need_tools() -> None:
    import shutil

    for tool in ("openssl", "ssh-keygen"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (deploy/tls/make-certs.sh needs it)")


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LocalFederation]:
    yield from _federation(tmp_path, database=None)


def superlink_db(work: Path) -> Path:
    """Where the tests keep the SuperLink's state (keys, node ids, runs), so a restart keeps it."""
    return work / "state" / "superlink.db"


def start_executor(fed: LocalFederation) -> None:
    """``flower-superexec`` apart from the SuperLink, as compose's ``serverapp`` service runs it."""
    fed.start(fed.server, "superexec", [
        str(BIN / "flower-superexec"), "--root-certificates", str(fed.certs / "ca.crt"),
        "--runtime-api-address", fed.control_address,
        "--superexec-auth-secret-file", str(fed.certs / "superexec.secret"),
    ])  # fmt: skip


def _federation(
    tmp_path: Path, database: Path | None, isolation: str = "subprocess"
) -> Iterator[LocalFederation]:
    """Two participants; ``isolation="process"``: the ServerApp under its own executor."""
    _need_tools()
    fed = LocalFederation(tmp_path / "fed", LocalHost())
    try:
        fed.make_certs(NAMES)
        if database is not None:
            database.parent.mkdir(parents=True, exist_ok=True)
        fed.start_superlink(database=database, isolation=isolation)
        if isolation == "process":
            start_executor(fed)
        fed.register(NAMES)
        fed.nodes = [Node(LocalHost(), str(i), n, runtime_port=free_port())
                     for i, n in enumerate(NAMES)]  # fmt: skip
        for node in fed.nodes:
            fed.start_node(node)
        wait_until(lambda: fed.online() >= len(NAMES), 300, "2 nodes online", every=1)
        wait_until(lambda: fed.workers_ready(fed.nodes), 600, "the workers' warm-up", every=1)
        yield fed
    finally:
        fed.close()


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` -> its command line (from /proc)."""
    parents: dict[int, int] = {}
    lines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1]
                                               .split()[1])  # fmt: skip
                lines[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = lines.get(child, "")
                frontier.append(child)
    return found


def _serverapps(fed: LocalFederation) -> list[int]:
    link = fed.procs[0][1]  # start_superlink's process: the first one started
    apps = [p for p, cmd in _descendants(link.pid).items() if "flwr-serverapp" in cmd]
    assert apps, f"no flwr-serverapp below the SuperLink (pid {link.pid})"
    return apps


def _kill_serverapp(fed: LocalFederation) -> None:
    for pid in _serverapps(fed):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _counts(text: str) -> tuple[int, int]:
    match = re.search(r"rounds spent \(privacy cost recorded in the ledger\) (\d+); applied to "
                      r"the saved model (\d+)", text)  # fmt: skip
    assert match, text
    return int(match.group(1)), int(match.group(2))


def _spends(ledger: Path) -> int:
    return sum(len(v) for v in ledger_spends(ledger).values())


def _run_until_five_spends(
    fed: LocalFederation, name: str
) -> tuple[Path, Path, subprocess.Popen[Any]]:
    """A private run (checkpoint every 3 rounds) once the ledger holds 5 of its spends."""
    ledger = fed.work / "state" / "ledger.sqlite"
    out = fed.work / "runs" / name
    # 12 rounds fit (`fedmeta simulate --dry-run` with these settings; 31 at a budget of 6): 5
    # or so spent before the kill, the rest by the resumed run, each round costing seconds.
    sets = [*quick_check_sets(len(NAMES), fed.work), "privacy.epsilon_budget=4",
            "training.checkpoint_every=3"]  # fmt: skip
    run = fed.deploy_run(out, sets=sets, timeout=900)
    wait_until(lambda: _spends(ledger) >= 5, 600, "5 spends in the ledger", every=0.5)
    return ledger, out, run


def test_killed_serverapp_summary_is_truthful_and_resumes(federation: LocalFederation) -> None:
    fed = federation
    ledger, out, run = _run_until_five_spends(fed, "crash")
    apps = _serverapps(fed)
    _kill_serverapp(fed)
    wait_until(lambda: not any(_alive(p) for p in apps), 60, "the ServerApp to end", 0.2)
    # At once, while Flower still lists the run as running: `deploy status` says interrupted.
    early = _interrupted_in_status(fed, ledger, "running")
    run.wait(timeout=600)
    text = (fed.logs / "deploy-run.log").read_text()
    assert run.returncode != 0, text
    # The same command as `deploy run` printed, and again once Flower has failed the run.
    assert f"continue with: {early}" in text, text
    assert _interrupted_in_status(fed, ledger, "finished:failed") == early
    ((run_id, spent_rounds),) = ledger_spends(ledger).items()
    spent, applied = _counts(text)
    assert spent == len(spent_rounds), text  # the ledger's truth, not the rounds attempted
    assert 3 <= applied <= spent and applied % 3 == 0, text  # whole checkpoints only
    listed = re.search(rf"outputs \(on the ServerApp's host\): {re.escape(str(out))}: (.*)", text)
    assert listed, text
    for name in ("summary.json", "rounds.csv", "checkpoint.pt"):
        assert (name in listed.group(1)) == (out / name).is_file(), (name, text)
    resume = re.search(r"continue with: (.*)", text)
    assert resume, text

    # The printed command, as printed (this interpreter's fedmeta), continues the run.
    cmd = shlex.split(resume.group(1))
    assert cmd[:4] == ["fedmeta", "deploy", "run", "--resume"], cmd
    res = subprocess.run([str(BIN / "fedmeta"), *cmd[1:], "--poll", "0.5"], env=fed.env("resume"),
                         capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    after = res.stdout + res.stderr
    assert res.returncode == 0, after
    assert "stopped: budget_exhausted" in after, after
    total, applied_total = _counts(after)
    rounds = ledger_spends(ledger)[run_id]
    assert total == len(rounds) == len(set(rounds)), after  # no round spent twice
    summary = json.loads((out / "summary.json").read_text())
    lost = summary["rounds_lost_on_resume"]
    assert len(lost) == spent - applied and total - applied_total == len(lost), after

    _check_status(fed, ledger)


def _status(fed: LocalFederation, ledger: Path, *json_flag: str) -> str:
    """``fedmeta deploy status`` on the server host (deploy run's records in work/runs)."""
    res = subprocess.run(
        [str(BIN / "fedmeta"), "deploy", "status", "--superlink", fed.control_address,
         "--root-certificates", str(fed.certs / "ca.crt"), "--node-keys",
         str(fed.node_keys_file()), "--db", str(ledger), "--runs-dir", str(fed.work / "runs"),
         *json_flag],
        env=fed.env("status"), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _interrupted_in_status(fed: LocalFederation, ledger: Path, flower_says: str) -> str:
    """The one run, shown as interrupted (Flower saying ``flower_says``); its resume command."""
    status = json.loads(_status(fed, ledger, "--json"))
    ((run,),) = (status["runs"],)
    assert run["status"] == flower_says, run
    assert run["fedmeta"]["state"] == "interrupted", run
    resume = str(run["fedmeta"]["resume"])
    assert resume.startswith("fedmeta deploy run --resume --out "), run
    text = _status(fed, ledger)
    assert f"  run {run['run-id']}  interrupted (" in text and f"continue with: {resume}" in text
    return resume


def _check_status(fed: LocalFederation, ledger: Path) -> None:
    out = _status(fed, ledger, "--json")
    assert out.lstrip().startswith("{"), out  # --json: JSON only
    status = json.loads(out)
    keys = {key_fingerprint(fed.certs / "nodes" / f"{n}.key.pub"): str(i)
            for i, n in enumerate(NAMES)}  # fmt: skip
    online = {n["key"]: n["bound_to"] for n in status["nodes"] if n["status"] == "online"}
    assert online == keys, status["nodes"]
    assert len(status["runs"]) == 2, status["runs"]  # the crashed run and its resumption
    (book,) = status["budget"]["federations"]
    assert book["spends"] == _spends(ledger)
    assert 0 <= book["epsilon_left"] < book["epsilon_budget"] and book["epsilon_spent"] > 0
