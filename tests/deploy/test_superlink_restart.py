"""A SuperLink restarted mid-run never hangs the run (issue 41; docs/deploy.md, "When the
SuperLink restarts mid-run").

Two layouts on this machine's loopback (TLS, node authentication, the SuperLink's state in
``--database``, two participants), each SIGTERMing the SuperLink once the ledger holds 5 of the
run's spends and starting it again on its database:

* ``fedmeta deploy local``'s: the SuperLink starts the ServerApp as its own subprocess
  (``--isolation subprocess``), so the ServerApp ends with it; the restarted SuperLink marks the
  run failed once its task's heartbeat has lapsed (Flower: 2 x 30 s);
* compose's and the multi-machine guide's: the ServerApp under ``flower-superexec``, a process of
  its own (``--isolation process``), which outlives the SuperLink; fedmeta's watch
  (server/fedmeta/server/superlink_watch.py) notices the restart and ends the run itself, with
  its checkpoint and ``summary.json``.

Checked in both: ``fedmeta deploy run`` exits 1 within the bound, with the summary (rounds spent
as the ledger holds them) and the command that resumes; nothing is spent while no ServerApp runs;
that command, as printed, runs the run to ``budget_exhausted`` with no round spent twice.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.deploy.spends import ledger_spends
from tests.deploy.test_deploy_recovery import (
    BIN,
    _alive,
    _counts,
    _descendants,
    _federation,
    _run_until_five_spends,
    _spends,
    superlink_db,
)

from fedmeta.cli.deploy_local import LocalFederation, wait_until

pytestmark = [pytest.mark.deploy, pytest.mark.e2e, pytest.mark.slow]

#: federation.superlink_timeout_s's default: the watch's bound.
WATCH_S = 30.0
#: Flower 1.41 marks a task failed once its heartbeat lapsed: HEARTBEAT_PATIENCE x 30 s.
FLOWER_HEARTBEAT_S = 60.0
#: Slack for this shared 2-core machine: the old SuperLink's exit, polls, the ServerApp's exit.
SLACK_S = 60.0


@pytest.fixture
def deploy_local(tmp_path: Path) -> Iterator[LocalFederation]:
    yield from _federation(tmp_path, database=superlink_db(tmp_path / "fed"))


@pytest.fixture
def separate_executor(tmp_path: Path) -> Iterator[LocalFederation]:
    yield from _federation(tmp_path, database=superlink_db(tmp_path / "fed"), isolation="process")


def _serverapps_below(proc: subprocess.Popen[bytes]) -> list[int]:
    return [p for p, cmd in _descendants(proc.pid).items() if "flwr-serverapp" in cmd]


def _restart_mid_run(fed: LocalFederation, isolation: str) -> tuple[Path, Path, str, float]:
    """Restart the SuperLink after 5 spends; (ledger, out, deploy run's output, seconds from the
    restarted SuperLink answering to ``deploy run``'s exit)."""
    ledger, out, run = _run_until_five_spends(fed, "restart")
    link = fed.procs[0][1]
    executor = link if isolation == "subprocess" else fed.procs[1][1]
    apps = _serverapps_below(executor)
    assert apps, "no flwr-serverapp running"
    fed.server.kill(link, signal.SIGTERM)
    link.wait(timeout=120)
    at_restart = _spends(ledger)
    fed.start_superlink(database=superlink_db(fed.work), log_name="superlink-restarted",
                        isolation=isolation)  # fmt: skip
    answering = time.monotonic()
    run.wait(timeout=FLOWER_HEARTBEAT_S + WATCH_S + 600)
    took = time.monotonic() - answering
    text = (fed.logs / "deploy-run.log").read_text()
    # The ServerApp of the old SuperLink must not live on beside the resumed run.
    wait_until(lambda: not any(_alive(p) for p in apps), 120, "the old ServerApp to exit", 0.5)
    print(
        f"deploy run exited {run.returncode}, {took:.1f} s after the restarted SuperLink "
        f"answered; spends at the restart {at_restart}, at the end {_spends(ledger)}"
    )
    assert run.returncode == 1, text
    return ledger, out, text, took


def _resume_as_printed(fed: LocalFederation, ledger: Path, out: Path, text: str) -> None:
    """The printed command ends the run at budget_exhausted; no round spent twice."""
    ((run_id, before),) = ledger_spends(ledger).items()
    spent, _applied = _counts(text)
    assert spent == len(before), text  # the summary says what the ledger holds
    resume = re.search(r"continue with: (.*)", text)
    assert resume, text
    cmd = shlex.split(resume.group(1))
    assert cmd[:4] == ["fedmeta", "deploy", "run", "--resume"], cmd
    res = subprocess.run([str(BIN / "fedmeta"), *cmd[1:], "--poll", "0.5"], env=fed.env("resume"),
                         capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    after = res.stdout + res.stderr
    assert res.returncode == 0, after
    assert "stopped: budget_exhausted" in after, after
    rounds = ledger_spends(ledger)[run_id]
    assert len(rounds) == len(set(rounds)), rounds  # no round spent twice
    assert rounds[: len(before)] == before
    total, _ = _counts(after)
    assert total == len(rounds), after


def test_superlink_restart_mid_run_under_deploy_local(deploy_local: LocalFederation) -> None:
    fed = deploy_local
    ledger, out, text, took = _restart_mid_run(fed, "subprocess")
    assert "finished:failed" in text, text
    assert took <= FLOWER_HEARTBEAT_S + SLACK_S, (took, text)
    _resume_as_printed(fed, ledger, out, text)


def test_superlink_restart_mid_run_with_the_serverapp_apart(
    separate_executor: LocalFederation,
) -> None:
    """The compose and multi-machine layout: fedmeta's watch ends the run, with its summary."""
    fed = separate_executor
    ledger, out, text, took = _restart_mid_run(fed, "process")
    assert "finished:failed" in text and "stopped: interrupted" in text, text
    assert "SuperLinkLost: the SuperLink restarted" in text, text
    assert (out / "summary.json").is_file() and (out / "checkpoint.pt").is_file()
    spent, applied = _counts(text)
    assert spent == applied, text  # the final checkpoint holds every spent round
    assert took <= WATCH_S + SLACK_S, (took, text)
    _resume_as_printed(fed, ledger, out, text)
