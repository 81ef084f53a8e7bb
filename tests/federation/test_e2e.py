"""End to end: whole federations through the `fedmeta simulate` command and `main(config)`.

Ray starts cost 10-20 s each on 2 cores, so only one test here uses the Ray simulation engine; the
others run the same ServerApp round loop and ClientApp over the in-process grid.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmeta.config_io import load_config

REPO = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """The subprocess environment, read when called (the test's own state directory included)."""
    return {
        **os.environ,
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        # Flower's CLI starts flower-superlink and friends by name: the interpreter's bin
        # directory (a venv used without activation) comes first.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }


TINY = [
    "federation.participants=6",
    "sampling.participants_per_round=3",
    "sampling.task_rate=0.3",
    "dataset.tasks_per_participant=20",
    "dataset.validation_tasks=16",
    "dataset.test_tasks=32",
    "dataset.probe_tasks=4",
    "training.eval_every=5",
    "privacy.report_every=5",
    "output.plots=true",
]


def fedmeta(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedmeta.cli", *args],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def sets(*items: str) -> list[str]:
    out: list[str] = []
    for it in items:
        out += ["--set", it]
    return out


def privacy_epsilon_cli(rounds: int, z: float, delta: float) -> float:
    res = fedmeta(
        "privacy", "epsilon", "--participants", "6", "--participants-per-round", "3",
        "--task-rate", "0.3", "--noise-multiplier", str(z), "--rounds", str(rounds),
        "--delta", str(delta), "--json", timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return float(json.loads(res.stdout)["epsilon"])


@pytest.mark.e2e
def test_ray_federation_runs_to_budget_exhaustion(tmp_path: Path) -> None:
    """Flower's simulation engine (Ray); stops on the budget; eps = `fedmeta privacy epsilon`."""
    out = tmp_path / "run"
    res = fedmeta(
        "simulate", "--out", str(out),
        *sets(*TINY, "rounds=200", "privacy.noise_multiplier=2.0", "privacy.epsilon_budget=2.0",
              "privacy.delta=1e-5", "federation.client_num_cpus=1"),
        timeout=420,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "fedmeta federation plan" in res.stdout and "rounds affordable" in res.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped_reason"] == "budget_exhausted"
    assert 0 < s["rounds_completed"] < 200
    assert s["epsilon_spent"] <= s["epsilon_budget"] == 2.0
    assert s["epsilon_spent"] == pytest.approx(
        privacy_epsilon_cli(s["rounds_completed"], 2.0, 1e-5), rel=1e-9, abs=1e-9
    )
    assert s["rounds_completed"] == s["plan"]["rounds_affordable"]
    for name in (
        "rounds.csv",
        "epsilon_vs_round.png",
        "validation_vs_epsilon.png",
        "checkpoint.pt",
    ):
        assert (out / name).is_file(), name
    assert Path(s["ledger"]["path"]).parent == Path(os.environ["FEDMETA_STATE_DIR"])
    db = sqlite3.connect(s["ledger"]["path"])
    assert db.execute("SELECT count(*) FROM spends").fetchone()[0] == s["rounds_completed"]


def _spends(db_path: Path) -> list[tuple[str, int]]:
    if not db_path.is_file():
        return []
    try:
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        rows = con.execute("SELECT run_id, round_index FROM spends ORDER BY position").fetchall()
        con.close()
        return [(str(a), int(b)) for a, b in rows]
    except sqlite3.Error:
        return []


@pytest.mark.e2e
def test_resume_after_sigkill_spends_exactly_once_per_round(tmp_path: Path) -> None:
    out = tmp_path / "run"
    ledger = tmp_path / "ledger.sqlite"
    args = [
        "simulate", "--out", str(out),
        *sets(*TINY, "rounds=24", "privacy.noise_multiplier=1.0", "federation.backend=inprocess",
              "training.checkpoint_every=4", "output.plots=false", f"privacy.ledger_path={ledger}"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedmeta.cli", *args], cwd=REPO, env=env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    try:
        while len(_spends(ledger)) < 10 and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    killed_at = len(_spends(ledger))
    assert 10 <= killed_at < 24
    res = fedmeta("simulate", "--resume", "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    spends = _spends(ledger)
    assert len({run for run, _ in spends}) == 1
    assert sorted(i for _, i in spends) == list(range(24))  # exactly one spend per round
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds_completed"] == 24 and s["stopped_reason"] == "planned_rounds"


def _learn(tmp_path: Path, rounds: int, *extra: str) -> tuple[dict[str, object], dict[str, object]]:
    from fedmeta.simulation.simulate import main

    common = ["federation.backend=inprocess", "output.progress=false", "output.plots=false",
              f"rounds={rounds}", "dataset.test_tasks=300", "privacy.report_every=1000000",
              "training.eval_every=1000000", *extra]  # fmt: skip
    private = main(load_config(None, [*common, "privacy.epsilon_budget=8"]), out_dir=tmp_path / "p")
    public = main(load_config(None, [*common, "privacy.enabled=false"]), out_dir=tmp_path / "np")
    return private.summary, public.summary


@pytest.mark.e2e
@pytest.mark.slow
def test_private_sinusoid_learns_and_non_private_learns_more(tmp_path: Path) -> None:
    """eps = 8 over 200 rounds (the default's size, fewer rounds): post-adaptation test MSE."""
    p, n = _learn(tmp_path, 200)
    untrained = float(p["starting_metric"])  # type: ignore[arg-type]
    assert p["epsilon_spent"] <= 8.0  # type: ignore[operator]
    assert float(p["final_metric"]) < 0.75 * untrained  # type: ignore[arg-type]
    assert float(n["final_metric"]) < float(p["final_metric"])  # type: ignore[arg-type]


@pytest.mark.e2e
@pytest.mark.slow
def test_default_size_private_sinusoid(tmp_path: Path) -> None:
    """The default configuration's size (300 rounds, eps = 8)."""
    p, n = _learn(tmp_path, 300)
    assert float(p["final_metric"]) < 0.5 * float(p["starting_metric"])  # type: ignore[arg-type]
    assert float(n["final_metric"]) < float(p["final_metric"])  # type: ignore[arg-type]


@pytest.mark.e2e
@pytest.mark.slow
def test_omniglot_5way_1shot_above_chance(tmp_path: Path, shared_omniglot: Path) -> None:
    from fedmeta.simulation.simulate import main

    cfg = load_config(
        REPO / "configs" / "omniglot-5way-5of20.toml",
        [f"dataset.path={shared_omniglot}", "federation.backend=inprocess", "rounds=60",
         "dataset.tasks_per_participant=50", "sampling.task_rate=0.1", "dataset.test_tasks=200",
         "dataset.validation_tasks=20", "training.eval_every=30", "privacy.report_every=30",
         "output.progress=false"],
    )  # fmt: skip
    s = main(cfg, out_dir=tmp_path / "omni").summary
    assert s["metric"] == "accuracy"
    ci = s["final_metric_ci95"]
    assert ci[0] > 0.2, s  # chance is 20% for 5-way


def _superlink_pids() -> set[int]:
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"flower-superlink" in cmd:
                pids.add(int(d.name))
    return pids


@pytest.mark.e2e
@pytest.mark.slow
def test_flwr_run_dot(tmp_path: Path) -> None:
    """`flwr run .` runs the same apps; it exits 0 even on failure, so check the outputs."""
    import shutil
    import sys

    # In a venv used without activation (`.venv/bin/python -m pytest`) flwr sits beside python.
    beside_python = Path(sys.executable).parent / "flwr"
    flwr = str(beside_python) if beside_python.is_file() else shutil.which("flwr")
    if flwr is None:
        pytest.skip("flwr CLI not found beside the interpreter or on PATH")
    before = _superlink_pids()
    out = tmp_path / "flwr"
    overrides = "training.eval_every=2;privacy.report_every=2;dataset.test_tasks=20"
    # Read when `flwr run` starts its local SuperLink: no `uv sync` before the run.
    quiet = {**env(), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    try:
        res = subprocess.run(
            # Flower >= 1.26 takes the SuperNode count per run, not from pyproject.toml; a fresh
            # ~/.flwr simulates only 2. `num-server-rounds` is one of the app's typed keys.
            [flwr, "run", ".", "--federation-config", "num-supernodes=20",
             "--run-config", f'num-server-rounds=4 set="{overrides}" out="{out}"', "--stream"],
            cwd=REPO, env=quiet, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        for pid in _superlink_pids() - before:  # only the SuperLink this test started
            os.kill(pid, signal.SIGTERM)
    summary = out / "summary.json"
    assert summary.is_file(), f"flwr run wrote no summary:\n{(res.stdout + res.stderr)[-3000:]}"
    s = json.loads(summary.read_text())
    assert s["rounds_completed"] == 4, res.stdout[-2000:]
    log = res.stdout + res.stderr
    assert "HTTP Request" not in log, log[-2000:]  # httpx's INFO line per request
    assert "deprecated" not in log.lower(), log[-2000:]
    # Flower's DEBUG records once printed again through the root handler, and Ray's FutureWarning
    # tip; the federation is the size it was given (issue 40).
    assert "DEBUG" not in log and "FutureWarning" not in log, log[-3000:]
    assert "participants 20 (" in log and "20 simulated SuperNodes" in log, log[-3000:]
