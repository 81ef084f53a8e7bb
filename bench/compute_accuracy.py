"""Float32 accuracy of the CPU gradient paths against float64 (the table in docs/benchmarks.md).

For Omniglot-shaped synthetic tasks (binary 28x28 images, ConvNet4 with 64 filters, 15 queries per
class) and each configuration, the relative error ``max_i ||g_i - g_i^64|| / ||g_i^64||`` of float32
per-task gradients against the float64 gradients of the module's own forward, for:

* ``vmap``   - ``method="vmap"``: the module's NCHW forward through ``functional_call``;
* ``fused``  - ``method="loop"`` on the CPU: ``ConvNet4.fused_forward`` (fedmeta's CPU path);
* ``fused-torch-nhwc-bn`` - the fused path with PyTorch's own channels-last batch norm in place
  of ``_BatchNormNHWC`` (the variant fedmeta rejected).

Each cell is the median and the maximum over ``--seeds`` task draws. Random tasks through a freshly
initialised network are badly conditioned (batch statistics over 1x1 maps, near-ties in max-pool
windows that float32 rounding resolves either way), so single draws scatter over orders of
magnitude for every path, and a path that rounds like the float64 reference (same NCHW kernels)
tends to look better than one that rounds differently.

    python bench/compute_accuracy.py            # ~5 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from compute import synthetic_tasks  # noqa: E402

import fedmeta.metalearning as ml  # noqa: E402
import fedmeta.metalearning.models as models  # noqa: E402
from fedmeta.metalearning import Task  # noqa: E402


@contextlib.contextmanager
def torch_nhwc_batch_norm() -> Iterator[None]:
    """Swap fedmeta's cascade-summed channels-last batch norm for PyTorch's kernel."""
    original = models._BatchNormNHWC.apply

    def native(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, w, b, training=True)

    models._BatchNormNHWC.apply = native  # type: ignore[method-assign]
    try:
        yield
    finally:
        models._BatchNormNHWC.apply = original  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=2, help="tasks per draw")
    ap.add_argument("--ways", default="5,20")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(
        "| way | steps | order | vmap (NCHW) | fedmeta fused "
        + "| fused with PyTorch's NHWC batch norm |"
    )
    print("|---|---|---|---|---|---|")
    ways = [int(w) for w in a.ways.split(",")]
    for n_way, steps, order in itertools.product(ways, (1, 5), ("first", "second")):
        model = ml.ConvNet4(n_way)
        params = ml.init_params(model, 0)
        errs: dict[str, list[float]] = {"vmap": [], "fused": [], "torch": []}
        for seed in range(a.seeds):
            t = synthetic_tasks(a.tasks, n_way, 1, 15, seed, torch.device("cpu"))
            kw = dict(inner_steps=steps, first_order=order == "first", device="cpu")
            ref = ml.per_task_grads(
                model.double(),
                {k: v.double() for k, v in params.items()},
                Task(t.support_x.double(), t.support_y, t.query_x.double(), t.query_y),
                method="vmap",
                **kw,
            )
            model.float()

            def err(
                method: str,
                t: Task = t,
                kw: dict = kw,
                ref: torch.Tensor = ref,
                model: torch.nn.Module = model,
                params: dict = params,
            ) -> float:
                g = ml.per_task_grads(model, params, t, method=method, **kw).double()
                return float(((g - ref).norm(dim=1) / ref.norm(dim=1)).max())

            errs["vmap"].append(err("vmap"))
            errs["fused"].append(err("loop"))
            with torch_nhwc_batch_norm():
                errs["torch"].append(err("loop"))
        cells = [
            f"{statistics.median(v):.1e} (max {max(v):.1e})"
            for v in (errs["vmap"], errs["fused"], errs["torch"])
        ]
        print(f"| {n_way} | {steps} | {order} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
