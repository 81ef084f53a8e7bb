"""Time one query pass (forward + backward) of ConvNet4 under each CPU rewrite (docs/benchmarks.md).

The query pass dominates a task's cost on the CPU (15 queries per class against 1 support image per
class). Variants, each the same function of the parameters:

* ``module``        - ``functional_call(model, ...)``: conv, batch norm, ReLU, max-pool, NCHW;
* ``relu-after-pool`` - ``fused_forward(..., once_differentiable=False)``: ReLU after pooling, NCHW;
* ``fused``         - ``fused_forward(..., once_differentiable=True)``: also channels-last, with
  ``_BatchNormNHWC`` (fedmeta's CPU query pass);
* ``fused-torch-nhwc-bn`` - as ``fused`` with PyTorch's channels-last batch norm (rejected: see
  ``bench/compute_accuracy.py``).

Rounds alternate the variants, so a drift in machine speed hits them alike; the median is printed.

    python bench/query_pass.py                 # 5-way and 20-way, 1 torch thread, ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from compute_accuracy import torch_nhwc_batch_norm  # noqa: E402
from torch.func import functional_call  # noqa: E402

import fedmeta.metalearning as ml  # noqa: E402


def measure(n_way: int, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per query pass of each variant, ``rounds`` alternating repetitions."""
    model = ml.ConvNet4(n_way)
    params = ml.init_params(model, 0)
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(15 * n_way, 1, 28, 28, generator=g) > 0.8).float()
    y = torch.arange(n_way).repeat_interleave(15)

    def grad(forward: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> None:
        p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        torch.autograd.grad(F.cross_entropy(forward(p), y), list(p.values()))

    def module(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (x,))

    def reorder(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return model.fused_forward(p, x, once_differentiable=False)

    def fused(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return model.fused_forward(p, x, once_differentiable=True)

    def torch_bn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch_nhwc_batch_norm():
            return model.fused_forward(p, x, once_differentiable=True)

    variants = {
        "module": module,
        "relu-after-pool": reorder,
        "fused": fused,
        "fused-torch-nhwc-bn": torch_bn,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        grad(fn)  # warm-up
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            grad(fn)
            times[name].append(1000 * (time.perf_counter() - t0))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ways", default="5,20")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    for n_way in (int(w) for w in a.ways.split(",")):
        times = measure(n_way, a.rounds)
        base = statistics.median(times["module"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{n_way:2d}-way {15 * n_way:3d} queries  {name:20s} {med:7.1f} ms "
                f"(min {min(ts):6.1f})  {base / med:4.2f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
