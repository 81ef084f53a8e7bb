"""SIGINT/SIGTERM in the middle of a round: abandoned before its spend, or completed after it.

A round waiting on participants (up to ``federation.round_timeout_s``) must not hold a stop for
minutes, and a stop must never leave half a round: a spend without its release and checkpoint, or
a release without its spend. The two edges are tested in-process (the stop event the signal
handler sets) and once through a real SIGTERM to a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message

from fedmeta import protocol as P
from fedmeta.client.app import app as client_app
from fedmeta.server import release_strategy as release_mod
from fedmeta.server.app import execute
from fedmeta.simulation.local_grid import InProcessGrid

from .fakes import fake_ledger, opener
from .test_round import small

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: Long enough that a round waiting for its timeout would fail the time limits below.
SLOW_TIMEOUT = "federation.round_timeout_s=600"


def _releases(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the noisy releases (one per private round released)."""
    seen: list[int] = []
    real = release_mod.noised_sum

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(release_mod, "noised_sum", spy)
    return seen


def _silent_from(round_index: int, stop: threading.Event) -> Any:
    """Participants that stop answering at ``round_index``, and a stop that comes meanwhile."""

    def handler(msg: Message, ctx: Context) -> Any:
        if msg.metadata.message_type == P.MSG_TRAIN:
            if P.decode_gradient_request(msg.content).round_id >= round_index:
                threading.Timer(0.5, stop.set).start()  # the signal, while the round waits
                return None
        return client_app(msg, ctx)

    return handler


def test_a_stop_while_waiting_abandons_the_round_before_its_spend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases = _releases(monkeypatch)
    stop = threading.Event()
    ledger = fake_ledger(100.0, 0.1)
    cfg = small("rounds=10", SLOW_TIMEOUT, "training.checkpoint_every=100")
    grid = InProcessGrid(cfg.federation.participants, _silent_from(3, stop))
    started = time.monotonic()
    result = execute(cfg, grid, out_dir=tmp_path, echo=False, open_ledger=opener(ledger),
                     stop=stop)  # fmt: skip
    assert time.monotonic() - started < 60  # not the 600 s round timeout
    assert result.summary["stopped_reason"] == "interrupted"
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    # Rounds 0..2 spent, released and checkpointed; round 3 neither spent nor released.
    assert ckpt["next_round"] == 3 == ledger.position() == len(releases)
    assert result.summary["rounds_completed"] == 3


def test_a_stop_after_the_spend_completes_and_checkpoints_the_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases = _releases(monkeypatch)
    stop = threading.Event()
    ledger = fake_ledger(100.0, 0.1)
    real_spend = ledger.spend

    def spend(event: Any, run_id: str, round_index: int) -> Any:
        record = real_spend(event, run_id, round_index)
        if round_index == 2:
            stop.set()  # the signal lands just after the spend was recorded
        return record

    monkeypatch.setattr(ledger, "spend", spend)
    cfg = small("rounds=10", SLOW_TIMEOUT, "training.checkpoint_every=100")
    result = execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=tmp_path,
                     echo=False, open_ledger=opener(ledger), stop=stop)  # fmt: skip
    assert result.summary["stopped_reason"] == "interrupted"
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    # Round 2 was spent, so it was released, stepped and checkpointed: nothing lost on resume.
    assert ckpt["next_round"] == 3 == ledger.position() == len(releases)
    assert [o.round for o in result.outcomes] == [1, 2, 3]


_CHILD = """
import sys, threading
from pathlib import Path
from fedmeta.client.app import app as client_app
from fedmeta.config_io import load_config
from fedmeta.server import run as run_mod
from fedmeta.server.app import execute
from fedmeta.simulation.local_grid import InProcessGrid
from fedmeta.simulation.simulate import _stop_on_signals
from fedmeta import protocol as P
import time

out, silent_from = Path(sys.argv[1]), int(sys.argv[2])
cfg = load_config(None, sys.argv[3:])

def handler(msg, ctx):
    if msg.metadata.message_type == P.MSG_TRAIN:
        if P.decode_gradient_request(msg.content).round_id >= silent_from:
            print("waiting", flush=True)
            return None
    return client_app(msg, ctx)

real_finish = run_mod._finish

def finish(run, stopped):
    print(f"round over {time.monotonic()}", flush=True)  # CLOCK_MONOTONIC: one clock per machine
    return real_finish(run, stopped)

run_mod._finish = finish
stop = threading.Event()
_stop_on_signals(stop)
result = execute(cfg, InProcessGrid(cfg.federation.participants, handler), out_dir=out,
                 echo=False, stop=stop)
sys.exit(130 if result.summary["stopped_reason"] == "interrupted" else 0)
"""


def sigterm_settings(ledger: Path) -> list[str]:
    """The run the SIGTERM scenario interrupts (also timed by bench/signals.py)."""
    return ["federation.backend=inprocess", "federation.participants=4",
            "sampling.participants_per_round=2", "dataset.tasks_per_participant=20",
            "dataset.test_tasks=8", "dataset.validation_tasks=8", "output.plots=false",
            "output.progress=false", "privacy.noise_multiplier=1.0",
            "privacy.epsilon_budget=1000", "rounds=50", "training.checkpoint_every=100",
            SLOW_TIMEOUT, f"privacy.ledger_path={ledger}"]  # fmt: skip


@pytest.mark.e2e
def test_sigterm_while_a_round_waits_exits_within_seconds_with_nothing_half_done(
    tmp_path: Path,
) -> None:
    from .test_e2e import _spends

    ledger = tmp_path / "ledger.sqlite"
    sets = sigterm_settings(ledger)
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp_path / "state")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "run"), "2", *sets],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "waiting"
        time.sleep(0.5)  # inside the round's wait for replies
        signalled = time.monotonic()
        child.send_signal(signal.SIGTERM)
        line = child.stdout.readline().split()
        while line == ["waiting"]:  # one per silent participant
            line = child.stdout.readline().split()
        child.wait(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, child.stderr.read() if child.stderr else ""
    # The round ends at once (its wait breaks within 0.05 s); the exit then takes the final
    # checkpoint, the test-set evaluation and the summary: about 2 s on an idle 2-core machine
    # (the issue asks for 10 s), far more when the machine is shared, hence the looser bound.
    assert line[:2] == ["round", "over"] and float(line[2]) - signalled < 5, line
    assert took < 60, took
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert ckpt["next_round"] == summary["rounds_completed"] == len(_spends(ledger)) == 2
