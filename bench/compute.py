"""Compute benchmark of the per-task clipped MAML gradient (issue 3).

Tasks per second and peak extra memory of "one clipped query gradient per task" for Omniglot-shaped
tasks (28x28, ConvNet4 with 64 filters), for:

* ``fedmeta``  - :func:`metalearning.per_task_clipped_grads` (auto method: on CUDA vmap; on the CPU
  the per-task loop over ``ConvNet4.fused_forward``, with tasks side by side when torch has more
  than one thread);
* ``fedmeta-vmap`` / ``fedmeta-loop`` - the two forced paths (``--methods`` to add them);
* ``loop``     - a plain per-task autograd loop written here as the reference;
* ``higher``   - facebookresearch/higher's ``innerloop_ctx`` (if installed), per task.

Every method clips each task's flattened gradient to C and keeps it separate (no ``.grad`` sum).
Data are synthetic Omniglot-shaped tasks (compute does not depend on pixel values), so this runs on
a machine without the dataset. CPU memory is the peak RSS increase during the measurement (sampled
every 2 ms); CUDA memory is ``torch.cuda.max_memory_allocated``. Each line also records
``os.getloadavg()``: the CPU machine is shared, so read CPU figures with the load beside them.

    python bench/compute.py --quick --json       # ~1 min: 5-way, 1 step, both orders, batch 8
    python bench/compute.py --json --min-time 1  # the full grid (~10 min on 2 CPU cores)
    python bench/compute.py --gpu-config --json  # 5-way 1-shot, 2nd order, 5 steps, 1 query/class
    python bench/compute_table.py grid.jsonl     # JSON lines -> the table in docs/benchmarks.md

``--threads`` sets torch's CPU threads for every method alike (default 1).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call  # noqa: E402

import fedmeta.metalearning as ml  # noqa: E402
from fedmeta.metalearning import Task  # noqa: E402

CLIP = 1.0
INNER_LR = 0.4


def synthetic_tasks(
    n: int, n_way: int, k_shot: int, q_query: int, seed: int, device: torch.device
) -> Task:
    g = torch.Generator().manual_seed(seed)
    sx = (torch.rand(n, n_way * k_shot, 1, 28, 28, generator=g) > 0.8).float()
    qx = (torch.rand(n, n_way * q_query, 1, 28, 28, generator=g) > 0.8).float()
    sy = torch.arange(n_way).repeat_interleave(k_shot).repeat(n, 1)
    qy = torch.arange(n_way).repeat_interleave(q_query).repeat(n, 1)
    return Task(sx, sy, qx, qy).to(device)


# -------------------------------------------------------------------------------------------
# methods


def run_fedmeta(method: str, deterministic: bool = True):
    def fn(model, params, tasks, steps, first_order, device, chunk):
        return ml.per_task_clipped_grads(
            model,
            params,
            tasks,
            inner_steps=steps,
            inner_lr=INNER_LR,
            first_order=first_order,
            clip=CLIP,
            device=device,
            method=method,
            chunk_size=chunk,
            deterministic=deterministic,
        )[0]

    return fn


def run_loop(model, params, tasks, steps, first_order, device, chunk):
    """The plain reference: one task at a time, autograd.grad, clip, store."""
    out = []
    for i in range(tasks.support_x.shape[0]):
        meta = [p.detach().requires_grad_(True) for p in params.values()]
        names = list(params)
        fast = meta
        for _ in range(steps):
            loss = F.cross_entropy(
                functional_call(model, dict(zip(names, fast, strict=False)), (tasks.support_x[i],)),
                tasks.support_y[i],
            )
            g = torch.autograd.grad(loss, fast, create_graph=not first_order)
            fast = [p - INNER_LR * gi for p, gi in zip(fast, g, strict=False)]
        q = F.cross_entropy(
            functional_call(model, dict(zip(names, fast, strict=False)), (tasks.query_x[i],)),
            tasks.query_y[i],
        )
        flat = torch.cat([g.reshape(-1) for g in torch.autograd.grad(q, meta)])
        out.append(flat * min(1.0, CLIP / max(float(flat.norm()), 1e-30)))
    return torch.stack(out)


def run_higher(model, params, tasks, steps, first_order, device, chunk):
    import higher

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    out = []
    for i in range(tasks.support_x.shape[0]):
        with higher.innerloop_ctx(model, opt, copy_initial_weights=False) as (fmodel, diffopt):
            for _ in range(steps):
                loss = F.cross_entropy(fmodel(tasks.support_x[i]), tasks.support_y[i])
                if first_order:
                    diffopt.step(loss, grad_callback=lambda gs: [g.detach() for g in gs])
                else:
                    diffopt.step(loss)
            q = F.cross_entropy(fmodel(tasks.query_x[i]), tasks.query_y[i])
            grads = torch.autograd.grad(q, list(model.parameters()))
        flat = torch.cat([g.reshape(-1) for g in grads])
        out.append(flat * min(1.0, CLIP / max(float(flat.norm()), 1e-30)))
    return torch.stack(out)


METHODS = {
    "fedmeta": run_fedmeta("auto"),
    "fedmeta-vmap": run_fedmeta("vmap"),
    "fedmeta-loop": run_fedmeta("loop"),
    "fedmeta-nondet": run_fedmeta("auto", deterministic=False),
    "loop": run_loop,
    "higher": run_higher,
}


# -----------------------------------------------------------------------------------------
# measuring


class RssPeak:
    """Peak resident set size (MiB) in a background sampler."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.base = self.now()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def now(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def __enter__(self) -> RssPeak:
        self._t.start()
        return self

    def __exit__(self, *a: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def measure(
    method: str,
    n_way: int,
    q_query: int,
    steps: int,
    order: str,
    batch: int,
    device: torch.device,
    min_time: float,
    chunk: int | None,
) -> dict[str, Any]:
    fn = METHODS[method]
    model = ml.ConvNet4(n_way).to(device)
    params = {k: v.to(device) for k, v in ml.init_params(model, 0).items()}
    tasks = synthetic_tasks(batch, n_way, 1, q_query, seed=batch, device=device)
    first = order == "first"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # warm-up (vmap tracing, cuDNN algorithm choice: the full shape on CUDA; two tasks on the CPU)
    warm = tasks if device.type == "cuda" else Task(*(t[:2] for t in tasks))
    # On the CPU, repeat for half a second: the first calls at a new shape also pay for the
    # allocator growing and for oneDNN primitive creation (a cold first 20-way row read 0.94x
    # where repeats read 1.17-1.22x).
    t_warm = time.perf_counter()
    while True:
        fn(model, params, warm, steps, first, device, chunk)
        if device.type == "cuda" or time.perf_counter() - t_warm >= 0.5:
            break
    sync()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    reps, elapsed = 0, 0.0
    with RssPeak() as rss:
        t0 = time.perf_counter()
        while reps < 1 or elapsed < min_time:
            out = fn(model, params, tasks, steps, first, device, chunk)
            sync()
            reps += 1
            elapsed = time.perf_counter() - t0
    assert out.shape[0] == batch and bool((out.norm(dim=1) <= CLIP * (1 + 1e-4)).all())
    peak = (
        (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
        if device.type == "cuda"
        else rss.peak - rss.base
    )
    impl = (
        ml.resolve_method(
            model,
            device,
            method.split("-")[1] if method in ("fedmeta-vmap", "fedmeta-loop") else "auto",
            batch,
        )
        if method.startswith("fedmeta")
        else method
    )
    if impl == "loop" and device.type == "cpu" and method.startswith("fedmeta"):
        impl = "fused-loop"  # ConvNet4.fused_forward, tasks side by side with >1 thread
    return {
        "method": method,
        "impl": impl,
        "order": order,
        "inner_steps": steps,
        "batch": batch,
        "n_way": n_way,
        "k_shot": 1,
        "q_query": q_query,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "tasks_per_s": round(reps * batch / elapsed, 2),
        "ms_per_task": round(1000 * elapsed / (reps * batch), 3),
        "peak_mem_mib": round(peak, 1),
        "reps": reps,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="5-way 1-shot, 1 step, 1st/2nd order, batch 8"
    )
    ap.add_argument(
        "--gpu-config",
        action="store_true",
        help="5-way 1-shot, 2nd order, 5 steps, 1 query per class, batches --batches",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--methods", default=None, help="comma list (default fedmeta,loop,higher)")
    ap.add_argument("--ways", default="5,20")
    ap.add_argument("--steps", default="1,5")
    ap.add_argument("--orders", default="first,second")
    ap.add_argument("--batches", default=None)
    ap.add_argument("--queries", type=int, default=15, help="query images per class")
    ap.add_argument("--chunk", type=int, default=None, help="fedmeta chunk size")
    ap.add_argument("--min-time", type=float, default=None, help="seconds per measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = ml.resolve_device(a.device)
    methods = (a.methods or "fedmeta,loop,higher").split(",")
    try:
        import higher  # noqa: F401
    except ImportError:
        if "higher" in methods:
            print("# higher not installed (pip install higher); skipped", file=sys.stderr)
            methods.remove("higher")
    ways, steps, orders = (
        [int(x) for x in a.ways.split(",")],
        [int(x) for x in a.steps.split(",")],
        a.orders.split(","),
    )
    batches = [1, 8, 32]
    queries = a.queries
    if a.quick:
        ways, steps, orders, batches = [5], [1], ["first", "second"], [8]
    if a.gpu_config:
        ways, steps, orders, queries = [5], [5], ["second"], 1
        batches = [1, 8, 32, 128, 512]
    if a.batches:
        batches = [int(x) for x in a.batches.split(",")]
    min_time = a.min_time if a.min_time is not None else (1.0 if device.type == "cuda" else 2.0)
    for n_way, k, order, batch, method in itertools.product(ways, steps, orders, batches, methods):
        r = measure(method, n_way, queries, k, order, batch, device, min_time, a.chunk)
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            print(
                f"{method:13s} {r['impl']:5s} {n_way:2d}-way q={queries:<2d} k={k} {order:6s} "
                f"batch={batch:<3d} {r['tasks_per_s']:9.2f} tasks/s "
                f"{r['ms_per_task']:8.2f} ms/task "
                f"peak {r['peak_mem_mib']:8.1f} MiB  load {r['loadavg'][0]}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
