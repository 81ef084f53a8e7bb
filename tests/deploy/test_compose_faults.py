"""Faults of the compose federation on podman (issue 41; docs/deploy.md): a restarted ``serverapp``
container and a restarted ``superlink`` container, mid-run.

One federation (project ``fedmeta-faults``, the base compose file, images of the session's
``podman_images`` fixture, ``up --no-build``), a small budget so that runs are short
(``privacy.epsilon_budget=4.0`` on every run: the ledger keeps the first run's budget):

* ``killed_serverapp``: ``docker compose restart serverapp`` after 2 spends of a run. The
  operator's ``docker compose exec serverapp fedmeta deploy run`` dies with the container (status
  137); ``fedmeta deploy status`` (in the restarted container) shows the run as interrupted with
  the command that resumes it.
* ``superlink_restart_mid_run``: ``docker compose restart superlink`` after 2 spends of another
  run: ``deploy run`` exits 1 within the watch's bound with the summary and the resume command
  (the ServerApp's container outlives the SuperLink: fedmeta's watch ends the run); that command,
  as printed, completes the run (its planned rounds) with no round spent twice.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator

import pytest
from tests.deploy.compose_engine import ROOT, STARTED, compose_cli, project_env, take_down

# Both tests use the module's one federation: under `pytest -n 2` one worker runs them (the
# default `--dist loadfile` of pyproject.toml keeps a file's tests together).
pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.e2e]

PROJECT = "fedmeta-faults"
BUDGET = "privacy.epsilon_budget=4.0"
PADDED = "federation.round_min_seconds=2"
#: The restarted run's planned rounds, of the 41 the budget affords (`fedmeta simulate --dry-run
#: --config deploy/compose/federation.toml`): at 2 s a round they outlast the restart (with 10,
#: the run had completed when the SuperLink went down: `podman restart` and the spends check
#: took longer than its 16 s), and the resume ends sooner than a run to budget_exhausted did.
PLANNED = 30
WATCH_S, SLACK_S = 30.0, 90.0  # federation.superlink_timeout_s; podman's restart on 2 busy cores

#: Each run's spent rounds, read in the serverapp container (the ledger volume).
SPENDS = """
import json
from fedmeta.accounting import BudgetLedger
out = {}
for fid in BudgetLedger.describe("/ledger/ledger.sqlite").federations:
    book = BudgetLedger.open_readonly("/ledger/ledger.sqlite", fid)
    for r in book.records():
        out.setdefault(r.run_id, []).append(r.round_index)
