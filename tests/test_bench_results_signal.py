"""bench/results.py under a time limit: a signal stops the run, which is still recorded."""

from __future__ import annotations

import json
import math
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def test_a_signal_ends_the_run_after_its_round_and_it_is_recorded(tmp_path: Path) -> None:
    """A time limit's SIGINT leaves a record of what the run reached, marked interrupted."""
    out, keep = tmp_path / "r.jsonl", tmp_path / "runs"
    rounds = 200  # a progress line every 10 rounds: the signal comes early
    cmd = [sys.executable, str(REPO / "bench" / "results.py"), "sinusoid", "--epsilons",
           "--set", f"rounds={rounds}", "--set", "output.progress=true",
           "--set", "dataset.test_tasks=20", "--out", str(out), "--keep", str(keep)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        while f"/{rounds}" not in lines.get(timeout=240):  # the first progress line
            pass
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (keep / rec["run_dir"]).is_dir()  # outside the checkout: the folder's name alone
    assert rec["stopped_reason"] == "interrupted"
    assert 1 <= rec["rounds_completed"] < rounds
    assert math.isfinite(rec["final_metric"])
