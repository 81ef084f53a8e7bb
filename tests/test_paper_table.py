"""bench/paper_table.py: DP-MAML's table from records (issue 50), and its tiny scale end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.bench_scripts import bench_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "paper_table.py"


def _record(row: str, run: int, accuracy: float, digest: str = "t1") -> dict[str, Any]:
    private = row != "a"
    return {
        "format": "fedmeta-paper-table-record-v1", "scale": "cpu", "way": 5, "row": row,
        "first_order": False, "run": run, "started": f"2026-11-28T10:0{run}:00+00:00",
        "device": "cpu box", "test_accuracy": accuracy, "starting_accuracy": 0.3,
        "epsilon_valid": 6.1 if private else None, "delta": 1e-6 if private else None,
        "epsilon_thm3": 0.5 if private else None, "epsilon_moments": 1.1 if private else None,
        "test_tasks_digest": digest, "warm_start_digest": None, "stopped_reason": "planned_rounds",
    }  # fmt: skip


@pytest.mark.unit
def test_a_row_is_the_mean_range_and_t_interval_of_its_whole_runs() -> None:
    pt = bench_script("paper_table")
    recs = [_record("b", i, acc) for i, acc in enumerate([0.90, 0.92, 0.94], 1)]
    recs.append({**_record("b", 4, 0.10), "stopped_reason": "interrupted"})  # never counted
    recs += [_record("a", i, 0.99) for i in (1, 2, 3)]
    row = pt.summarise(recs, ("cpu", 5, "b", False))
    assert row["runs"] == 3
    assert row["mean"] == pytest.approx(92.0) and (row["min"], row["max"]) == (90.0, 94.0)
    # Student t with 2 degrees of freedom: 4.303 x sd 2 / sqrt 3 = 4.97 either side.
    assert row["ci95"] == pytest.approx([92.0 - 4.968, 92.0 + 4.968], abs=1e-3)
    assert (row["epsilon_valid"], row["epsilon_thm3"], row["epsilon_moments"]) == (6.1, 0.5, 1.1)
    assert row["same_test_tasks_as_a"] and row["untrained"] == pytest.approx(30.0)
    assert row["device"] == ["cpu box"]
    # DP-MAML's number stands beside the GPU scale's row only: the CPU scale is not its setting.
    assert row["paper"] is None and pt.summarise(recs, ("gpu", 5, "b", False))["paper"] == "93.9"


@pytest.mark.unit
def test_rows_without_runs_say_unmeasured_with_their_command_and_other_tasks_are_named() -> None:
    pt = bench_script("paper_table")
    recs = [_record("a", 1, 0.99), _record("d", 1, 0.9, digest="evaluation-split")]
    text = pt.markdown(pt.table_rows(recs, ["gpu", "cpu"]))
    assert "unmeasured: `OMNIGLOT_DIR=/path/to/omniglot python bench/paper_table.py --run " \
           "--scale gpu --ways 20 --rows b --runs 3`" in text  # fmt: skip
    (d_line,) = [line for line in text.splitlines() if line.startswith("| cpu | 5 | (d)")]
    assert "other test tasks than (a)" in d_line


@pytest.mark.unit
def test_check_sees_a_table_that_differs_from_the_records(tmp_path: Path) -> None:
    pt = bench_script("paper_table")
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{pt.START}\nold table\n{pt.END}\nrest\n")
    new = pt.replace_section(doc.read_text(), f"{pt.START}\nnew\n{pt.END}", doc)
    assert new == f"intro\n{pt.START}\nnew\n{pt.END}\nrest\n"
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        pt.replace_section(doc.read_text(), "x", doc)


@pytest.mark.integration
def test_the_committed_tables_are_what_the_committed_records_give() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in subprocess.run(
        [sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, cwd=REPO,
        timeout=300, check=True).stdout.splitlines()]  # fmt: skip
    need = {"way", "row", "runs", "mean", "min", "max", "epsilon_valid", "delta", "device",
            "untrained", "epsilon_thm3", "epsilon_moments"}  # fmt: skip
    assert rows and all(need <= row.keys() for row in rows)
    assert {(r["scale"], r["way"], r["row"]) for r in rows} >= {
        (s, w, r) for s in ("gpu", "cpu") for w in (5, 20) for r in "abcd"
    }


@pytest.mark.integration
def test_tiny_scale_records_packs_resumes_unpacks(tmp_path: Path, shared_omniglot: Path) -> None:
    # The machinery at seconds' scale: one private run of row (b), its record whole, in the pack;
    # the same command again has nothing left to run; the pack files into another folder.
    env = {**os.environ, "OMNIGLOT_DIR": str(shared_omniglot),
           "FEDMETA_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    env.pop("OUT", None)
    args = [
        sys.executable,
        str(SCRIPT),
        "--run",
        "--scale",
        "tiny",
        "--ways",
        "5",
        "--rows",
        "b",
        "--runs",
        "1",
        "--records",
        str(tmp_path / "rec"),
        "--pack",
        str(tmp_path / "out"),
        "--keep",
        str(tmp_path / "runs"),
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "rec").iterdir()  # no temporary file left beside it
    rec = json.loads(path.read_text())
    assert rec["row"] == "b" and rec["noise_multiplier"] == 1.0 and rec["rounds_completed"] == 2
    assert 0 <= rec["test_accuracy"] <= 1 and len(rec["test_accuracy_ci95"]) == 2
    # Fixed lots: the valid epsilon is above Theorem 3's (which is not a bound for them).
    assert rec["epsilon_valid"] > rec["epsilon_thm3"] > 0 and rec["epsilon_moments"] > 0
    for field in (
        "config_digest",
        "commit",
        "device",
        "started",
        "ended",
        "test_tasks_digest",
        "seen_fraction",
        "held_out",
        "starting_accuracy",
        "warm_start_digest",
    ):
        assert field in rec, field
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout == "", again.stdout[-2000:]
    assert len(list((tmp_path / "rec").iterdir())) == 1
    packed = (tmp_path / "out" / "paper-table-records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in packed] == [rec]
    unpack = [
        sys.executable,
        str(SCRIPT),
        "--unpack",
        str(tmp_path / "out" / "paper-table-records.jsonl"),
        "--records",
        str(tmp_path / "b"),
    ]
    assert subprocess.run(unpack, capture_output=True, text=True, timeout=300).returncode == 0
    assert [p.name for p in (tmp_path / "b").iterdir()] == [path.name]


@pytest.mark.integration
def test_a_recorded_rows_test_tasks_are_the_ones_its_configuration_gives_today(
    shared_omniglot: Path,
) -> None:
    # Issue 50: the same configuration gives the same test tasks in every version. The committed
    # records pin the digests; the CPU scale's configuration rebuilt now must give them again.
    from fedmeta.config_io import load_config

    pt = bench_script("paper_table")
    recs = [r for r in pt.load_records() if r["scale"] == "cpu" and r["row"] in "abc"]
    if not recs:
        pytest.skip("no CPU-scale record of rows (a)-(c) committed")
    rec = recs[0]
    sets = [*pt.row_sets(pt.SCALES["cpu"], rec["row"], rec["first_order"]),
            f"dataset.path={shared_omniglot}"]  # fmt: skip
    digests = pt.digests(load_config(pt.config_of(rec["way"]), sets))
    assert digests["test_tasks_digest"] == rec["test_tasks_digest"]
    assert {r["test_tasks_digest"] for r in recs if r["way"] == rec["way"]} == {
        rec["test_tasks_digest"]
    }