print(json.dumps(out))
"""


class Compose:
    """``docker compose -p PROJECT`` with the session's podman environment, on host ports of its
    own (``self.env``'s FEDMETA_*_PORT), so that other compose projects can run beside it.
    The project is recorded as this session's (``STARTED``): nothing of it may outlive the
    session."""

    def __init__(self, env: dict[str, str], project: str = PROJECT, *more: str) -> None:
        self.env, self.cli = project_env(env), [*compose_cli(), "-p", project, *more]
        self.project = project
        STARTED.add(project)

    def down(self) -> None:
        """Take the project down (containers, networks, volumes), checked (``take_down``)."""
        take_down(self.cli, self.env, self.project)

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.cli, *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)  # fmt: skip

    def deploy_run(self, *args: str) -> subprocess.Popen[str]:
        cmd = [*self.cli, "exec", "-T", "serverapp", "fedmeta", "deploy", "run", "--poll", "1",
               "--set", BUDGET, *args]  # fmt: skip
        return subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def spends(self) -> dict[str, list[int]]:
        res = self("exec", "-T", "serverapp", "python", "-c", SPENDS, timeout=120)
        return json.loads(res.stdout) if res.returncode == 0 and res.stdout.strip() else {}


@pytest.fixture(scope="module")
def compose(podman_images: dict[str, str]) -> Iterator[Compose]:
    dc = Compose(podman_images)
    dc.down()  # what an interrupted earlier session left of this project
    try:
        started = time.monotonic()
        up = dc("up", "-d", "--no-build", "--wait", "--wait-timeout", "840", timeout=900)
        assert up.returncode == 0, up.stdout + up.stderr
        print(f"fedmeta-faults: up and healthy in {time.monotonic() - started:.0f} s")
        yield dc
    finally:
        dc.down()


def _what_the_services_said(dc: Compose) -> str:
    """The serverapp's and superlink's log lines that tell a failed restart test's story (the
    watch's probes, restarts, warnings), read only when the test fails."""
    logs = dc("logs", "--no-color", "--timestamps", "serverapp", "superlink", timeout=120).stdout
    said = [line for line in logs.splitlines() if "fedmeta" in line or "Starting" in line
            or "WARN" in line or "ERROR" in line or "SuperLink" in line]  # fmt: skip
    return "\n".join(said[-80:])


def _until_spent(dc: Compose, before: int, more: int, run: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 900
    while sum(map(len, dc.spends().values())) < before + more:
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, "no spends"
        time.sleep(2)


def test_killed_serverapp_under_compose_shows_interrupted(compose: Compose) -> None:
    dc = compose
    run = dc.deploy_run("--set", "rounds=1000")
    _until_spent(dc, sum(map(len, dc.spends().values())), 2, run)
    assert dc("restart", "serverapp", timeout=300).returncode == 0
    text = run.communicate(timeout=300)[0]
    assert run.returncode != 0, text  # the exec'd command died with its container
    status = dc("exec", "-T", "serverapp", "fedmeta", "deploy", "status", "--json", timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    runs = json.loads(status.stdout[status.stdout.index("{") :])["runs"]
    interrupted = [r for r in runs if (r.get("fedmeta") or {}).get("state") == "interrupted"]
    assert len(interrupted) == 1, runs
    resume = interrupted[0]["fedmeta"]["resume"]
    assert resume.startswith("fedmeta deploy run --resume --out /runs/run-"), resume
    assert f"--set {BUDGET}" in resume, resume
    print(f"deploy status: run {interrupted[0]['run-id']} interrupted; {resume}")


def test_superlink_restart_mid_run_under_compose(compose: Compose) -> None:
    dc = compose
    # Rounds of at least 2 s: the restart (podman stops the container gracefully first) must land
    # mid-run; with the rounds as fast as they come, the rest of the budget was spent and the run
    # completed before the SuperLink went down.
    run = dc.deploy_run("--set", PADDED, "--set", f"rounds={PLANNED}")
    _until_spent(dc, sum(map(len, dc.spends().values())), 2, run)
    assert dc("restart", "superlink", timeout=300).returncode == 0
    back = time.monotonic()
    text = run.communicate(timeout=WATCH_S + SLACK_S + 600)[0]
    took = time.monotonic() - back
    print(f"deploy run exited {run.returncode} {took:.0f} s after `restart superlink` returned")
    assert run.returncode == 1, text + "\n--- logs ---\n" + _what_the_services_said(dc)
    assert "SuperLinkLost: the SuperLink" in text and "stopped: interrupted" in text, text
    assert took <= WATCH_S + SLACK_S, text
    out = re.search(r"outputs will be in (\S+) on the ServerApp's host", text)
    resume = re.search(r"continue with: (.*)", text)
    assert out and resume, text
    cmd = shlex.split(resume.group(1))
    res = dc("exec", "-T", "serverapp", *cmd, "--poll", "1", timeout=1800)
    after = res.stdout + res.stderr
    # planned_rounds, or budget_exhausted should the other test have spent more than 11 rounds
    stopped = re.search(r"stopped: (planned_rounds|budget_exhausted)", after)
    assert res.returncode == 0 and stopped, after
    summary = json.loads(
        dc("exec", "-T", "serverapp", "cat", f"{out.group(1)}/summary.json").stdout
    )
    rounds = dc.spends()[summary["run_id"]]
    assert len(rounds) == len(set(rounds)) == summary["rounds_completed"] <= PLANNED, (
        rounds,
        summary,
    )
