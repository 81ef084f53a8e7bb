"""DP-MAML's recipe at the speed of the hardware (issue 51): task-gradients a second in a round.

    python bench/recipe_speed.py --device cuda                          # 5-way, 2nd order, 5 steps
    python bench/recipe_speed.py --device cuda --way 20 --precision bf16
    python bench/recipe_speed.py --device cuda --seeds 3                # one alone, then 3 at once
    python bench/recipe_speed.py --device cpu --participants 2 --rows 2 --repeat 1   # CPU scale

What one measurement is (one process, one seed):

* ``gradient_s``: the participants' clipped per-task gradients of one round (``participants x
  rows`` tasks of the recipe on ``--device``, ``--tasks-per-call`` at a time, in ``--precision``),
  the median of ``--repeat`` timed calls after an untimed warm-up call of the same shape;
* ``overhead_s``: the rest of the round, from bench/round_cost.py: the real server round
  (``run_round``: requests, the in-process grid's transport, validation and the float64 re-check,
  the ledger spend with its fsync, the secure noise, the optimizer step) with rows of the recipe's
  dimension standing in for the gradients. The two are timed apart and added: the batched round
  runs them one after the other, so ``round_s = gradient_s + overhead_s`` and
  ``task_gradients_per_s = tasks / round_s``; ``gradient_only_per_s`` is ``tasks / gradient_s``;
* ``peak_gib``: the gradient call's peak (CUDA: ``max_memory_allocated``; CPU: the resident set);
* ``flops_per_task``: one task-gradient's FLOPs counted by ``torch.utils.flop_counter``
  (convolutions and matrix products, forward and every backward, second order included), with
  ``flops_per_task_analytic`` (:func:`analytic_flops`, exact for first order, tested against the
  counter); ``achieved_tflops`` = ``flops_per_task x gradient_only_per_s``, as a fraction of a
  large matrix product measured at the same precision on the same device
  (``fraction_of_matmul``) and of the datasheet's dense peak where the device is known.

``--seeds N`` (N > 1) runs one process alone, then N processes side by side on the device, each
its own round (its own temporary ledger, its own secure noise, its own tasks from its seed), timed
over a common window (each waits for the others to be ready before timing), and reports the sum of
their rates against the one alone (``speedup_vs_one``). One JSON object a line is appended to
``--out`` (default results/recipe-speed.jsonl) and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import fedmeta.metalearning as ml  # noqa: E402
from fedmeta.metalearning import Task  # noqa: E402
from fedmeta.metalearning.execution import effective_precision, resolve_method  # noqa: E402

EXIT_NO_DEVICE = 2
CLIP = 1.0
#: Dense datasheet peaks, TFLOP/s (NVIDIA H100/H200 SXM: same compute). fp32 here is TF32: torch
#: lets cuDNN's convolutions use TF32 by default, so the float32 path is held to that ceiling.
DATASHEET_TFLOPS = {"H100": {"fp32": 494.7, "tf32": 494.7, "bf16": 989.4},
                    "H200": {"fp32": 494.7, "tf32": 494.7, "bf16": 989.4}}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--order", choices=("first", "second"), default="second")
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--queries", type=int, default=1, help="query images per class")
    ap.add_argument("--participants", type=int, default=20)
    ap.add_argument("--rows", type=int, default=80, help="tasks per participant in a round")
    ap.add_argument("--tasks-per-call", type=int, default=512, help="the gradient's chunk")
    ap.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    ap.add_argument("--repeat", type=int, default=3, help="timed gradient calls and rounds")
    ap.add_argument("--seeds", type=int, default=1, help="processes side by side (> 1: also one)")
    ap.add_argument("--seed", type=int, default=0, help="this process's tasks")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "recipe-speed.jsonl")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--sync-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("way", "queries", "participants", "rows", "tasks_per_call", "repeat", "seeds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.inner_steps < 0:
        ap.error(f"--inner-steps must be >= 0; got {args.inner_steps}")
    return args


# ------------------------------------------------------------------------------------------------
# counting


def analytic_flops(way: int, hidden: int, images: int, *, side: int = 28, backward: bool) -> int:
    """FLOPs of ConvNet4's convolutions and head on ``images`` images, forward (and backward).

    A 3x3 convolution with padding 1 on an ``s x s`` map costs ``2 s^2 cin cout 9`` forward; its
    backward costs as much again for the weight gradient and again for the input gradient, which
    the first block does not need (the images carry no gradient). Max-pooling floors the side
    (28, 14, 7, 3, then 1 at the head). Normalisation, ReLU and pooling are not counted, as
    ``torch.utils.flop_counter`` does not count them.
    """
    total, cin, s = 0, 1, side
    for block in range(4):
        fwd = 2 * s * s * cin * hidden * 9 * images
        total += fwd + ((fwd if block else 0) + fwd if backward else 0)
        cin, s = hidden, s // 2
    head = 2 * hidden * s * s * way * images
    return total + head + (2 * head if backward else 0)


def analytic_task_flops(way: int, hidden: int, shots: int, queries: int, steps: int) -> int:
    """One first-order task-gradient: ``steps`` support passes and one query pass, each F + B."""
    support = analytic_flops(way, hidden, way * shots, backward=True)
    return steps * support + analytic_flops(way, hidden, way * queries, backward=True)


def counted_task_flops(args: argparse.Namespace) -> int:
    """One task-gradient's FLOPs by ``FlopCounterMode`` (on the CPU: the count is the device's)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = ml.ConvNet4(args.way)
    tasks = synthetic_tasks(1, args.way, args.queries, seed=0, device=torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        ml.per_task_clipped_grads(model, None, tasks, **_gradient_kwargs(args, "cpu", "loop"))
    return int(counter.get_total_flops())


def matmul_tflops(device: torch.device, precision: str) -> float:
    """A large matrix product's rate at ``precision`` on ``device`` (the measured ceiling)."""
    from fedmeta.metalearning.execution import compute_precision

    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    reps = 10 if device.type == "cuda" else 3
    with compute_precision(device, effective_precision(precision, device)):
        for _ in range(2):
            a @ b
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


# ------------------------------------------------------------------------------------------------
# timing


def synthetic_tasks(n: int, way: int, queries: int, seed: int, device: torch.device) -> Task:
    """Omniglot-shaped 1-shot tasks (binary 28x28 images): compute does not depend on pixels."""
    g = torch.Generator().manual_seed(seed)
    sx = (torch.rand(n, way, 1, 28, 28, generator=g) > 0.8).float()
    qx = (torch.rand(n, way * queries, 1, 28, 28, generator=g) > 0.8).float()
    sy = torch.arange(way).repeat(n, 1)
    qy = torch.arange(way).repeat_interleave(queries).repeat(n, 1)
    return Task(sx, sy, qx, qy).to(device)


def _gradient_kwargs(args: argparse.Namespace, device: str, method: str = "auto") -> dict[str, Any]:
    return {"inner_steps": args.inner_steps, "inner_lr": args.inner_lr,
            "first_order": args.order == "first", "clip": CLIP, "device": device,
            "chunk_size": args.tasks_per_call, "method": method, "step_check": False,
            "nonfinite": "zero", "precision": args.precision}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gradient_seconds(args: argparse.Namespace, wait: Any) -> tuple[float, float, str]:
    """(median seconds of one round's gradients, peak GiB, path); ``wait()`` before timing."""
    from compute import RssPeak

    device = torch.device(args.device)
    model = ml.ConvNet4(args.way).to(device)
    total = args.participants * args.rows
    tasks = synthetic_tasks(total, args.way, args.queries, args.seed, device)
    kwargs = _gradient_kwargs(args, args.device)
    warm = Task(*(t[: min(total, args.tasks_per_call)] for t in tasks))
    ml.per_task_clipped_grads(model, None, warm, **kwargs)  # compile, cuDNN choice: untimed
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wait()
    times = []
    with RssPeak() as rss:
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            rows, _ = ml.per_task_clipped_grads(model, None, tasks, **kwargs)
            _sync(device)
            times.append(time.perf_counter() - t0)
    assert rows.dtype == torch.float32 and bool((rows.norm(dim=1) <= CLIP).all())
    peak = (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
            else rss.peak / 1024)  # fmt: skip
    path = resolve_method(model, device, "auto", min(total, args.tasks_per_call))
    return statistics.median(times), peak, path


def overhead_seconds(args: argparse.Namespace) -> float:
    """The round apart from the gradients (bench/round_cost.py's real server round)."""
    import round_cost

    dim = sum(p.numel() for p in ml.ConvNet4(args.way).parameters())
    ns = argparse.Namespace(device=args.device, rows=args.rows, participants=args.participants,
                            dimension=dim, repeat=args.repeat, threads=1)  # fmt: skip
    return statistics.median(round_cost.round_seconds(ns, round_cost._rows(ns)))


def _waiter(sync_dir: Path | None, seed: int) -> Any:
    """With ``--sync-dir``: say ready, then wait until every sibling is (the parent says go)."""

    def wait() -> None:
        if sync_dir is None:
            return
        (sync_dir / f"ready-{seed}").touch()
        while not (sync_dir / "go").exists():
            time.sleep(0.01)

    return wait


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process's record (see the module docstring)."""
    device = torch.device(args.device)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    torch.set_num_threads(1)  # as `fedmeta simulate` runs torch
    gradient_s, peak, path = gradient_seconds(args, _waiter(args.sync_dir, args.seed))
    overhead_s = overhead_seconds(args)
    tasks = args.participants * args.rows
    return {"gradient_s": round(gradient_s, 4), "overhead_s": round(overhead_s, 4),
            "round_s": round(gradient_s + overhead_s, 4),
            "round_over_gradient": round((gradient_s + overhead_s) / gradient_s, 3),
            "task_gradients_per_s": round(tasks / (gradient_s + overhead_s), 2),
            "gradient_only_per_s": round(tasks / gradient_s, 2), "peak_gib": round(peak, 3),
            "path": path, "precision_ran": effective_precision(args.precision, device)}  # fmt: skip


def side_by_side(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    """``--seeds`` child processes of this script, timed over a common window."""
    with tempfile.TemporaryDirectory() as tmp:
        sync = Path(tmp)
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--seeds", "1", "--seed",
                                   str(s), "--no-write", "--sync-dir", str(sync)],
                                  stdout=subprocess.PIPE, text=True)
                 for s in range(args.seeds)]  # fmt: skip
        while len(list(sync.glob("ready-*"))) < args.seeds:
            if any(p.poll() not in (None, 0) for p in procs):
                raise SystemExit("recipe_speed: a side-by-side process failed")
            time.sleep(0.05)
        (sync / "go").touch()
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("recipe_speed: a side-by-side process failed")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """device, driver, torch, commit, date, command, load."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    driver = None
    if cuda:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            driver = subprocess.run(query, capture_output=True, text=True, check=False).stdout
            driver = driver.strip().splitlines()[0] if driver.strip() else None
        except OSError:
            driver = None
    try:
        git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "driver": driver, "torch": torch.__version__, "python": platform.python_version(),
            "commit": commit or None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": shlex.join(["python", "bench/recipe_speed.py", *sys.argv[1:]]),
            "load_average": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


def record(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The whole record: the one-process measurement, and with ``--seeds`` the side-by-side one."""
    one = measure(args)
    rec: dict[str, Any] = {"way": args.way, "order": args.order, "inner_steps": args.inner_steps,
                           "inner_lr": args.inner_lr, "queries": args.queries,
                           "tasks_per_round": args.participants * args.rows,
                           "tasks_per_call": args.tasks_per_call, "precision": args.precision,
                           **one, "seeds": 1, "speedup_vs_one": None}  # fmt: skip
    if args.seeds > 1:
        many = side_by_side(args, argv)
        total = sum(m["task_gradients_per_s"] for m in many)
        rec.update(seeds=args.seeds, per_seed=many, task_gradients_per_s_together=round(total, 2),
                   speedup_vs_one=round(total / one["task_gradients_per_s"], 3),
                   peak_gib_together=round(sum(m["peak_gib"] for m in many), 3))  # fmt: skip
    device = torch.device(args.device)
    flops = counted_task_flops(args)
    achieved = flops * one["gradient_only_per_s"] / 1e12
    ceiling = matmul_tflops(device, args.precision)
    sheet = next((v for k, v in DATASHEET_TFLOPS.items() if k in str(torch.cuda.get_device_name(
        device) if device.type == "cuda" else "")), None)  # fmt: skip
    rec.update(flops_per_task=flops,
               flops_per_task_analytic=(analytic_task_flops(args.way, 64, 1, args.queries,
                                        args.inner_steps) if args.order == "first" else None),
               achieved_tflops=round(achieved, 3), matmul_tflops=round(ceiling, 2),
               fraction_of_matmul=round(achieved / ceiling, 4),
               fraction_of_datasheet=(round(achieved / sheet[one["precision_ran"]], 4)
                                      if sheet else None))  # fmt: skip
    return {**environment(args), **rec}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"recipe_speed: --device cuda: this torch sees no CUDA device "
              f"(torch {torch.__version__}); use --device cpu", file=sys.stderr)  # fmt: skip
        return EXIT_NO_DEVICE
    if args.sync_dir is not None:  # a side-by-side child: its own measurement only
        print(json.dumps(measure(args)), flush=True)
        return 0
    rec = record(args, [a for a in argv if a not in ("--no-write",)])
    line = json.dumps(rec)
    print(line, flush=True)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
