"""Wall time of a documented command, repeated: mean and range, each run in a fresh state.

    python bench/commands.py --repeat 3 -- fedmeta simulate
    python bench/commands.py --repeat 3 -- fedmeta simulate --set federation.backend=ray
    python bench/commands.py --repeat 3 -- fedmeta privacy plan --epsilon 8 ...

Each run gets a fresh working directory (holding a copy of ``configs/``) and a fresh
``FEDMETA_STATE_DIR``, so a run of the main job never finds the budget spent by the one before.
``fedmeta`` is the one beside this interpreter. Prints one line per run and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _once(argv: list[str]) -> tuple[float, int, str]:
    with tempfile.TemporaryDirectory(prefix="fedmeta-bench-") as tmp:
        work = Path(tmp, "work")
        shutil.copytree(REPO / "configs", work / "configs")
        env = {**os.environ, "FEDMETA_STATE_DIR": str(Path(tmp, "state"))}
        t0 = time.perf_counter()
        res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
        return time.perf_counter() - t0, res.returncode, res.stderr[-2000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command")
    args = parser.parse_args()
    words = [w for w in args.command if w != "--"]
    if not words:
        parser.error("give the command after --")
    if words[0] == "fedmeta":
        words[0] = str(Path(sys.executable).parent / "fedmeta")
    seconds = []
    for i in range(args.repeat):
        wall, status, err = _once(words)
        print(f"run {i + 1}: {wall:.1f} s, exit {status}", flush=True)
        if status != 0:
            print(err, file=sys.stderr)
        seconds.append(wall)
    summary = {
        "command": " ".join(args.command),
        "runs": len(seconds),
        "mean_s": round(statistics.mean(seconds), 1),
        "min_s": round(min(seconds), 1),
        "max_s": round(max(seconds), 1),
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
