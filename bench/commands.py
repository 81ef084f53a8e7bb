"""Wall time of a documented command, repeated: mean and range, each run in a fresh state.

    python bench/commands.py --repeat 3 -- fedmeta simulate :: \
        fedmeta simulate --set federation.backend=ray
    python bench/commands.py --repeat 3 -- fedmeta privacy plan --epsilon 8 ...

Several commands, separated by ``::``, run in turn (A B A B ...), so that a change in the machine's
load falls on all of them alike.

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


def _summary(words: list[str], seconds: list[float]) -> dict[str, object]:
    return {
        "command": " ".join(["fedmeta", *words[1:]] if words[0].endswith("fedmeta") else words),
        "runs": len(seconds),
        "mean_s": round(statistics.mean(seconds), 1),
        "min_s": round(min(seconds), 1),
        "max_s": round(max(seconds), 1),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command(s)")
    args = parser.parse_args()
    words = [w for w in args.command if w != "--"]
    commands: list[list[str]] = [[]]
    for w in words:
        if w == "::":
            commands.append([])
        else:
            commands[-1].append(w)
    if not all(commands):
        parser.error("give the command(s) after --, separated by ::")
    for cmd in commands:
        if cmd[0] == "fedmeta":
            cmd[0] = str(Path(sys.executable).parent / "fedmeta")
    seconds: list[list[float]] = [[] for _ in commands]
    for i in range(args.repeat):
        for j, cmd in enumerate(commands):
            wall, status, err = _once(cmd)
            print(f"command {j + 1} run {i + 1}: {wall:.1f} s, exit {status}", flush=True)
            if status != 0:
                print(err, file=sys.stderr)
            seconds[j].append(wall)
    for cmd, secs in zip(commands, seconds, strict=True):
        print(json.dumps(_summary(cmd, secs)))
    return 0

if __name__ == "__main__":
    sys.exit(main())
