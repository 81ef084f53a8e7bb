"""Why test-time adaptation diverged, and what the guards change (docs/results.md).

    python bench/adaptation.py runs/bench-results/sinusoid-*/run-0 --tasks 2000 \
        --out results/adaptation-ablation.jsonl

For each kept run directory (``bench/results.py`` keeps them under ``runs/bench-results/``) it
loads the final checkpoint and scores ``--tasks`` held-out test tasks four ways: plain SGD (the
inner loop before the guards), with the support-loss step check, with an inner-gradient clip, and
with both. It also estimates, per task, the largest eigenvalue of the support loss's Hessian at
the meta-parameters (power iteration on Hessian-vector products, ``torch.func``): gradient descent
at rate ``lr`` on a quadratic diverges when ``lr * lambda_max > 2``, so the record says how many
tasks sit past that line and how those tasks' amplitudes (the largest |y| in the task) compare.
Everything here is computed from the released (noisy) model and public test tasks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

VARIANTS = {
    "plain": {"inner_grad_clip": math.inf, "step_check": False},
    "step_check": {"inner_grad_clip": math.inf, "step_check": True},
    "grad_clip_10": {"inner_grad_clip": 10.0, "step_check": False},
    "both": {"inner_grad_clip": 10.0, "step_check": True},
}


def top_eigenvalues(model: Any, params: dict[str, Any], tasks: Any, iters: int = 30) -> Any:
    """Per task, the power-iteration estimate of the support-loss Hessian's largest |eigenvalue|."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    def loss(p: dict[str, Any], x: Any, y: Any) -> Any:
        return F.mse_loss(functional_call(model, p, (x,)), y)

    def one(x: Any, y: Any, v0: dict[str, Any]) -> Any:
        def g_dot_v(p: dict[str, Any], v: dict[str, Any]) -> Any:
            g = grad(loss)(p, x, y)
            return sum((g[k] * v[k]).sum() for k in g)

        def hvp(v: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = grad(g_dot_v)(params, v)
            return out

        v, lam = v0, torch.zeros(())
        for _ in range(iters):
            hv = hvp(v)
            norm = torch.sqrt(sum((t * t).sum() for t in hv.values()))
            lam = sum((a * b).sum() for a, b in zip(v.values(), hv.values(), strict=True))
            v = {k: t / norm.clamp_min(1e-30) for k, t in hv.items()}
        return lam.abs()

    gen = torch.Generator().manual_seed(0)
    n = tasks.support_x.shape[0]
    v0 = {k: torch.randn((n, *t.shape), generator=gen) for k, t in params.items()}
    norms = torch.sqrt(sum((t.reshape(n, -1) ** 2).sum(1) for t in v0.values()))
    v0 = {k: t / norms.reshape(n, *([1] * (t.ndim - 1))) for k, t in v0.items()}
    return vmap(one)(tasks.support_x, tasks.support_y, v0).detach()


def ablate(run_dir: Path, n_tasks: int) -> dict[str, Any]:
    import torch

    from fedmeta.adaptation import inner_kwargs
    from fedmeta.checkpoint import read_checkpoint
    from fedmeta.metalearning import evaluate
    from fedmeta.workload import build_model, held_out_tasks

    state = read_checkpoint(run_dir)
    cfg = state.config
    if cfg.training.meta_sgd:  # the curvature test below assumes one inner rate for every task
        raise SystemExit(f"{run_dir}: a Meta-SGD run (training.meta_sgd) learns its inner rates; "
                         "this ablation needs one fixed inner_lr")  # fmt: skip
    model = build_model(cfg)
    flat = state.released_params().to(torch.float32)  # the model the run tested
    base = inner_kwargs(cfg.training, evaluation=True)
    tasks = held_out_tasks(cfg, "test", n_tasks)
    inner = {k: base[k] for k in ("inner_steps", "inner_lr")}
    rec: dict[str, Any] = {"run_dir": str(run_dir), "private": state.private,
                           "tasks": n_tasks, "inner": inner}  # fmt: skip
    for name, guards in VARIANTS.items():
        r = evaluate(model, flat, tasks, device="cpu", **{**base, **guards})
        rec[name] = {"mean": r.mean, "median": r.median, "ci95": [r.ci95_low, r.ci95_high],
                     "diverged": r.diverged}  # fmt: skip
    from fedmeta.metalearning.models import param_spec, unflatten_params

    params = unflatten_params(flat, param_spec(model))
    lam = top_eigenvalues(model, params, tasks)
    amp = tasks.query_y.abs().amax(dim=(1, 2))
    past = lam * base["inner_lr"] > 2
    rec["curvature"] = {
        "lr_times_lambda_max_median": float((lam * base["inner_lr"]).median()),
        "lr_times_lambda_max_max": float((lam * base["inner_lr"]).max()),
        "tasks_past_2": int(past.sum()),
        "amplitude_median_past_2": float(amp[past].median()) if bool(past.any()) else None,
        "amplitude_median_all": float(amp.median()),
    }
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories holding a checkpoint")
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per run")
    args = ap.parse_args()
    for run_dir in args.runs:
        rec = ablate(run_dir, args.tasks)
        print(json.dumps(rec), flush=True)
        if args.out is not None:
            with args.out.open("a") as sink:
                sink.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
