"""Start-up pays for what it uses (issue 37): what the ``fedmeta`` command and a participant import.

``python -X importtime`` reports every module a process imports, so the installed command itself
is run, as a user runs it, and its report read. No time is asserted (timings are measured by
``bench/``-style commands and recorded in docs/benchmarks.md); only which modules load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FEDMETA = str(Path(sys.executable).parent / "fedmeta")
#: Seconds of imports a command that does not compute must not pay for (docs/benchmarks.md).
HEAVY = ("torch", "flwr", "dp_accounting", "scipy")


def imported(argv: list[str], tmp_path: Path) -> set[str]:
    """Every module ``fedmeta ARGV`` imports, read from ``-X importtime`` on its stderr."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", FEDMETA, *argv],
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=120,
    )  # fmt: skip
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in run.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "fedmeta.cli" in names, run.stderr[-2000:]  # the report was read, not an empty one
    return names


@pytest.mark.integration
@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["--help"],
        ["simulat"],  # a usage error
        ["privacy", "epsilon", "--noise-multiplier"],  # a usage error below a command
        ["simulate", "--set", "privacy.delta=2"],  # a configuration error
        ["simulate", "--config", "missing.toml"],
    ],
    ids=["version", "help", "usage-error", "sub-usage-error", "config-error", "config-missing"],
)
def test_a_command_that_computes_nothing_imports_nothing_heavy(
    argv: list[str], tmp_path: Path
) -> None:
    names = imported(argv, tmp_path)
    heavy = sorted(n for n in names if n.split(".")[0] in HEAVY)
    assert not heavy, heavy


@pytest.mark.integration
def test_the_check_sees_a_heavy_import(tmp_path: Path) -> None:
    """Negative control: a command that computes an epsilon does load dp-accounting."""
    argv = ["privacy", "epsilon", "--flat-poisson-rate", "0.01", "--noise-multiplier", "1",
            "--rounds", "10"]  # fmt: skip
    assert "dp_accounting" in imported(argv, tmp_path)


@pytest.mark.integration
def test_a_participant_loads_no_accounting_code() -> None:
    """The ClientApp, its gradient code and the warm worker, as a participant's process runs them.

    The participant's first request builds its workload (model, tasks): that is run too, since the
    workload module is where accounting was reached from.
    """
    code = (
        "import sys\n"
        "import fedmeta.client.app, fedmeta.client.gradients, fedmeta.client.worker\n"
        "import fedmeta.client.supernode\n"
        "from fedmeta.config_io import load_config\n"
        "from fedmeta.workload import build_workload\n"
        "build_workload(load_config(None, ['dataset.name=sinusoid']))\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.startswith('fedmeta.accounting') or m.split('.')[0] in\n"
        "             ('dp_accounting', 'scipy'))\n"
        "assert 'torch' in sys.modules, 'the workload was not built'\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.integration
def test_a_participant_registering_on_omniglot_data_loads_no_accounting_nor_sqlite(
    tmp_path: Path,
) -> None:
    """Issue 54: the registration sends the participant's item set (fedmeta.item_identity, on
    the floor); it used to import ``fedmeta.accounting`` and with it the ledger's SQLite."""
    import numpy as np

    white = np.random.default_rng(0).random((4, 20, 105, 105)) > 0.1  # the npz's convention
    np.savez(tmp_path / "images_background.npz", images=white[:2])
    np.savez(tmp_path / "images_evaluation.npz", images=white[2:])
    code = (
        "import sys\n"
        "from fedmeta.client.gradients import registration\n"
        "from fedmeta.client_config import client_config\n"
        "from fedmeta.config_io import load_config\n"
        "from fedmeta.protocol import RegisterRequest\n"
        f"cfg = load_config(None, ['dataset.name=omniglot', 'dataset.path={tmp_path}',\n"
        "    'dataset.split=background', 'dataset.ways=2', 'dataset.shots=1',\n"
        "    'dataset.query=1', 'dataset.tasks_per_participant=3', 'dataset.partition=even',\n"
        "    'federation.participants=1', 'sampling.participants_per_round=1'])\n"
        "request = RegisterRequest('run', client_config(cfg).model_dump_json())\n"
        "reg = registration(request, '0')\n"
        "assert reg.data_fingerprint.startswith('items-'), reg.data_fingerprint[:40]\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.startswith('fedmeta.accounting') or m in ('sqlite3', '_sqlite3'))\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "FEDMETA_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=env)
#: What ``fedmeta --version`` and ``--help`` may load of fedmeta: the dispatcher and the command
#: table, no command (fedmeta.cli.commands, bench/cli_latency.py).
DISPATCH = {"fedmeta", "fedmeta.cli", "fedmeta.cli.commands", "fedmeta.exitcodes", "fedmeta.pipes"}


def loaded(argv: list[str], tmp_path: Path) -> set[str]:
    """``sys.modules`` after ``fedmeta ARGV`` ran in a fresh interpreter (exit included)."""
    code = (
        "import json, sys\n"
        "from fedmeta.cli import main\n"
        "try:\n"
        "    main(json.loads(sys.argv[1]))\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    run = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True,
                         text=True, cwd=tmp_path, check=False, timeout=120)  # fmt: skip
    names = set(json.loads(run.stderr.splitlines()[-1]))
    assert "fedmeta.cli" in names, run.stderr[-2000:]
    return names


@pytest.mark.integration
@pytest.mark.parametrize("argv", [["--version"], ["--help"]], ids=["version", "help"])
def test_version_and_help_load_no_command(argv: list[str], tmp_path: Path) -> None:
    names = loaded(argv, tmp_path)
    heavy = sorted(n for n in names if n.split(".")[0] in HEAVY)
    ours = sorted(n for n in names if n.split(".")[0] == "fedmeta" and n not in DISPATCH)
    assert not heavy and not ours, (heavy, ours)


@pytest.mark.integration
def test_ledger_show_of_kept_epsilons_loads_no_composition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shown once (composed, kept), ``ledger show`` shows the same ledger again without
    dp-accounting or scipy, and never with torch or Flower; its first show does compose (the
    negative control)."""
    from fedmeta.accounting import BudgetLedger, GaussianRound, TwoStagePoissonScheme

    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 20.0, 1e-5) as ledger:
        for i in range(3):
            ledger.spend(GaussianRound(TwoStagePoissonScheme(20, 4, 0.5), 2.0), "run-1", i)
    argv = ["ledger", "show", "--db", str(db), "--participants"]
    assert "dp_accounting" in loaded(argv, tmp_path)  # composed, and kept
    names = loaded(argv, tmp_path)
    heavy = sorted(n for n in names if n.split(".")[0] in HEAVY)
    assert not heavy, heavy


@pytest.mark.e2e
def test_the_first_ledger_show_after_a_run_loads_no_composition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private run keeps what ``ledger show`` prints (``Ledger.keep_figures`` at the run's end),
    so the operator's first show after it composes nothing (issue 54)."""
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    run = subprocess.run(
        [sys.executable, "-m", "fedmeta.cli", "simulate", "--set", "rounds=3", "--out",
         str(tmp_path / "run"), "--set", "dataset.test_tasks=20"],
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    names = loaded(["ledger", "show", "--participants"], tmp_path)
    heavy = sorted(n for n in names if n.split(".")[0] in HEAVY)
    assert not heavy, heavy
