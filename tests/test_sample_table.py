"""bench/sample_table.py: issue 53's rows from records, and its tiny scale end to end."""

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
SCRIPT = REPO / "bench" / "sample_table.py"


def _record(shots: int | None, run: int, value: float, **changes: Any) -> dict[str, Any]:
    return {
        "format": "fedmeta-sample-table-record-v1", "scale": "cpu", "way": 5, "shots": shots,
        "run": run, "started": f"2026-11-29T10:0{run}:00+00:00", "device": "cpu box",
        "final_metric": value, "starting_metric": 0.2, "epsilon_valid": 1.179,
        "delta": 1e-5, "seen_fraction": 0.0, "test_tasks_digest": "t1",
        "stopped_reason": "planned_rounds", **changes,
    }  # fmt: skip


@pytest.mark.unit
def test_a_row_is_its_whole_runs_beside_what_dpmamls_text_gives() -> None:
    st = bench_script("sample_table")
    recs = [_record(8, i, acc) for i, acc in enumerate([0.30, 0.32, 0.34], 1)]
    recs.append(_record(8, 4, 0.9, stopped_reason="interrupted"))  # never counted
    row = st.summarise(recs, ("cpu", "8"))
    assert row["runs"] == 3 and row["level"] == "sample"
    assert row["mean"] == pytest.approx(32.0) and (row["min"], row["max"]) == (30.0, 34.0)
    assert row["ci95"] == pytest.approx([32.0 - 4.968, 32.0 + 4.968], abs=1e-3)
    assert row["epsilon_valid"] == 1.179 and row["delta"] == 1e-5 and row["untrained"] == 20.0
    # Section 6.4's text gives K = 8 only; the other shots say why there is no number.
    assert row["paper"].startswith("92")
    assert st.summarise(recs, ("cpu", "1"))["paper"].startswith("not readable from the text")


@pytest.mark.unit
def test_missing_rows_give_their_command_and_the_sinusoid_says_it_is_refused() -> None:
    st = bench_script("sample_table")
    text = st.markdown(st.table_rows([_record(1, 1, 0.21)], ["gpu", "cpu"]))
    assert "missing: `OMNIGLOT_DIR=/path/to/omniglot nice -n 19 python bench/sample_table.py " \
           "--run --scale cpu --shots 5 --runs 3`" in text  # fmt: skip
    assert "--scale gpu --shots 8 --runs 3`" in text
    (line,) = [line for line in text.splitlines() if line.startswith("| cpu | K = 1 |")]
    assert "| 1 | 21.0 |" in line and "1.179 (delta 1e-05)" in line
    assert "Sinusoid: refused at sample level" in text
    assert "`nice -n 19 python bench/sample_table.py --run --scale cpu --sinusoid --runs 3`" in text
    mse = st.table_rows([_record(None, i, v) for i, v in enumerate([0.5, 0.7], 1)], ["cpu"])
    sinusoid = [r for r in mse if r["row"] == "sinusoid"][0]
    assert sinusoid["mean"] == pytest.approx(0.6) and sinusoid["metric"] == "mse"
    assert "| 2 | 0.600 | 0.500-0.700 |" in st.markdown([sinusoid])


@pytest.mark.unit
def test_the_rows_overrides_give_the_nominal_sizes_and_the_budget() -> None:
    st = bench_script("sample_table")
    sets = st.row_sets("cpu", "8")
    assert "privacy.sample.example_rate=0.65" in sets  # (8 + 5) of a character's 20 drawings
    assert {"dataset.shots=8", "privacy.epsilon_budget=1.18", "privacy.delta=1e-05"} <= set(sets)
    # The sinusoid's example-level row: the default job as written, one point's change = replace.
    assert st.row_sets("cpu", "sinusoid") == [
        "privacy.neighbouring=replace_one",
        "privacy.epsilon_budget=1.18",
        "privacy.delta=1e-05",
    ]
    with pytest.raises(SystemExit, match="--scale cpu or tiny"):
        st.row_sets("gpu", "sinusoid")


@pytest.mark.unit
def test_unpack_files_sample_records_only_by_their_name(tmp_path: Path) -> None:
    st = bench_script("sample_table")
    rec = _record(5, 1, 0.3)
    other = {"format": "fedmeta-paper-table-record-v1", "scale": "cpu"}
    pack = tmp_path / "pack.jsonl"
    pack.write_text(json.dumps(rec) + "\n" + json.dumps(other) + "\n" + '{"cut')
    assert st.pt.unpack([pack], tmp_path / "rec", st.FORMAT, st.record_name) == 1
    (path,) = (tmp_path / "rec").iterdir()
    assert path.name == st.record_name(rec) and json.loads(path.read_text()) == rec


