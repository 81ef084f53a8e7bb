"""bench/results.py's summary of repeated runs: the ratio's interval and the k-run pass rate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit



def test_pass_rate_is_all_or_nothing_when_every_draw_agrees() -> None:
    results = bench_script("results")
    base = [1.0, 0.9, 1.1, 1.0, 1.0, 0.95]
    assert results.subset_pass_rate(base, base[::-1], 6, (1.15, 1.4), draws=200) == 1.0
    doubled = [2 * v for v in base]
    assert results.subset_pass_rate(doubled, base, 3, (1.15, 1.4), draws=200) == 0.0


def test_pass_rate_counts_the_worst_run_target() -> None:
    # Four private runs at the base mean and one at 1.5 times it: the mean of any 4 of the 5 is
    # at most 1.125 (within 1.15), so a draw fails exactly when it holds the 1.5 run, which 4 of
    # every 5 draws of 4 do. The estimate over n draws has standard error sqrt(p(1-p)/n); the
    # tolerance is 6 of them.
    results = bench_script("results")
    private, base, draws = [1.0, 1.0, 1.0, 1.0, 1.5], [1.0] * 5, 20_000
    rate = results.subset_pass_rate(private, base, 4, (1.15, 1.4), draws=draws)
    assert abs(rate - 0.2) <= 6 * math.sqrt(0.2 * 0.8 / draws)


def test_ratio_interval_brackets_the_ratio_of_means_within_its_extremes() -> None:
    results = bench_script("results")
    base = [0.20, 0.25, 0.30, 0.35, 0.40]
    private = [0.30, 0.33, 0.36, 0.40, 0.45]
    low, high = results.ratio_interval(private, base)
    point = (sum(private) / 5) / (sum(base) / 5)
    # Every resampled ratio is a ratio of means of observed runs, so the percentile interval
    # lies within [min(private) / max(base), max(private) / min(base)].
    assert min(private) / max(base) <= low < point < high <= max(private) / min(base)


def test_interrupted_runs_are_their_own_group_and_never_a_baseline(tmp_path: Path) -> None:
    results = bench_script("results")
    rec = {"experiment": "e", "epsilon_spent": None, "final_metric": 0.3, "rounds_completed": 200,
           "stopped_reason": "planned_rounds"}  # fmt: skip
    # The interrupted baseline comes first, so a summary that took the first non-private group as
    # the baseline would divide by its 9.0.
    lines = [
        {**rec, "overrides": ["privacy.enabled=false"], "final_metric": 9.0,
         "rounds_completed": 3, "stopped_reason": "interrupted"},
        {**rec, "overrides": ["privacy.enabled=false"]},
        {**rec, "overrides": ["privacy.epsilon_budget=8"], "epsilon_spent": 8.0,
         "final_metric": 0.6},
        {**rec, "overrides": ["privacy.epsilon_budget=8"], "epsilon_spent": 2.0,
         "final_metric": 5.0, "rounds_completed": 4, "stopped_reason": "interrupted"},
    ]  # fmt: skip
    path = tmp_path / "r.jsonl"
    path.write_text("".join(results.json.dumps(x) + "\n" for x in lines))
    rows = results.summarise([path])
    whole = {tuple(r["overrides"]): r for r in rows if not r["interrupted"]}
    cut = {tuple(r["overrides"]): r for r in rows if r["interrupted"]}
    assert len(rows) == 4 and all(r["runs"] == 1 for r in rows)
    # The private whole run is compared with the whole baseline alone: 0.6 / 0.3.
    assert whole[("privacy.epsilon_budget=8",)]["ratio_of_means"] == pytest.approx(2.0)
    assert "ratio_of_means" not in cut[("privacy.epsilon_budget=8",)]
    assert cut[("privacy.enabled=false",)]["rounds_completed"] == [3]


def test_runs_of_the_same_data_read_from_different_places_group(tmp_path: Path) -> None:
    results = bench_script("results")
    rec = {"experiment": "e", "epsilon_spent": 8.0, "rounds_completed": 120,
           "stopped_reason": "planned_rounds"}  # fmt: skip
    lines = [
        {**rec, "overrides": ["dataset.path=data/omniglot", "rounds=120"], "final_metric": 0.6},
        {**rec, "overrides": ["dataset.path=.devdata", "rounds=120"], "final_metric": 0.7},
        {**rec, "overrides": ["dataset.path=.devdata", "rounds=60"], "final_metric": 0.5},
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(results.json.dumps(x) + "\n" for x in lines))
    rows = {tuple(r["overrides"]): r for r in results.summarise([path])}
    assert rows[("rounds=120",)]["values"] == [0.6, 0.7]
    assert rows[("rounds=60",)]["runs"] == 1


def test_machine_description_names_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    # A record from a GPU machine once said only "vm x86_64 (x86_64)": a reader could not tell it
    # from a CPU run. The description names the cores and the GPU, or says there is none.
    import torch

    results = bench_script("results")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert results.machine_description().endswith(" cores, no GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert results.machine_description().endswith(" cores, NVIDIA H200")


def test_a_run_made_by_simulate_is_recorded_like_the_others(tmp_path: Path, monkeypatch) -> None:
    # The paper scale runs as `fedmeta simulate --out DIR` and `--resume --out DIR` across calls;
    # `from-run` records it from its summary.json with the fields every other record has.
    results = bench_script("results")
    run = tmp_path / "run"
    run.mkdir()
    summary = {k: None for k in results.SUMMARY_FIELDS}
    summary |= {"final_metric": 0.8, "epsilon_spent": 1.5, "rounds_completed": 250,
                "stopped_reason": "planned_rounds", "unrelated": 1, "seen_fraction": 0.05,
                "held_out": {"mean": 0.7, "tasks": 600}}  # fmt: skip
    (run / "summary.json").write_text(results.json.dumps(summary))
    monkeypatch.setattr(results, "group_size", lambda cfg: 7)
    out = tmp_path / "out.jsonl"
    sets = ["rounds=250", "privacy.epsilon_budget=1.5"]
    rec = results.record_run_dir(
        "paper", run, results.REPO / "configs" / "sinusoid.toml", sets, out
    )
    assert [results.json.loads(line) for line in out.read_text().splitlines()] == [rec]
    assert rec["final_metric"] == 0.8 and rec["rounds_completed"] == 250
    assert rec["overrides"] == sets and rec["wall_s"] is None and "unrelated" not in rec
    assert rec["max_tasks_per_example"] == 7 and rec["config"] == "configs/sinusoid.toml"
    row = results.summarise([out])[0]
    assert row["experiment"] == "paper" and row["values"] == [0.8]
    # What the test evaluation had seen travels with the record and its row (issue 42).
    assert rec["seen_fraction"] == 0.05 and rec["held_out"]["mean"] == 0.7
    assert row["seen_fraction"] == [0.05]
