"""Wall time of the commands typed most: ``fedmeta --version``, ``--help`` and ``ledger show``.

    python bench/cli_latency.py                                  # this checkout, 5 runs each
    python bench/cli_latency.py --at b8d5782 --runs 5            # the code of another commit
    python bench/cli_latency.py --out results/cli-latency.jsonl  # and append the records there

Runs the installed ``fedmeta`` (beside this interpreter) ``--runs`` times per case, each in a fresh
process, output discarded, and takes the median. ``ledger show`` reads a ledger of ``--spends``
two-stage rounds, written first by the same code: once with no kept epsilons (each run starts
from an empty ``$FEDMETA_CACHE_DIR``, so it composes: the first show after new spends) and once
with the epsilons an earlier show kept (the same records shown again). ``--at REV`` measures the
code of commit REV instead (``git archive`` into a temporary folder put first on ``PYTHONPATH``;
every fedmeta package is a regular package, so the archived ones are the ones imported).

Prints a markdown table; with ``--out``, appends one JSON record per case: this script's command
line, the command measured, case, the wall and CPU seconds of every run and their medians, the
commit measured, machine, load average, date
(docs/benchmarks.md, "Command-line latency"). No time is asserted anywhere (tests check what the
commands import: tests/test_startup.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FEDMETA = str(Path(sys.executable).parent / "fedmeta")
#: The source roots of a checkout (pyproject.toml's [tool.hatch] dev-mode-dirs).
ROOTS = ("core", "cli", "accounting", "metalearning", "server", "client", "simulation", "deploy")

#: The ledger's rounds: two-stage Poisson, the default main job's sampling (written by the code
#: measured, through its public accounting API).
WRITE_LEDGER = """
import sys
from fedmeta.accounting import BudgetLedger, GaussianRound, TwoStagePoissonScheme
event = GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 1.0)
with BudgetLedger.open(sys.argv[1], "bench", 50.0, 1e-5) as ledger:
    for i in range(int(sys.argv[2])):
        ledger.spend(event, "bench-run", i)
"""


def times(
    argv: list[str], env: dict[str, str], runs: int, before: list[str] | None
) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds (user + system) of each run of ``fedmeta ARGV``; ``before`` (a
    command) runs first, untimed. CPU time is what a loaded machine's wall time hides least."""
    wall, cpu = [], []
    for _ in range(runs):
        if before is not None:
            subprocess.run(before, env=env, check=True)
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([FEDMETA, *argv], env=env, capture_output=True, check=False)
        wall.append(round(time.perf_counter() - start, 3))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(round(after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime, 3))
        if done.returncode != 0:
            raise SystemExit(f"fedmeta {' '.join(argv)} failed: {done.stderr.decode()[-2000:]}")
    return wall, cpu


def commit(at: str | None) -> str:
    """The commit measured: ``--at``'s, or this checkout's (``+changes`` if it has uncommitted
    changes to tracked files)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    if at is not None:
        return git("rev-parse", "--short", at)
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")


def machine() -> str:
    """Architecture, CPU model and usable cores (no accelerator is used)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text(
        ).splitlines() if line.startswith("model name")), platform.processor())  # fmt: skip
    return f"{platform.machine()}, {model}, {len(os.sched_getaffinity(0))} cores"


def environment(work: Path, at: str | None) -> dict[str, str]:
    """Fresh state and cache directories; with ``at``, that commit's sources first on the path."""
    env = {**os.environ, "FEDMETA_STATE_DIR": str(work / "state"),
           "FEDMETA_CACHE_DIR": str(work / "cache")}  # fmt: skip
    if at is not None:
        tree = work / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", "archive", at, *ROOTS], cwd=REPO, capture_output=True,
                                 check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        env["PYTHONPATH"] = os.pathsep.join(str(tree / root) for root in ROOTS)
    return env


def measure(args: argparse.Namespace, work: Path) -> list[dict[str, object]]:
    env = environment(work, args.at)
    db = str(work / "ledger.sqlite")
    subprocess.run([sys.executable, "-c", WRITE_LEDGER, db, str(args.spends)], env=env, check=True)
    forget = [sys.executable, "-c", f"import shutil; shutil.rmtree({str(work / 'cache')!r}, True)"]
    show = ["ledger", "show", "--db", db]
    cases = [
        (["--version"], "", None),
        (["--help"], "", None),
        (show, "no kept epsilons (composes)", forget),
        # The last run of the case above kept its epsilons: these runs find them.
        (show, "kept epsilons (same records again)", None),
    ]
    records = []
    for argv, case, before in cases:
        load = os.getloadavg()[0]
        seconds, cpu = times(argv, env, args.runs, before)
        records.append({
            "bench": " ".join(["python", "bench/cli_latency.py", *sys.argv[1:]]),
            "command": " ".join(["fedmeta", *(argv if argv != show else show[:2])]),
            "case": case or None, "spends": args.spends if argv == show else None,
            "seconds": seconds, "median_s": round(statistics.median(seconds), 3),
            "cpu_seconds": cpu, "median_cpu_s": round(statistics.median(cpu), 3),
            "runs": args.runs, "commit": commit(args.at), "machine": machine(),
            "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
            "date": datetime.now(UTC).isoformat(timespec="minutes"),
        })  # fmt: skip
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per case (>= 3; median)")
    parser.add_argument("--spends", type=int, default=300, help="rounds in the ledger shown")
    parser.add_argument("--at", help="measure the code of this commit instead of the checkout")
    parser.add_argument("--out", type=Path, help="append the JSON records to this file")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be >= 3 (the median of fewer says little)")
    work = Path(tempfile.mkdtemp(prefix="fedmeta-cli-latency-"))
    try:
        records = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| command | case | median s | runs (s) | median CPU s | load (start, end) |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| `{r['command']}` | {r['case'] or ''} | {r['median_s']} | "
              f"{', '.join(map(str, r['seconds']))} | {r['median_cpu_s']} | "
              f"{r['load_average_1min']} |")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as sink:
            for r in records:
                sink.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
