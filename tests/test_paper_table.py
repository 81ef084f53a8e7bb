"""bench/paper_table.py: DP-MAML's table from records (issue 50), and its tiny scale end to end."""

from __future__ import annotations

import json
import os
import sqlite3
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


def _batch(name: str, n: int, wall: float, run_wall: float, row: str = "a") -> list[Any]:
    fields = {"side_by_side": n, "batch": name, "batch_wall_s": wall, "wall_s": run_wall,
              "batch_runs_wall_sum_s": n * run_wall, "batch_whole_runs": n}  # fmt: skip
    return [{**_record(row, i, 0.9), **fields} for i in range(1, n + 1)]


@pytest.mark.unit
def test_throughput_is_runs_an_hour_by_side_by_side_against_one_at_a_time() -> None:
    pt = bench_script("paper_table")
    alone = _batch("x1", 1, 100.0, 100.0) + _batch("x2", 1, 100.0, 100.0)  # 36 runs an hour
    three = _batch("y", 3, 120.0, 110.0)  # 90 runs an hour
    cut = _batch("z", 3, 50.0, 50.0)
    cut[0]["stopped_reason"] = "interrupted"  # a batch with a cut run is not a throughput
    old = [_record("a", 9, 0.9)]  # before side by side: no batch figures, left out
    rows = {r["side_by_side"]: r for r in pt.throughput(alone + three + cut + old)}
    assert rows[1]["runs_per_hour"] == pytest.approx(36.0) and rows[1]["batches"] == 2
    assert rows[3]["runs_per_hour"] == pytest.approx(90.0) and rows[3]["runs"] == 3
    assert rows[3]["speedup_vs_one"] == pytest.approx(2.5) and rows[1]["speedup_vs_one"] == 1.0
    assert rows[3]["overlap"] == pytest.approx(330 / 120, abs=1e-3)
    # Another row or device is not "one at a time" for this one.
    other = pt.throughput(_batch("w", 3, 120.0, 110.0, row="c") + alone)
    assert next(r for r in other if r["row"] == "c")["speedup_vs_one"] is None


@pytest.mark.unit
def test_unpack_files_a_runs_later_line_and_keeps_a_conflicting_record(tmp_path: Path) -> None:
    pt = bench_script("paper_table")
    first = {**_record("a", 1, 0.9), "format": pt.FORMAT, "side_by_side": 2}
    later = {**first, "batch_wall_s": 10.0}
    pack = tmp_path / "pack.jsonl"
    pack.write_text(json.dumps(first) + "\n" + json.dumps(later) + "\n" + '{"cut')
    assert pt.unpack([pack], tmp_path / "rec") == 1
    (path,) = (tmp_path / "rec").iterdir()
    assert json.loads(path.read_text()) == later
    pt.write_atomically(path, first)  # filed before the batch ended: the later line completes it
    assert pt.unpack([pack], tmp_path / "rec") == 1 and json.loads(path.read_text()) == later
    pt.write_atomically(path, {**first, "test_accuracy": 0.5})  # another run's: kept
    assert pt.unpack([pack], tmp_path / "rec") == 0
    assert json.loads(path.read_text())["test_accuracy"] == 0.5


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
    sets = [*pt.row_sets(pt.SCALES["cpu"], rec["row"], rec["first_order"], rec["way"]),
            f"dataset.path={shared_omniglot}"]  # fmt: skip
    digests = pt.digests(load_config(pt.config_of(rec["way"]), sets))
    assert digests["test_tasks_digest"] == rec["test_tasks_digest"]
    assert {r["test_tasks_digest"] for r in recs if r["way"] == rec["way"]} == {
        rec["test_tasks_digest"]
    }


def _tiny_command(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--run", "--scale", "tiny", "--ways", "5", "--rows", "b",
            "--runs", "2", "--records", str(tmp_path / "rec"), "--pack", str(tmp_path / "out"),
            "--keep", str(tmp_path / "runs"), *extra]  # fmt: skip


