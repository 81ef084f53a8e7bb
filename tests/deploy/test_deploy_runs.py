"""What `deploy run` records and `deploy status` reads back (cli/fedmeta/cli/deploy_runs.py).

The output directory's lock is held here by a real ``flock`` (as a run's ServerApp holds it,
server/fedmeta/server/rundir.py), and Flower's run rows are the JSON of ``flwr ls``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fedmeta.cli import deploy_runs as dr
from fedmeta.server.rundir import LOCK_NAME, exclusive_run_directory

pytestmark = pytest.mark.unit


def _row(status: str, running_at: float | None = None) -> dict[str, Any]:
    when = datetime.fromtimestamp(running_at or time.time() - 60, UTC)
    return {"run-id": "42", "status": status, "running-at": when.strftime("%Y-%m-%d %H:%M:%SZ")}


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    """A run directory whose ServerApp took its lock (then ended: the lock is free)."""
    directory = tmp_path / "runs" / "run-1"
    with exclusive_run_directory(directory):
        (directory / "checkpoint.pt").write_bytes(b"x")
    yield directory


def test_the_lock_name_is_the_run_directorys() -> None:
    assert dr.LOCK_NAME == LOCK_NAME


def test_a_record_comes_back_and_an_unwritable_one_costs_nothing(tmp_path: Path) -> None:
    assert dr.remember(tmp_path, "42", "/runs/x", "fedmeta deploy run --resume --out /runs/x")
    record = dr.recall(tmp_path, "42")
    assert record is not None and record["out"] == "/runs/x" and "--resume" in record["resume"]
    assert dr.recall(tmp_path, "43") is None and dr.recall(None, "42") is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert dr.remember(blocker, "42", "/runs/x", "cmd") is None  # a file where the dir should be


def test_running_without_its_serverapp_is_interrupted(out: Path) -> None:
    why = dr.interrupted_because(_row("running"), out)
    assert why is not None and "no ServerApp holds" in why


def test_running_with_its_serverapp_is_running(out: Path) -> None:
    fd = os.open(out / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert dr.interrupted_because(_row("running"), out) is None
        assert dr.interrupted_because(_row("finished:failed"), out) is None  # resumed, in progress
    finally:
        os.close(fd)


def test_a_run_whose_serverapp_has_not_started_yet_is_not_interrupted(out: Path) -> None:
    # The lock was last taken before this run started: a resume whose ServerApp is starting.
    assert dr.interrupted_because(_row("running", running_at=time.time() + 60), out) is None


def test_failed_runs_with_a_checkpoint_and_no_finished_summary_are_interrupted(out: Path) -> None:
    assert dr.interrupted_because(_row("finished:failed"), out)
    assert dr.interrupted_because(_row("finished:stopped"), out)
    (out / "summary.json").write_text(json.dumps({"stopped_reason": "interrupted"}))
    assert dr.interrupted_because(_row("finished:failed"), out)  # SuperLinkLost
    assert dr.interrupted_because(_row("finished:completed"), out)  # stopped, then completed
    (out / "summary.json").write_text(json.dumps({"stopped_reason": "budget_exhausted"}))
    assert dr.interrupted_because(_row("finished:failed"), out) is None  # resumed to its end
    assert dr.interrupted_because(_row("finished:completed"), out) is None


def test_nothing_to_say_without_the_directory_or_a_checkpoint(out: Path, tmp_path: Path) -> None:
    assert dr.interrupted_because(_row("running"), tmp_path / "elsewhere") is None
    (out / "checkpoint.pt").unlink()
    assert dr.interrupted_because(_row("finished:failed"), out) is None


def test_annotate_marks_only_recorded_runs(out: Path, tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    dr.remember(runs_dir, "42", str(out), "fedmeta deploy run --resume --out X")
    rows = dr.annotate([_row("running"), {**_row("running"), "run-id": "7"}], runs_dir)
    assert rows[0]["fedmeta"]["state"] == "interrupted"
    assert rows[0]["fedmeta"]["resume"] == "fedmeta deploy run --resume --out X"
    assert "fedmeta" not in rows[1]
