"""bench/recipe_speed.py (issue 51): the analytic FLOP count against torch's counter, the record."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.bench_scripts import bench_script
from torch.utils.flop_counter import FlopCounterMode

import fedmeta.metalearning as ml

REPO = Path(__file__).resolve().parent.parent
#: What issue 51 asks every record of results/recipe-speed.jsonl to hold (and more).
RECORD_KEYS = ("device", "driver", "torch", "way", "order", "inner_steps", "seeds", "precision",
               "speedup_vs_one", "commit", "date", "command", "peak_gib",
               "task_gradients_per_s")  # fmt: skip


def _args(**kw: object) -> argparse.Namespace:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    return bench_script("recipe_speed").parse_args(flags)


@pytest.mark.unit
@pytest.mark.parametrize(("way", "hidden", "images"), [(5, 64, 5), (20, 64, 20), (5, 8, 3)])
def test_analytic_forward_and_backward_match_the_counter(
    way: int, hidden: int, images: int
) -> None:
    bench = bench_script("recipe_speed")
    model = ml.ConvNet4(way, hidden=hidden)
    x = torch.rand(images, 1, 28, 28)
    with FlopCounterMode(display=False) as forward:
        loss = F.cross_entropy(model(x), torch.arange(images) % way)
    assert forward.get_total_flops() == bench.analytic_flops(way, hidden, images, backward=False)
    with FlopCounterMode(display=False) as backward:
        torch.autograd.grad(loss, list(model.parameters()))
    both = forward.get_total_flops() + backward.get_total_flops()
    assert both == bench.analytic_flops(way, hidden, images, backward=True)


@pytest.mark.unit
@pytest.mark.parametrize(("way", "queries", "steps"), [(5, 1, 0), (5, 1, 2), (20, 1, 1), (5, 3, 1)])
def test_first_order_task_gradient_matches_the_counter(way: int, queries: int, steps: int) -> None:
    bench = bench_script("recipe_speed")
    args = _args(way=way, queries=queries, inner_steps=steps, order="first")
    assert bench.counted_task_flops(args) == bench.analytic_task_flops(way, 64, 1, queries, steps)


@pytest.mark.unit
def test_second_order_costs_more_than_first() -> None:
    bench = bench_script("recipe_speed")
    first = bench.counted_task_flops(_args(order="first", inner_steps=2))
    second = bench.counted_task_flops(_args(order="second", inner_steps=2))
    # The outer backward also runs back through both inner steps' backward passes.
    assert second > 1.5 * first


@pytest.mark.integration
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_record_on_the_cpu(tmp_path: Path, precision: str) -> None:
    out = tmp_path / "speed.jsonl"
    argv = ["--device", "cpu", "--participants", "1", "--rows", "2", "--inner-steps", "1",
            "--repeat", "1", "--precision", precision, "--out", str(out)]  # fmt: skip
    assert bench_script("recipe_speed").main(argv) == 0
    rec = json.loads(out.read_text().strip())
    assert set(RECORD_KEYS) <= set(rec), set(RECORD_KEYS) - set(rec)
    assert rec["precision"] == rec["precision_ran"] == precision
    assert rec["way"] == 5 and rec["order"] == "second" and rec["seeds"] == 1
    assert rec["task_gradients_per_s"] > 0 and rec["round_s"] > rec["gradient_s"] > 0
    assert 0 < rec["task_gradients_per_s"] < rec["gradient_only_per_s"]
    assert rec["round_over_gradient"] == pytest.approx(rec["round_s"] / rec["gradient_s"], rel=1e-2)
    assert rec["peak_gib"] > 0 and rec["achieved_tflops"] > 0


@pytest.mark.integration
@pytest.mark.slow
def test_seeds_side_by_side_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "speed.jsonl"
    argv = ["--device", "cpu", "--participants", "1", "--rows", "1", "--inner-steps", "1",
            "--repeat", "1", "--seeds", "2", "--out", str(out)]  # fmt: skip
    assert bench_script("recipe_speed").main(argv) == 0
    rec = json.loads(out.read_text().strip())
    assert rec["seeds"] == 2 and len(rec["per_seed"]) == 2 and rec["speedup_vs_one"] > 0
    assert rec["task_gradients_per_s_together"] == pytest.approx(
        sum(s["task_gradients_per_s"] for s in rec["per_seed"]), rel=1e-3
    )


@pytest.mark.unit
def test_cuda_without_a_device_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert bench_script("recipe_speed").main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0]


@pytest.mark.integration
@pytest.mark.slow
def test_gpu_window_packs_and_resumes_on_the_cpu(tmp_path: Path) -> None:
    """The window's script: a step's records packed into one file; a second call keeps them."""
    import os
    import subprocess

    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_WINDOW_STATE": str(tmp_path / "st"),
           "GPU_WINDOW_DEVICE": "cpu", "GPU_WINDOW_STEPS": "5way-fp32", "PYTHON": os.sys.executable,
           "SPEED_EXTRA": "--participants 1 --rows 1 --inner-steps 1 --repeat 1"}  # fmt: skip
    for call in range(2):
        done = subprocess.run(["bash", str(REPO / "bench" / "gpu_window.sh")], env=env,
                              capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        lines = (tmp_path / "out" / "gpu-window.jsonl").read_text().splitlines()
        packed = [json.loads(x) for x in lines]
        assert [p["step"] for p in packed] == ["5way-fp32"]
        assert packed[0]["record"]["way"] == 5 and packed[0]["record"]["precision"] == "fp32"
        assert ("done before, kept" in done.stdout) == (call == 1)
