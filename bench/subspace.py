"""How much of the private signal a public gradient subspace keeps (issue 42, item 3: measured).

    python bench/subspace.py --config configs/omniglot-5way-cpu.toml --set dataset.path=DIR \
        --set dataset.split=evaluation --set public.warm_start=true --k 16 64 256 --repeats 3

Gradient embedding perturbation (Yu, Zhang, Chen, Yin, Liu 2021) and projected DP-SGD (Zhou, Wu,
Banerjee 2021) clip and noise each task's gradient in the span of the top ``k`` directions of
gradients computed on public data: the noise then has ``k`` coordinates instead of ``d``, and the
signal is what the subspace keeps. Nothing here trains; at the run's initial meta-parameters (the
public warm start) it measures, per ``k``:

* ``kept``: ``||mean_i clip_C(P g_i)|| / ||mean_i clip_C(g_i)||`` on tasks of the server's
  validation classes (Omniglot's evaluation alphabets, which no participant owns): the signal the
  projected mechanism keeps, relative to the full-space one;
* ``snr_gain``: ``kept * sqrt(d / k)``, the per-round signal-to-noise ratio of the projected
  mechanism over the full-space one at the same ``z``, ``C`` and lot (noise norm ``z C sqrt(k) /
  lot`` against ``z C sqrt(d) / lot``; one Gaussian release per round either way, so the same
  accounting);
* the same ``kept`` on public tasks the basis never saw (in distribution), and per parameter
  tensor the share of the full mean gradient's squared norm and the fraction of it the subspace
  keeps (where the signal lives).

The basis is the top ``k`` right singular vectors of the public tasks' clipped gradients (a
repeat draws other public tasks, seeded apart from the server's validation, test and probe sets).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

#: Salt of the basis tasks' seeds (apart from 0x5EED_0001..3 and signal_norm.py's 0x5EED_0051).
BASIS_SALT = 0x5EED_0061


def _clipped_grads(wl: Any, cfg: Any, tasks: Any) -> Any:
    import torch

    from fedmeta.adaptation import inner_kwargs
    from fedmeta.metalearning import per_task_grads

    inner = inner_kwargs(cfg.training, evaluation=False)
    g = per_task_grads(wl.model, wl.initial_params(), tasks, first_order=cfg.training.first_order,
                       device="cpu", coordinates=wl.trained_coordinates, **inner)  # fmt: skip
    g = g.to(torch.float64)
    return g * torch.clamp(cfg.privacy.clip / g.norm(dim=1).clamp_min(1e-300), max=1.0)[:, None]


def _public_tasks(cfg: Any, wl: Any, n: int, repeat: int, part: int) -> Any:
    from fedmeta.metalearning import sample_tasks

    ds = cfg.dataset
    seed = (cfg.seed * 1_000_003 + BASIS_SALT + 7919 * repeat + part) % (2**63)
    return sample_tasks(wl.public_classes, n_way=ds.ways, k_shot=ds.shots, q_query=ds.query,
                        n_tasks=n, seed=seed, path=(BASIS_SALT, repeat, part))  # fmt: skip


def _kept(basis: Any, grads: Any, clip: float) -> float:
    """``||mean clip_C(P g)|| / ||mean g||`` for already clipped ``grads`` (P: onto the basis)."""
    import torch

    coef = grads @ basis.T  # coordinates in the subspace: ||P g|| = ||coef||
    coef = coef * torch.clamp(clip / coef.norm(dim=1).clamp_min(1e-300), max=1.0)[:, None]
    return float(coef.mean(dim=0).norm() / grads.mean(dim=0).norm())


def _layers(wl: Any, basis: Any, grads: Any) -> list[dict[str, Any]]:
    """Per parameter tensor: its share of the mean gradient's squared norm, and the part kept."""
    mean = grads.mean(dim=0)
    kept = basis.T @ (basis @ mean)
    rows, start = [], 0
    for name, p in wl.model.named_parameters():
        n = p.numel()
        if start + n > mean.numel():
            break
        full, part = mean[start : start + n], kept[start : start + n]
        rows.append({"tensor": name, "share": float(full.norm() ** 2 / mean.norm() ** 2),
                     "kept": float(part.norm() / full.norm().clamp_min(1e-300))})  # fmt: skip
        start += n
    return rows


def measure(cfg: Any, ks: Sequence[int], n_basis: int, n_eval: int, repeat: int) -> dict[str, Any]:
    """One repeat: the basis from ``n_basis`` public tasks, ``kept`` on ``n_eval`` others."""
    import torch

    from fedmeta.workload import build_workload

    wl = build_workload(cfg)
    if wl.public_classes is None:
        raise ValueError("needs declared public classes: dataset.split = 'evaluation' and "
                         "public.warm_start = true")  # fmt: skip
    basis_g = _clipped_grads(wl, cfg, _public_tasks(cfg, wl, n_basis, repeat, 0))
    public_g = _clipped_grads(wl, cfg, _public_tasks(cfg, wl, n_eval, repeat, 1))
    val_g = _clipped_grads(wl, cfg, wl.held_out("validation", n_eval))
    _, _, vh = torch.linalg.svd(basis_g, full_matrices=False)
    d, rows = int(basis_g.shape[1]), []
    for k in ks:
        basis = vh[:k]
        kept = _kept(basis, val_g, cfg.privacy.clip)
        rows.append({"k": k, "kept_validation": kept, "snr_gain": kept * math.sqrt(d / k),
                     "kept_public_unseen": _kept(basis, public_g, cfg.privacy.clip),
                     "layers_validation": _layers(wl, basis, val_g)})  # fmt: skip
    return {"repeat": repeat, "dimension": d, "basis_tasks": n_basis, "eval_tasks": n_eval,
            "clip": cfg.privacy.clip, "public_warm_start": wl.public_summary(),
            "signal_norm_validation": float(val_g.mean(dim=0).norm()), "rows": rows}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Print one JSON line per repeat."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--k", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--basis-tasks", type=int, default=300)
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from fedmeta.config_io import load_config

    cfg = load_config(args.config, args.overrides)
    if max(args.k) > args.basis_tasks:
        print(f"bench/subspace.py: error: --k {max(args.k)} needs --basis-tasks >= it",
              file=sys.stderr)  # fmt: skip
        return 2
    for r in range(args.repeats):
        print(json.dumps(measure(cfg, args.k, args.basis_tasks, args.eval_tasks, r)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
