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
commit measured, machine, load average, date. No time is asserted anywhere (tests check what the
commands import: tests/test_startup.py).

The tables of docs/benchmarks.md ("Command-line latency") are made from those records, never by
hand, for the commit pairs of :data:`COMPARISONS`:

    python bench/cli_latency.py --table   # print the doc's section from results/cli-latency.jsonl
    python bench/cli_latency.py --write   # put it into docs/benchmarks.md, between its markers
    python bench/cli_latency.py --check   # exit 1 when the doc's section is not what they give
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
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FEDMETA = str(Path(sys.executable).parent / "fedmeta")
RECORDS = REPO / "results" / "cli-latency.jsonl"
DOC = REPO / "docs" / "benchmarks.md"
START = "<!-- cli-latency:start (python bench/cli_latency.py --write) -->"
END = "<!-- cli-latency:end -->"
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


# ------------------------------------------------------------------ the doc's tables, from records

#: A case's 1-minute load average at its start below this: a quiet machine (the reference).
QUIET_LOAD = 2.0
#: Issue 54's targets: wall seconds each command should stay under on the development machine.
TARGETS = {"fedmeta --version": 0.5, "fedmeta --help": 0.5, "fedmeta ledger show": 1.0}
#: The cases of a table, in order: (command, case as recorded, case as the doc names it).
CASES = (
    ("fedmeta --version", None, ""),
    ("fedmeta --help", None, ""),
    ("fedmeta ledger show", "no kept epsilons (composes)",
     "first show after new spends (composes)"),
    ("fedmeta ledger show", "kept epsilons (same records again)",
     "the same records again (kept epsilons: a show after a run)"),
)  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    """One table of the doc: the code before and after, measured on a quiet or a loaded machine."""

    title: str
    before: str  # commit
    after: str  # commit
    quiet: bool  # records whose load at a case's start is below QUIET_LOAD (else at or above)


COMPARISONS = (
    Comparison("Quiet machine: the reference", "b8d5782", "30fc8d6", quiet=True),
    Comparison("Loaded machine (other engineers' test runs): an earlier measurement, pessimistic",
               "b8d5782", "fdaec94", quiet=False),
)  # fmt: skip


def load_records(path: Path = RECORDS) -> list[dict[str, Any]]:
    """Every record of ``path`` (JSON lines), in the order they were appended."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chosen(records: Sequence[dict[str, Any]], commit: str, quiet: bool) -> list[dict[str, Any]]:
    """The records of ``commit`` on a quiet (or loaded) machine, one per case of :data:`CASES`.

    Where a case was measured more than once in that state, the newest record stands.
    """
    out = []
    for command, case, _ in CASES:
        found = [r for r in records if r["commit"] == commit and r["command"] == command
                 and r["case"] == case and (r["load_average_1min"][0] < QUIET_LOAD) == quiet]
        if not found:
            state = "quiet" if quiet else "loaded"
            raise SystemExit(f"cli_latency: no {state}-machine record of `{command}` "
                             f"({case or 'no case'}) at commit {commit} in {RECORDS.name}")
        out.append(max(found, key=lambda r: r["date"]))  # ISO dates: text order is time order
    return out


def _cell(record: dict[str, Any]) -> str:
    return f"{record['median_s']:.2f} ({record['median_cpu_s']:.2f})"


def _target(command: str, after: dict[str, Any]) -> str:
    limit = TARGETS[command]
    return f"under {limit:g} s: {'met' if after['median_s'] < limit else 'not met'}"


def _caption(
    comparison: Comparison, before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]
) -> str:
    """Where the table's numbers come from: commits, commands, dates, load, machine, runs."""
    records = [*before, *after]
    dates = sorted(r["date"] for r in records)
    loads = [load for r in records for load in r["load_average_1min"]]
    machines = sorted({r["machine"] for r in records})
    runs = sorted({r["runs"] for r in records})
    spends = sorted({r["spends"] for r in records if r["spends"] is not None})

    def commands(chosen: Sequence[dict[str, Any]]) -> str:
        return " and ".join(f"`{b}`" for b in sorted({r["bench"] for r in chosen}))

    text = (
        f"**{comparison.title}.** Before: commit {comparison.before}, {commands(before)}; after: "
        f"commit {comparison.after}, {commands(after)}. Taken {dates[0][:16].replace('T', ' ')} "
        f"to {dates[-1][11:16]} UTC at load average (1 min) {min(loads):g} to {max(loads):g}, on "
        f"{'; '.join(machines)}; {' or '.join(map(str, runs))} runs a case, each a fresh process, "
        f"median; the ledger shown holds {' or '.join(map(str, spends))} spends."
    )
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def table(comparison: Comparison, records: Sequence[dict[str, Any]]) -> str:
    """One comparison's caption and markdown table: median wall (CPU) seconds, and the target."""
    before = chosen(records, comparison.before, comparison.quiet)
    after = chosen(records, comparison.after, comparison.quiet)
    lines = [
        _caption(comparison, before, after), "",
        f"| command | case | before ({comparison.before}): median wall s (CPU s) | after "
        f"({comparison.after}): median wall s (CPU s) | issue 54's target (wall, after) |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for (command, _, label), old, new in zip(CASES, before, after, strict=True):
        lines.append(f"| `{command}` | {label} | {_cell(old)} | {_cell(new)} | "
                     f"{_target(command, new)} |")  # fmt: skip
    return "\n".join(lines)


def section(records: Sequence[dict[str, Any]]) -> str:
    """The doc's generated section, markers included."""
    tables = "\n\n".join(table(c, records) for c in COMPARISONS)
    return f"{START}\n{tables}\n{END}"


def with_section(text: str, generated: str, path: Path) -> str:
    """``text`` with its section between the markers replaced by ``generated``."""
    if START not in text or END not in text:
        raise SystemExit(f"cli_latency: {path} has no {START} ... {END} markers: add them")
    before, rest = text.split(START, 1)
    return before + generated + rest.split(END, 1)[1]


def doc_mode(mode: str, records_path: Path, doc: Path) -> int:
    """``--table`` (print), ``--write`` (into ``doc``) or ``--check`` (exit 1 when it differs)."""
    generated = section(load_records(records_path))
    if mode == "table":
        print(generated)
        return 0
    text = doc.read_text()
    new = with_section(text, generated, doc)
    if mode == "write":
        doc.write_text(new)
        return 0
    if new != text:
        print(f"cli_latency: the latency tables in {doc} are not what {records_path} gives: run "
              "python bench/cli_latency.py --write", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per case (>= 3; median)")
    parser.add_argument("--spends", type=int, default=300, help="rounds in the ledger shown")
    parser.add_argument("--at", help="measure the code of this commit instead of the checkout")
    parser.add_argument("--out", type=Path, help="append the JSON records to this file")
    docs = parser.add_mutually_exclusive_group()
    for mode, what in (("table", "print the doc's tables from the records; measure nothing"),
                       ("write", "write them into the doc, between its markers"),
                       ("check", "exit 1 when the doc's tables are not what the records give")):
        docs.add_argument(f"--{mode}", dest="doc_mode", action="store_const", const=mode,
                          help=what)  # fmt: skip
    parser.add_argument("--records", type=Path, default=RECORDS, help="the records (JSON lines)")
    parser.add_argument("--doc", type=Path, default=DOC, help="the doc holding the tables")
    args = parser.parse_args(argv)
    if args.doc_mode is not None:
        return doc_mode(args.doc_mode, args.records, args.doc)
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
