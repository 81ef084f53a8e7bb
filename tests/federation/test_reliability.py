"""Faults a user or an operator causes: a busy directory, a stop signal, a bad start, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fedmeta.server.report import RoundOutcome
from fedmeta.server.rundir import LOCK_NAME, RunDirectoryBusy, exclusive_run_directory
from fedmeta.server.startup import FederationError

from .fakes import fake_ledger
from .test_round import Recorder, run, small

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_one_run_per_output_directory(tmp_path: Path) -> None:
    with exclusive_run_directory(tmp_path):
        with pytest.raises(RunDirectoryBusy, match=f"pid {os.getpid()}"):
            run(small("rounds=1"), tmp_path, fake_ledger(100.0, 0.1))
    assert not (tmp_path / "checkpoint.pt").exists()
    run(small("rounds=1"), tmp_path, fake_ledger(100.0, 0.1))  # free again


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path: Path) -> None:
    code = (
        "import sys, time; from fedmeta.server.rundir import exclusive_run_directory\n"
        f"with exclusive_run_directory({str(tmp_path)!r}):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(RunDirectoryBusy, match=f"pid {holder.pid}"):
            with exclusive_run_directory(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with exclusive_run_directory(tmp_path):  # kill -9 leaves no stale lock
        assert (tmp_path / LOCK_NAME).is_file()


def test_a_failed_start_leaves_no_directory(tmp_path: Path) -> None:
    out = tmp_path / "never"
    with pytest.raises(FederationError, match="no checkpoint"):
        run(small("rounds=1"), out, fake_ledger(100.0, 0.1), resume=True)
    assert not out.exists()


class StopAfter(Recorder):
    def __init__(self, at: int, stop: threading.Event) -> None:
        super().__init__()
        self.at, self.stop = at, stop

    def round_finished(self, r: RoundOutcome) -> None:
        super().round_finished(r)
        if r.round == self.at:
            self.stop.set()  # as the SIGINT handler does, in the middle of the run


def test_a_stop_finishes_the_round_and_checkpoints_so_no_paid_round_is_lost(
    tmp_path: Path,
) -> None:
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    from .fakes import opener

    ledger, stop = fake_ledger(100.0, 0.1), threading.Event()
    cfg = small("rounds=8", "training.checkpoint_every=100")
    observer = StopAfter(3, stop)
    result = execute(cfg, InProcessGrid(6), out_dir=tmp_path, observers=[observer], echo=False,
                     open_ledger=opener(ledger), stop=stop)  # fmt: skip
    assert result.summary["stopped_reason"] == "interrupted" and result.rounds_run == 3
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["next_round"] == 3 == ledger.position()
    resumed = run(cfg, tmp_path, ledger, resume=True)
    assert resumed.summary["rounds_lost_on_resume"] == [] and resumed.rounds_run == 5
    assert [r.round_index for r in ledger.records()] == list(range(8))


def _cli(*args: str, state: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FEDMETA_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "fedmeta.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.e2e
def test_exit_statuses_and_one_line_errors(tmp_path: Path) -> None:
    quick = ["--set", "federation.backend=inprocess", "--set", "output.plots=false", "--set",
             "output.progress=false", "--set", "dataset.test_tasks=8", "--set", "rounds=2",
             "--set", "privacy.epsilon_budget=2"]  # fmt: skip
    state = tmp_path / "state"
    bad = _cli("simulate", "--out", str(tmp_path / "a"), "--set", "privacy.delta=2", state=state)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "privacy.delta" in bad.stderr
    first = _cli("simulate", "--out", str(tmp_path / "b"), *quick, state=state)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["rounds_completed"] >= 1
    # z is calibrated so that the 2 rounds spend the budget; the same data in another directory
    # is the same budget (it follows the data, not the run), which a run is not refused for: its
    # participants' data takes no part, its rounds are charged to nobody (issue 52, item 6).
    again = _cli("simulate", "--out", str(tmp_path / "c"), *quick, state=state)
    assert again.returncode == 0, again.stderr[-2000:]
    # A noise multiplier so small that not one round fits any budget: refused before it starts,
    # one line naming the fix, status 3, nothing written.
    tiny = _cli("simulate", "--out", str(tmp_path / "d"), *quick, "--set",
                "privacy.noise_multiplier=0.0001", state=state)  # fmt: skip
    assert tiny.returncode == 3, tiny.stderr[-2000:]
    assert tiny.stderr.count("\n") == 1 and "the budget affords no round" in tiny.stderr
    assert "privacy.noise_multiplier" in tiny.stderr and not (tmp_path / "d").exists()
    other = tmp_path / "other.toml"
    other.write_text("[privacy]\nepsilon_budget = 5.0\n")
    resumed = _cli("simulate", "--resume", "--out", str(tmp_path / "b"), "--config", str(other),
                   state=state)  # fmt: skip
    assert resumed.returncode == 2 and "privacy.epsilon_budget" in resumed.stderr
    assert resumed.stderr.count("\n") == 1


@pytest.mark.e2e
def test_sigterm_mid_run_exits_130_with_a_checkpoint(tmp_path: Path) -> None:
    from .test_e2e import _spends

    ledger = tmp_path / "ledger.sqlite"
    args = ["simulate", "--out", str(tmp_path / "run"), "--set", "federation.backend=inprocess",
            "--set", "privacy.noise_multiplier=1.0", "--set", "privacy.epsilon_budget=1000",
            "--set", "rounds=100000", "--set", "training.checkpoint_every=100000",
            "--set", "output.plots=false", "--set", "dataset.test_tasks=8",
            "--set", f"privacy.ledger_path={ledger}"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "fedmeta.cli", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(_spends(ledger)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before it could be stopped"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert summary["stopped_reason"] == "interrupted"
    assert ckpt["next_round"] == summary["rounds_completed"] == len(_spends(ledger)) >= 2
