"""bench/cli_latency.py's tables: docs/benchmarks.md shows what results/cli-latency.jsonl gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "cli_latency.py"


def _record(commit: str, command: str, case: str | None, median: float, load: float,
            date: str) -> dict[str, Any]:  # fmt: skip
    return {"bench": f"python bench/cli_latency.py --at {commit}", "command": command,
            "case": case, "spends": 300 if "ledger" in command else None, "seconds": [median] * 3,
            "median_s": median, "cpu_seconds": [median] * 3, "median_cpu_s": median, "runs": 3,
            "commit": commit, "machine": "x86_64, test box, 2 cores",
            "load_average_1min": [load, load], "date": date}  # fmt: skip


def _records(bench: ModuleType, commit: str, median: float, load: float, date: str) -> list[Any]:
    return [_record(commit, command, case, median, load, date) for command, case, _ in bench.CASES]


def test_the_docs_tables_are_what_the_records_give() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_check_sees_a_stale_table_and_write_mends_it(tmp_path: Path) -> None:
    bench = bench_script("cli_latency")
    records = tmp_path / "records.jsonl"
    rows = [r for c in bench.COMPARISONS for commit in (c.before, c.after)
            for r in _records(bench, commit, 0.3, 1.0 if c.quiet else 12.0, "2026-11-28T23:00")]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{bench.START}\n| an old table |\n{bench.END}\nrest\n")
    assert bench.doc_mode("check", records, doc) == 1
    assert bench.doc_mode("write", records, doc) == 0
    assert bench.doc_mode("check", records, doc) == 0
    text = doc.read_text()
    assert text.startswith(f"intro\n{bench.START}\n") and text.endswith(f"{bench.END}\nrest\n")
    assert "| `fedmeta --help` |  | 0.30 (0.30) | 0.30 (0.30) | under 0.5 s: met |" in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        bench.doc_mode("check", records, doc)


def test_a_table_takes_the_newest_record_of_its_machine_state_and_names_a_missing_one() -> None:
    bench = bench_script("cli_latency")
    old = _records(bench, "abc1234", 0.9, 1.0, "2026-11-28T10:00")
    new = _records(bench, "abc1234", 0.4, 1.5, "2026-11-28T11:00")
    loaded = _records(bench, "abc1234", 5.0, 9.0, "2026-11-28T12:00")
    picked = bench.chosen([*old, *new, *loaded], "abc1234", quiet=True)
    assert [r["median_s"] for r in picked] == [0.4] * len(bench.CASES)
    busy = bench.chosen(loaded, "abc1234", quiet=False)
    assert [r["median_s"] for r in busy] == [5.0] * len(bench.CASES)
    with pytest.raises(SystemExit, match="no quiet-machine record of `fedmeta --version`.*def5678"):
        bench.chosen(new, "def5678", quiet=True)