@pytest.mark.integration
def test_the_committed_table_is_what_the_committed_records_give() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in subprocess.run(
        [sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, cwd=REPO,
        timeout=300, check=True).stdout.splitlines()]  # fmt: skip
    assert {(r["scale"], r["row"]) for r in rows} >= {
        *((s, k) for s in ("gpu", "cpu") for k in ("1", "5", "8")),
        ("cpu", "sinusoid"),
    }
    for rec in bench_script("sample_table").load_records():  # committed: a real scale, whole
        level = "task" if rec["shots"] is None else "sample"
        assert rec["scale"] in ("gpu", "cpu") and rec["level"] == level
        assert rec["epsilon_valid"] <= 1.18 * (1 + 1e-9) and rec["delta"] == 1e-5


@pytest.mark.integration
def test_tiny_scale_records_packs_resumes_unpacks(tmp_path: Path, shared_omniglot: Path) -> None:
    # One sample-level run at seconds' scale: its record whole and in the pack; the same command
    # again has nothing to run; the pack files into another folder.
    env = {**os.environ, "OMNIGLOT_DIR": str(shared_omniglot),
           "FEDMETA_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    env.pop("OUT", None)
    args = [sys.executable, str(SCRIPT), "--run", "--scale", "tiny", "--shots", "1", "--runs",
            "1", "--records", str(tmp_path / "rec"), "--pack", str(tmp_path / "out"), "--keep",
            str(tmp_path / "runs")]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "rec").iterdir()
    rec = json.loads(path.read_text())
    assert rec["level"] == "sample" and rec["shots"] == 1 and rec["rounds_completed"] == 2
    assert rec["sample_level"]["example_rate"] == 0.3 and rec["sample_level"]["order"] == "first"
    assert 0 < rec["epsilon_valid"] <= 1.18 * (1 + 1e-9) and rec["delta"] == 1e-5
    assert 0 <= rec["test_accuracy"] <= 1 and len(rec["test_accuracy_ci95"]) == 2
    for field in ("config_digest", "commit", "device", "started", "ended", "test_tasks_digest",
                  "seen_fraction", "held_out", "starting_accuracy", "rounds", "tasks_per_pass",
                  "test_tasks"):  # fmt: skip
        assert field in rec, field
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout == "", again.stdout[-2000:]
    packed = (tmp_path / "out" / "sample-table-records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in packed] == [rec]
    pack = tmp_path / "out" / "sample-table-records.jsonl"
    unpack = [sys.executable, str(SCRIPT), "--unpack", str(pack), "--records", str(tmp_path / "b")]
    assert subprocess.run(unpack, capture_output=True, text=True, timeout=300).returncode == 0
    assert [p.name for p in (tmp_path / "b").iterdir()] == [path.name]


@pytest.mark.integration
def test_the_sinusoid_row_runs_the_task_level_job_under_replace_one(tmp_path: Path) -> None:
    env = {**os.environ, "FEDMETA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("OUT", None)
    env.pop("OMNIGLOT_DIR", None)  # the sinusoid needs no data
    args = [sys.executable, str(SCRIPT), "--run", "--scale", "tiny", "--sinusoid", "--runs", "1",
            "--records", str(tmp_path / "rec"), "--keep", str(tmp_path / "runs")]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "rec").iterdir()
    rec = json.loads(path.read_text())
    assert path.name.startswith("tiny-sinusoid-") and rec["shots"] is None
    assert rec["level"] == "task" and "privacy.neighbouring=replace_one" in rec["overrides"]
    assert rec["metric"] == "mse" and rec["rounds_completed"] == 2
    assert 0 < rec["epsilon_valid"] <= 1.18 * (1 + 1e-9) and rec["delta"] == 1e-5


@pytest.mark.integration
def test_the_gpu_window_runs_the_sample_rows_after_the_paper_table(tmp_path: Path) -> None:
    # bench/gpu_window.sh's dry run prints the sample table's command after the paper table's.
    env = {**os.environ, "GPU_WINDOW_DRY": "1", "OUT": str(tmp_path / "out"),
           "GPU_WINDOW_STATE": str(tmp_path / "st"), "PYTHON": sys.executable}  # fmt: skip
    data = tmp_path / "omniglot"
    data.mkdir()
    (data / "images_background.npz").touch()
    script = ["bash", str(REPO / "bench" / "gpu_window.sh")]
    done = subprocess.run(script, env={**env, "OMNIGLOT_DIR": str(data)}, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    (line,) = [x for x in lines if "sample table:" in x]
    assert "bench/sample_table.py --run --scale gpu" in line and "--shots 8 1 5" in line
    assert f"--pack {tmp_path / 'out'}" in line
    assert lines.index(line) > next(i for i, x in enumerate(lines) if "paper table:" in x)
