"""bench/paper_run.py's CPU dry run: the paper configuration for 2 rounds on small Omniglot data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "paper_run.py"


def _run(tmp_path: Path, *args: str, data: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FEDMETA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("OMNIGLOT_DIR", None)
    if data is not None:
        env["OMNIGLOT_DIR"] = str(data)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def test_the_paper_command_dry_run_writes_its_row_timing_and_run(
    tmp_path: Path, shared_omniglot: Path
) -> None:
    # The real set: the command runs as an experiment, which only data proven public may (issue
    # 39); generated strokes would be refused. Skips, with the reason, where the set is absent.
    data = shared_omniglot
    out = tmp_path / "out"
    small = ["--set", "rounds=2", "--set", "dataset.tasks_per_participant=50",
             "--set", "dataset.test_tasks=10", "--set", "dataset.validation_tasks=5"]  # fmt: skip
    done = _run(tmp_path, str(out), "--device", "cpu", *small, data=data)
    assert done.returncode == 0, done.stderr[-2000:]
    timing = json.loads((out / "timing.json").read_text())
    assert timing["rounds"] == 2 and timing["stopped_reason"] == "planned_rounds"
    assert timing["start_s"] > 0 and timing["evaluation_s"] > 0 and timing["round_median_s"] > 0
    (row,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert row["rounds_completed"] == 2 and row["final_metric"] is not None
    assert (out / "run" / "summary.json").is_file() and (out / "state").is_dir()
    # The same OUT again is refused before anything runs: a rerun takes a fresh state directory.
    again = _run(tmp_path, str(out), "--device", "cpu", *small, data=data)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1


def test_without_data_or_cuda_it_says_so_in_one_line(tmp_path: Path) -> None:
    nodata = _run(tmp_path, str(tmp_path / "out"))
    assert nodata.returncode == 2 and "OMNIGLOT_DIR" in nodata.stderr
    assert len(nodata.stderr.strip().splitlines()) == 1
    if torch.cuda.is_available():
        return
    nocuda = _run(tmp_path, str(tmp_path / "out2"), data=tmp_path)
    assert nocuda.returncode == 2 and "--device cuda" in nocuda.stderr
    assert len(nocuda.stderr.strip().splitlines()) == 1
