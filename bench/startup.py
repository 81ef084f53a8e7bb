"""Start-up time of the installed ``fedmeta`` command, and what it imports.

    python bench/startup.py                      # fedmeta --version, 3 runs
    python bench/startup.py --runs 5 -- --help

Runs the installed command (beside this interpreter) ``--runs`` times and prints one JSON line: the
wall time of each run, the load average before and after, and the heaviest top-level imports of
one ``python -X importtime`` run (microseconds, cumulative). docs/benchmarks.md, "Start-up".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FEDMETA = str(Path(sys.executable).parent / "fedmeta")


def wall_times(argv: list[str], runs: int) -> list[float]:
    """Seconds of each run of ``fedmeta ARGV``, output discarded."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([FEDMETA, *argv], capture_output=True, check=False)
        times.append(round(time.perf_counter() - start, 3))
    return times


def heaviest_imports(argv: list[str], top: int = 8) -> dict[str, int]:
    """The ``top`` costliest modules a run imports (cumulative microseconds, -X importtime)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", FEDMETA, *argv],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    costs = {}
    for line in run.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line.split("|")
            # Top level only (nested ones are inside these); the header line has no number.
            if cumulative.strip().isdigit() and not name.startswith("  "):
                costs[name.strip()] = int(cumulative)
    return dict(sorted(costs.items(), key=lambda item: -item[1])[:top])


def main() -> None:
    """Print one JSON line for ``fedmeta ARGV`` (default ``--version``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("argv", nargs="*", default=["--version"])
    args = parser.parse_args()
    load_before = os.getloadavg()
    times = wall_times(args.argv, args.runs)
    print(json.dumps({
        "command": ["fedmeta", *args.argv], "seconds": times, "load_before": load_before,
        "load_after": os.getloadavg(), "cpus": os.cpu_count(),
        "heaviest_imports_us": heaviest_imports(args.argv),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
