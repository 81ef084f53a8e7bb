"""``fedmeta tune``: candidates trained on private data, chosen on validation, paid in the ledger.

Every trial's rounds are spent from the data's ledger, so the tuning composes with the run before
it; the choice is the best validation metric; a tuning that cannot fit is refused before any trial
in one line saying what fits (cli/fedmeta/cli/tune.py, issue 42 item 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedmeta.accounting import BudgetLedger, current_budget, epsilon
from fedmeta.cli.tune import TuneRefused, _planned_rounds, main
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.simulation.simulate import main as simulate
from fedmeta.workload import declared_identity

from .test_round import SMALL

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CANDIDATES = ["training.meta_lr=0.01", "training.meta_lr=0.001 training.inner_lr=0.02"]


def _sets(tmp: Path, budget: float = 60.0) -> list[str]:
    return [*SMALL, f"privacy.ledger_path={tmp / 'ledger.sqlite'}", "privacy.insecure_test_seed=3",
            f"privacy.epsilon_budget={budget}", "privacy.delta=1e-5"]  # fmt: skip


def _args(tmp: Path, sets: list[str], candidates: list[str], **kw: object) -> argparse.Namespace:
    base = {"config": None, "overrides": sets, "candidates": candidates, "out": tmp / "tune",
            "dry_run": False, "trials": "each", "mean_trials": None, "distribution": "poisson",
            "eta": 1.0}  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def _ledger(tmp: Path, sets: list[str]) -> BudgetLedger:
    cfg = load_config(None, sets)
    identity = declared_identity(cfg.dataset.name, cfg.seed)
    terms = current_budget(tmp / "ledger.sqlite", identity, label="sinusoid")
    assert terms is not None
    return BudgetLedger.open_readonly(tmp / "ledger.sqlite", terms.federation_id)


def test_trials_compose_with_the_run_before_and_the_best_validation_is_chosen(
    tmp_path: Path,
) -> None:
    sets = _sets(tmp_path)
    simulate(load_config(None, sets), out_dir=tmp_path / "earlier")
    with _ledger(tmp_path, sets) as ledger:
        before, spends_before = ledger.epsilon(), ledger.position()
    out = main(_args(tmp_path, sets, CANDIDATES))
    assert out["epsilon_before"] == pytest.approx(before, rel=1e-6)
    with _ledger(tmp_path, sets) as ledger:
        assert ledger.position() == spends_before + 2 * 6  # every trial's rounds, recorded
        assert ledger.epsilon() == pytest.approx(out["epsilon_after_each"], rel=1e-3)
        assert len({r.run_id for r in ledger.records()}) == 3  # the earlier run and two trials
    trials = out["trials"]
    assert [t["candidate"] for t in trials] == CANDIDATES
    best = min(trials, key=lambda t: t["validation_metric"])  # sinusoid MSE: lower is better
    assert out["chosen"] == best and "test" not in " ".join(str(k) for t in trials for k in t)
    assert out["mode"] == "each" and out["epsilon_after_random"] > 0.0
    assert (tmp_path / "tune" / "tune.json").is_file()


def test_a_tuning_that_cannot_fit_is_refused_before_any_trial(tmp_path: Path) -> None:
    one = _planned_rounds(load_config(None, [*_sets(tmp_path), CANDIDATES[0]]))
    two = _planned_rounds(load_config(None, [*_sets(tmp_path), *CANDIDATES[1].split()]))
    alone, both = epsilon([one], 1e-5), epsilon([one, two], 1e-5)
    budget = 0.5 * (alone + both)
    with pytest.raises(TuneRefused) as refused:
        main(_args(tmp_path, _sets(tmp_path, budget), CANDIDATES))
    line = str(refused.value)
    assert line.startswith("tuning refused before any trial: 2 candidates") and "\n" not in line
    assert "what fits: the first 1 of them" in line
    assert not (tmp_path / "tune").exists() and not (tmp_path / "ledger.sqlite").exists()
    # The command line: one line on stderr, the budget's exit status.
    cli = [sys.executable, "-m", "fedmeta.cli", "tune", "--out", str(tmp_path / "t"), "--trials",
           "each"]  # fmt: skip
    for s in _sets(tmp_path, budget):
        cli += ["--set", s]
    done = subprocess.run([*cli, *(a for c in CANDIDATES for a in ("--candidate", c))], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 3 and done.stderr.count("\n") == 1, done.stderr
    assert "what fits" in done.stderr


@pytest.mark.parametrize(("candidates", "match"), [
    (["training.meta_lr=0.01"], "at least 2 candidates"),
    (["training.meta_lr=0.01", "dataset.tasks_per_participant=10"], "not a key=value a candidate"),
    (["training.meta_lr=0.01", "seed=4"], "the seed and the budget are the same"),
])  # fmt: skip
def test_candidates_may_not_change_the_data_or_the_budget(
    tmp_path: Path, candidates: list[str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        main(_args(tmp_path, _sets(tmp_path), candidates))


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_reader_gone_before_the_first_line_does_not_end_the_tuning(tmp_path: Path) -> None:
    """``fedmeta tune ... | head -0``: every print meets a closed pipe, and the tuning still runs
    both trials, records them and exits 0. Without the CLI's ReaderMayLeave the first print's
    BrokenPipeError ended the tuning with status 1 and no tune.json (checked)."""
    fedmeta = str(Path(sys.executable).parent / "fedmeta")
    sets = [w for s in _sets(tmp_path) for w in ("--set", s)]
    candidates = [w for c in CANDIDATES for w in ("--candidate", c)]
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp_path / "state")}
    read, write = os.pipe()
    out = str(tmp_path / "tune")
    command = [fedmeta, "tune", *sets, *candidates, "--trials", "each", "--out", out]
    proc = subprocess.Popen(command, cwd=tmp_path, text=True, env=env, stdin=subprocess.DEVNULL,
                            stdout=write, stderr=subprocess.PIPE)  # fmt: skip
    os.close(write)
    os.close(read)  # no reader at all: the first write (or flush) meets EPIPE
    err = proc.communicate(timeout=900)[1]
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    tune = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert [t["candidate"] for t in tune["trials"]] == CANDIDATES
