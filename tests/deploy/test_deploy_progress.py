"""`fedmeta deploy run`'s account of a run: spent and applied rounds apart, only existing files
named, and the resume command (fedmeta.cli.deploy_status). The crash itself is
test_deploy_recovery.py (slow); these are the cases around it, without processes."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from fedmeta.cli.deploy_status import describe_progress, resume_command, run_progress

pytestmark = [pytest.mark.deploy, pytest.mark.unit]


def test_finished_run_counts_lost_rounds_as_spent_not_applied(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps(
        {"rounds_completed": 21, "rounds_lost_on_resume": [15, 16, 17, 18]}))  # fmt: skip
    (tmp_path / "rounds.csv").write_text("round\n")
    progress = run_progress(str(tmp_path), None)
    assert (progress.spent, progress.applied, progress.lost) == (21, 17, [15, 16, 17, 18])
    text = "\n".join(describe_progress(progress, str(tmp_path)))
    assert (
        "rounds spent (privacy cost recorded in the ledger) 21; applied to the saved model 17"
        in text
    )
    assert "rounds 15, 16, 17, 18 (4)" in text
    assert text.endswith(f"{tmp_path}: summary.json, rounds.csv")  # no checkpoint.pt: not named


def test_nothing_written_and_not_visible_are_said(tmp_path: Path) -> None:
    empty = run_progress(str(tmp_path), None)
    assert empty.visible and empty.files == [] and empty.spent is None
    assert "none yet" in describe_progress(empty, str(tmp_path))[-1]
    gone = tmp_path / "elsewhere"
    elsewhere = run_progress(str(gone), None)
    assert not elsewhere.visible
    assert describe_progress(elsewhere, str(gone)) == [
        f"outputs (on the ServerApp's host): {gone}: nothing there, or not visible from this host"
    ]


def test_resume_command_repeats_connection_config_and_overrides() -> None:
    args = argparse.Namespace(superlink="127.0.0.1:8000", insecure=False,
                              root_certificates=Path("certs/ca.crt"), config=Path("fed.toml"),
                              node_keys=Path("certs/node-keys.toml"),
                              overrides=["privacy.epsilon_budget=2.5",
                                         "dataset.name='sinusoid'"])  # fmt: skip
    cmd = shlex.split(resume_command(args, "/runs/run-1 x"))
    assert cmd == ["fedmeta", "deploy", "run", "--resume", "--out", "/runs/run-1 x", "--superlink",
                   "127.0.0.1:8000", "--root-certificates", "certs/ca.crt", "--config", "fed.toml",
                   "--node-keys", "certs/node-keys.toml", "--set", "privacy.epsilon_budget=2.5",
                   "--set", "dataset.name='sinusoid'"]  # fmt: skip
