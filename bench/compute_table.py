"""Turn ``bench/compute.py --json`` lines into the Markdown table of ``docs/benchmarks.md``.

    python bench/compute.py --json --min-time 1 > grid.jsonl
    python bench/compute_table.py grid.jsonl

One row per configuration (way, queries, inner steps, order, batch): tasks/s and peak extra memory
of every method measured, and fedmeta's speed over the fastest reference (every method that is not
a ``fedmeta`` variant). The last line counts the rows where fedmeta is at least as fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

Key = tuple[int, int, int, str, int]


def load(path: Path) -> dict[Key, dict[str, dict[str, Any]]]:
    """Read JSON lines (non-JSON lines, such as warnings, are skipped) grouped by configuration."""
    rows: dict[Key, dict[str, dict[str, Any]]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        key = (r["n_way"], r["q_query"], r["inner_steps"], r["order"], r["batch"])
        rows[key][r["method"]] = r
    return rows


def table(rows: dict[Key, dict[str, dict[str, Any]]]) -> str:
    """The Markdown table, with a closing summary line."""
    methods = sorted({m for by in rows.values() for m in by}, key=lambda m: (m != "fedmeta", m))
    refs = [m for m in methods if not m.startswith("fedmeta")]
    head = (
        ["way", "q/class", "steps", "order", "batch"]
        + [f"{m} tasks/s" for m in methods]
        + ["fedmeta / fastest reference"]
        + [f"{m} peak MiB" for m in methods]
        + ["load avg (1 min)"]
    )
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    wins = total = 0
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[3] != "first", k[4])):
        by = rows[key]
        speed = {m: by[m]["tasks_per_s"] for m in methods if m in by}
        best_ref = max((speed[m] for m in refs if m in speed), default=None)
        ratio = speed["fedmeta"] / best_ref if best_ref and "fedmeta" in speed else None
        if ratio is not None:
            total += 1
            wins += ratio >= 1.0
        loads = [by[m]["loadavg"][0] for m in by]
        cells = [str(k) for k in key]
        cells += [f"{speed[m]:.2f}" if m in speed else "-" for m in methods]
        cells.append(
            f"**{ratio:.2f}**"
            if ratio is not None and ratio >= 1
            else f"{ratio:.2f}"
            if ratio is not None
            else "-"
        )
        cells += [f"{by[m]['peak_mem_mib']:.0f}" if m in by else "-" for m in methods]
        cells.append(f"{min(loads):.2f}-{max(loads):.2f}")
        out.append("| " + " | ".join(cells) + " |")
    ratios = [
        rows[k]["fedmeta"]["tasks_per_s"]
        / max(rows[k][m]["tasks_per_s"] for m in refs if m in rows[k])
        for k in rows
        if "fedmeta" in rows[k] and any(m in rows[k] for m in refs)
    ]
    if ratios:
        out.append("")
        out.append(
            f"fedmeta is at least as fast as the fastest reference in {wins} of {total} rows; "
            f"fedmeta / fastest reference ranges {min(ratios):.2f}-{max(ratios):.2f}."
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl", type=Path, help="output of bench/compute.py --json")
    a = ap.parse_args(argv)
    rows = load(a.jsonl)
    if not rows:
        print(f"no JSON lines in {a.jsonl}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