@pytest.mark.integration
def test_side_by_side_runs_stop_together_and_resume_with_their_own_ledgers(
    tmp_path: Path, shared_omniglot: Path
) -> None:
    # Issue 51: two runs of row (b) at once, each a process with its own state directory, ledger
    # and noise. A SIGINT to the command stops both (each recorded as interrupted, neither
    # counted); the same command again completes the row side by side; a third runs nothing.
    import signal
    import time

    from fedmeta.accounting import BudgetLedger

    env = {**os.environ, "OMNIGLOT_DIR": str(shared_omniglot),
           "FEDMETA_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    env.pop("OUT", None)
    args = _tiny_command(tmp_path, "--side-by-side", "2")
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("runs/*/child.err"))) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline, "the side-by-side runs did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    cut = [json.loads(p.read_text()) for p in sorted((tmp_path / "rec").iterdir())]
    assert len(cut) == 2 and all(r["stopped_reason"] == "interrupted" for r in cut), err[-3000:]
    assert all(r["side_by_side"] == 2 and r["batch_whole_runs"] == 0 for r in cut)
    # neither counted:
    assert not bench_script("paper_table").whole_runs(cut, ("tiny", 5, "b", False))

    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(p.read_text()) for p in sorted((tmp_path / "rec").iterdir())]
    whole = bench_script("paper_table").whole_runs(recs, ("tiny", 5, "b", False))
    assert sorted(r["run"] for r in whole) == [1, 2] and len(recs) == 4
    one, two = whole
    assert one.keys() == two.keys()  # records of equal shape
    assert one["side_by_side"] == two["side_by_side"] == 2 and one["batch"] == two["batch"]
    assert one["batch_whole_runs"] == 2 and one["batch_runs_per_hour"] > 0
    assert one["batch_runs_wall_sum_s"] == pytest.approx(one["wall_s"] + two["wall_s"], abs=0.2)
    # The public seed, so the test tasks, is the row's; everything private is each run's own.
    assert one["test_tasks_digest"] == two["test_tasks_digest"]
    assert one["run_dir"] != two["run_dir"]
    ledgers = [tmp_path / "runs" / r["run_dir"] / "state" / "experiments" / "dpmaml-5way-b.sqlite"
               for r in (one, two)]  # fmt: skip
    assert len({BudgetLedger.describe(p).ledger_id for p in ledgers}) == 2
    # Each a fresh budget: a ledger holds its own run's two rounds, and both spent the same epsilon
    # (one run's), as runs one after another do.
    for path, rec in zip(ledgers, (one, two), strict=True):
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            spends = conn.execute("SELECT count(*) FROM spends").fetchone()[0]
        finally:
            conn.close()
        assert spends == rec["rounds_completed"] == 2
    assert one["epsilon_valid"] == pytest.approx(two["epsilon_valid"])
    # Their own noise: the adaptive clip follows a noisy count, so its released values differ.
    clips = [(tmp_path / "runs" / r["run_dir"]).glob("run-*/rounds.csv") for r in (one, two)]
    assert len({next(c).read_text().splitlines()[-1].split(",")[-1] for c in clips}) == 2

    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout == "", again.stdout[-2000:]
    # The table does not depend on how the runs ran.
    pt = bench_script("paper_table")
    bare = [{k: v for k, v in r.items() if not k.startswith(("batch", "side_by_side"))}
            for r in recs]  # fmt: skip
    assert pt.markdown(pt.table_rows(recs, ["tiny"])) == pt.markdown(pt.table_rows(bare, ["tiny"]))
    # The pack holds each run as it ended and again with its batch's figures: the later is filed.
    unpack = [sys.executable, str(SCRIPT), "--unpack", str(tmp_path / "out" / pt.PACK_NAME),
              "--records", str(tmp_path / "filed")]  # fmt: skip
    assert subprocess.run(unpack, capture_output=True, text=True, timeout=300).returncode == 0
    filed = {p.name: json.loads(p.read_text()) for p in (tmp_path / "filed").iterdir()}
    assert filed == {p.name: json.loads(p.read_text()) for p in (tmp_path / "rec").iterdir()}


@pytest.mark.integration
def test_the_gpu_window_runs_the_table_three_side_by_side(tmp_path: Path) -> None:
    # bench/gpu_window.sh's dry run prints the table's command (issue 51: three runs of a row at
    # once on the lent GPU); without the Omniglot npz it says so and skips the table.
    env = {**os.environ, "GPU_WINDOW_DRY": "1", "OUT": str(tmp_path / "out"),
           "GPU_WINDOW_STATE": str(tmp_path / "st"), "PYTHON": sys.executable}  # fmt: skip
    data = tmp_path / "omniglot"
    data.mkdir()
    (data / "images_background.npz").touch()
    script = ["bash", str(REPO / "bench" / "gpu_window.sh")]
    done = subprocess.run(script, env={**env, "OMNIGLOT_DIR": str(data)}, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "paper table:" in x]
    assert "bench/paper_table.py --run --scale gpu --side-by-side 3" in line
    assert f"--pack {tmp_path / 'out'}" in line and "--ways 5 20 --rows a b c" in line
    empty = subprocess.run(script, env={**env, "OMNIGLOT_DIR": str(tmp_path / "none")},
                           capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert "paper table: no Omniglot npz" in empty.stdout, empty.stdout


@pytest.mark.integration
def test_row_d_records_the_digest_of_its_public_warm_start(
    shared_omniglot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Row (d) starts from a declared public warm start: its record pins the starting model's
    # digest (issue 50, point 5), the model the workload actually starts from.
    from fedmeta.config_io import load_config
    from fedmeta.workload import build_workload

    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    pt = bench_script("paper_table")
    sets = [*pt.row_sets(pt.SCALES["tiny"], "d", False), f"dataset.path={shared_omniglot}"]
    cfg = load_config(pt.config_of(5), sets)
    found = pt.digests(cfg)["warm_start_digest"]
    start = build_workload(cfg).initial_params().numpy().tobytes()
    assert found is not None and len(found) >= 16
    assert found == pt.digests(cfg)["warm_start_digest"]  # the same model every time
    assert pt._digest([start]) == found


@pytest.mark.integration
@pytest.mark.slow  # builds 16 federations, the GPU scale's of 400,000 tasks (minutes on 2 cores)
def test_every_row_of_every_scale_builds_its_participants(shared_omniglot: Path) -> None:
    # A row that cannot build its participants' tasks fails only at run time, after minutes of a
    # device window: 20-way (d) on whole evaluation alphabets left one participant 19 characters.
    from fedmeta.config_io import load_config
    from fedmeta.workload import check_data

    pt = bench_script("paper_table")
    for scale in ("cpu", "gpu"):
        for way in pt.WAYS:
            for row in pt.ROWS:
                sets = [*pt.row_sets(pt.SCALES[scale], row, False, way),
                        f"dataset.path={shared_omniglot}"]  # fmt: skip
                check_data(load_config(pt.config_of(way), sets))
