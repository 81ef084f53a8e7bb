"""Adaptive clipping against a fixed bound, at the same epsilon: the default job, or any config.

Each variant runs ``fedmeta simulate`` (in-process grid) in its own subprocess, with its own state
directory (the budget belongs to the data, so variants must not share a ledger) and output
directory, and the table reports the final test metric with its 95% CI, the last clip bound and
the wall time. The noise multiplier is calibrated by each run for the same budget, so every row is
at the same epsilon.

    python bench/adaptive_clipping.py                       # default sinusoid job, seeds 0 and 1
    python bench/adaptive_clipping.py --seeds 0 1 2 --json
    python bench/adaptive_clipping.py --config configs/omniglot-5way-cpu.toml --set rounds=100
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
REPO = _HERE.parent

ADAPTIVE = "privacy.adaptive_clipping.enabled=true"
#: name -> overrides. ``fixed``: the configured bound (default C = 1).
VARIANTS: dict[str, list[str]] = {
    "fixed": [],
    "adaptive_q50": [ADAPTIVE],
    "adaptive_q90": [ADAPTIVE, "privacy.adaptive_clipping.target_quantile=0.9"],
    "fixed_c6": ["privacy.clip=6"],
}


def run(
    variant: str, seed: int, config: str | None, extra: list[str], root: Path
) -> dict[str, Any]:
    """One ``fedmeta simulate`` run; its summary's numbers."""
    out, state = root / f"{variant}-{seed}", root / f"state-{variant}-{seed}"
    sets = ["federation.backend=inprocess", "output.plots=false", "output.progress=false",
            f"seed={seed}", *VARIANTS[variant], *extra]  # fmt: skip
    cmd = [sys.executable, "-m", "fedmeta.cli", "simulate", "--out", str(out)]
    if config:
        cmd += ["--config", config]
    for item in sets:
        cmd += ["--set", item]
    env = {"FEDMETA_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    done = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{variant} seed {seed} failed:\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    adaptive = summary.get("adaptive_clipping") or {}
    return {
        "variant": variant,
        "seed": seed,
        "metric": summary["metric"],
        "final": summary["final_metric"],
        "ci95": summary["final_metric_ci95_halfwidth"],
        "epsilon": summary["epsilon_spent"],
        "noise_multiplier": summary["noise_multiplier"],
        "last_clip": adaptive.get("last_clip", summary["clip"]),
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every variant for every seed; print a markdown table (or JSON lines)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", action="append", default=[], dest="extra")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedmeta-adaptive-") as tmp:
        for seed in args.seeds:
            for variant in args.variants:
                row = run(variant, seed, args.config, args.extra, Path(tmp))
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    if not args.json:
        print("| variant | seed | z | epsilon | test metric (95% CI) | last C | seconds |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['seed']} | {r['noise_multiplier']:.4f} | "
                  f"{r['epsilon']:.3f} | {r['metric']} {r['final']:.4f} +- {r['ci95']:.4f} | "
                  f"{r['last_clip']:.3g} | {r['seconds']} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
