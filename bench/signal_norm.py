"""The signal of the planner's signal-to-noise proxy: ``d`` and ``G`` on synthetic or public tasks.

    python bench/signal_norm.py --config configs/sinusoid.toml --clip 0.3 1 5 --tasks 2000
    python bench/signal_norm.py --config configs/omniglot-5way-cpu.toml --set dataset.path=DIR \
        --set dataset.split=evaluation --set public.warm_start=true --tasks 1000

``G = || mean_i clip_C(g_i) ||`` is the norm of the mean clipped per-task MAML query gradient at
the configuration's initial meta-parameters (``seed``, ``training.zero_head``) with its training
inner loop (``training.inner_steps``, ``inner_lr``, ``first_order``, the inner guards); ``d`` is
the number of trained parameters. Give both to ``fedmeta privacy plan --dimension d --signal-norm G
--clip C`` (docs/privacy.md, "Planning a run").

Only synthetic or public tasks are used. For the sinusoid: ``--tasks`` fresh tasks from the task
generator with a seed of their own (``seed`` salted with ``SIGNAL_SEED_SALT``, a stream apart from
the participants' numbered tasks and from the server's validation, test and probe sets). For
image data: tasks over the classes the configuration declares public (``dataset.split =
"evaluation"`` with ``public.warm_start = true``: Omniglot's background alphabets), at the
run's initial meta-parameters, which are then the public warm start (from its cache, or computed
as a run would), and over the coordinates ``training.trained_parameters`` trains. Image data
without declared public classes is refused. No gradient is computed on a participant's data, so
what it prints is not a release of private data (building the workload lists the private classes,
as a run does, to check that the public ones are disjoint from them).

Besides ``G`` it prints what says how far the proxy's assumptions hold: the median pre-clip task
norm and the fraction of tasks clipped (the proxy's sampling term is exact when every task is
clipped), ``E||clip_C(g_i)||^2`` (the sampling term uses ``C^2``), and the cosine between the mean
clipped and the mean unclipped gradient (clipping bias in direction, which ``G`` does not count).
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

#: Salt of the tasks' seed: not 0x5EED_0001..3 (the server's validation, test and probe sets).
SIGNAL_SEED_SALT = 0x5EED_0051


def signal_tasks(cfg: Any, public: Any, n_tasks: int) -> Any:
    """``n_tasks`` fresh sinusoid tasks, or tasks over the public classes, on a seed of theirs."""
    from fedmeta.metalearning import SinusoidTasks, sample_tasks

    ds = cfg.dataset
    seed = (cfg.seed * 1_000_003 + SIGNAL_SEED_SALT) % (2**63)
    if ds.name == "sinusoid":
        return SinusoidTasks(ds.shots, ds.query).sample(n_tasks, seed)
    if public is None:
        raise ValueError(
            f"dataset.name {ds.name!r}: image tasks must come from data declared public; set "
            "dataset.split = 'evaluation' and public.warm_start = true (Omniglot's background "
            "alphabets), or measure on the sinusoid"
        )
    return sample_tasks(public, n_way=ds.ways, k_shot=ds.shots, q_query=ds.query,
                        n_tasks=n_tasks, seed=seed, path=(SIGNAL_SEED_SALT,))  # fmt: skip


def measure(cfg: Any, clips: Sequence[float], n_tasks: int) -> dict[str, Any]:
    """``d`` and, per clip bound, ``G`` and the diagnostics of the module docstring."""
    import torch

    from fedmeta.adaptation import inner_kwargs
    from fedmeta.metalearning import per_task_grads
    from fedmeta.workload import build_workload

    if cfg.dataset.name != "sinusoid" and not cfg.public.warm_start:
        signal_tasks(cfg, None, 0)  # refused before any data is read
    wl = build_workload(cfg)
    tasks = signal_tasks(cfg, wl.public_classes, n_tasks)
    grads = per_task_grads(
        wl.model, wl.initial_params(), tasks, first_order=cfg.training.first_order,
        device="cpu", coordinates=wl.trained_coordinates,
        **inner_kwargs(cfg.training, evaluation=False),
    ).to(torch.float64)  # fmt: skip
    norms = grads.norm(dim=1)
    unclipped_mean = grads.mean(dim=0)
    rows = []
    for clip in clips:
        scale = torch.clamp(clip / norms.clamp_min(1e-300), max=1.0)
        clipped = grads * scale[:, None]
        mean = clipped.mean(dim=0)
        cosine = torch.nn.functional.cosine_similarity(mean, unclipped_mean, dim=0)
        rows.append({
            "clip": clip,
            "signal_norm": float(mean.norm()),
            "mean_squared_clipped_norm": float((clipped.norm(dim=1) ** 2).mean()),
            "fraction_clipped": float((norms > clip).double().mean()),
            "cosine_to_unclipped_mean": float(cosine),
        })  # fmt: skip
    return {
        "dataset": cfg.dataset.name,
        "tasks_from": "public classes" if wl.public_classes is not None else "synthetic",
        "public_warm_start": wl.public_summary(),
        "trained_parameters": wl.trained_parameters,
        "dimension": int(grads.shape[1]),
        "tasks": n_tasks,
        "seed_salt": SIGNAL_SEED_SALT,
        "inner": inner_kwargs(cfg.training, evaluation=False),
        "median_task_norm": float(norms.median()),
        "unclipped_mean_norm": float(unclipped_mean.norm()),
        "clips": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print ``d`` and ``G`` per clip bound (one line each, or one JSON object)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=None, help="TOML configuration (default: the "
                   "embedded default of fedmeta simulate)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--clip", type=float, nargs="+", default=None,
                   help="clip bounds C (default: the configuration's privacy.clip)")  # fmt: skip
    p.add_argument("--tasks", type=int, default=2000, help="tasks (default 2000)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    from fedmeta.config_io import load_config

    try:
        cfg = load_config(args.config, args.overrides)
        clips = args.clip or [cfg.privacy.clip]
        if args.tasks < 1:
            raise ValueError(f"--tasks must be >= 1; got {args.tasks}")
        for c in clips:
            if not (math.isfinite(c) and c > 0):
                raise ValueError(f"--clip must be positive and finite; got {c}")
        result = measure(cfg, clips, args.tasks)
    except ValueError as error:
        print(f"bench/signal_norm.py: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"d = {result['dimension']} trained parameters; {args.tasks} {result['tasks_from']} "
          f"tasks; median "
          f"task norm {result['median_task_norm']:.4g}")  # fmt: skip
    for row in result["clips"]:
        print(f"C = {row['clip']:g}: G = {row['signal_norm']:.4g} (clipped "
              f"{row['fraction_clipped']:.0%}, cosine to unclipped mean "
              f"{row['cosine_to_unclipped_mean']:.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
