"""SIGTERM in the middle of a round: seconds from the signal to the process's exit.

    python bench/signals.py --repeats 3

Each repeat starts the scenario of ``tests/federation/test_signals.py`` (a private in-process run
whose participants stop answering in round 2, with a 600 s round timeout), sends SIGTERM while the
round waits, and measures until the process has exited (status 130, the round abandoned before its
spend, final checkpoint, evaluation and summary written). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.federation.test_signals import _CHILD, sigterm_settings  # noqa: E402


def once(work: Path) -> tuple[float, float]:
    """(seconds from SIGTERM to exit, seconds from SIGTERM to the round's end) of one run."""
    sets = sigterm_settings(work / "ledger.sqlite")
    env = {**os.environ, "FEDMETA_STATE_DIR": str(work / "state")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(work / "run"), "2", *sets],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "waiting"
    time.sleep(0.5)
    signalled = time.monotonic()
    child.send_signal(signal.SIGTERM)
    line = child.stdout.readline().split()
    while line == ["waiting"]:
        line = child.stdout.readline().split()
    status = child.wait(timeout=300)
    took = time.monotonic() - signalled
    assert status == 130 and line[:2] == ["round", "over"], (status, line)
    return took, float(line[2]) - signalled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="fedmeta-signals-") as work:
            runs.append(once(Path(work)))
    exits = [r[0] for r in runs]
    print(json.dumps({
        "bench": "sigterm_mid_round", "repeats": args.repeats,
        "exit_seconds": [round(x, 2) for x in exits],
        "exit_seconds_mean": round(statistics.mean(exits), 2),
        "round_over_seconds": [round(r[1], 3) for r in runs],
        "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }))


if __name__ == "__main__":
    main()
