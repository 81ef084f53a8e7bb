"""Does the planner's signal-to-noise proxy predict accuracy? Sinusoid designs at one budget.

    python bench/snr_proxy.py run --work runs/snr-proxy --repeats 3
    python bench/signal_norm.py --set seed=1 --clip 0.3 1 5 --json > runs/snr-proxy/signal-1.json
    (the same for seed=2 and seed=3: the runs' seeds, so G is taken at their initial models)
    python bench/snr_proxy.py summary --work runs/snr-proxy --signal runs/snr-proxy/signal-*.json \
        --out results/snr-proxy.json

``run`` trains every design of ``DESIGNS`` ``--repeats`` times through ``fedmeta simulate``
(in-process backend, fixed clip, one experiment ledger per run: ``--experiment snr-<design>-<k>``,
seed ``k``), interleaved (repeat 1 of every design, then repeat 2, ...) so that a cut-off leaves
balanced groups; a run whose ``summary.json`` exists is kept. Shortened from the default job:
at most 150 rounds, 200 test and 50 validation tasks. Every design is at epsilon 8, delta 1e-5
(the configuration's budget), and is one the planner expresses (all participants with Poisson
rate ``q``, or two-stage Poisson).

``summary`` calibrates each design with the planner (``accounting.planner.evaluate``, the enforced
accountant: the same ``z`` as the run), computes the old proxy ``z C / (E[lot] sqrt(T))`` and the
signal-to-noise ``SNR * sqrt(T)`` with ``d`` and ``G`` at the design's clip (``G`` averaged over the
``--signal`` files), and the Spearman rank correlation (scipy) of each with the mean test MSE over
a design's runs. The old proxy should correlate positively (more noise, worse MSE), the SNR
negatively.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: name -> the planner's candidate: design, participants per round, task rate, rounds, clip.
DESIGNS: dict[str, tuple[str, int, float, int, float]] = {
    "d1": ("flat_poisson", 20, 0.05, 150, 1.0),
    "d2": ("flat_poisson", 20, 0.01, 150, 1.0),
    "d3": ("flat_poisson", 20, 0.02, 100, 1.0),
    "d4": ("flat_poisson", 20, 0.05, 50, 1.0),
    "d5": ("flat_poisson", 20, 0.05, 150, 0.3),
    "d6": ("flat_poisson", 20, 0.05, 150, 5.0),
    "d7": ("two_stage_poisson", 5, 0.1, 150, 1.0),
    "d8": ("flat_poisson", 20, 0.1, 60, 1.0),
    "d9": ("flat_poisson", 20, 0.005, 150, 1.0),
}


def overrides(design: str, n1: int, q: float, rounds: int, clip: float) -> tuple[str, ...]:
    """The configuration overrides that run a candidate (flat Poisson contacts all 20)."""
    first = (f"sampling.participants_per_round={n1}",) if design == "two_stage_poisson" else ()
    return (*first, f"sampling.task_rate={q}", f"rounds={rounds}", f"privacy.clip={clip}")


#: Shortenings applied to every run (see the module docstring).
COMMON = ("privacy.adaptive_clipping.enabled=false", "dataset.test_tasks=200",
          "dataset.validation_tasks=50", "federation.backend=inprocess")  # fmt: skip


def run_all(work: Path, repeats: int, config: Path) -> None:
    """Every design ``repeats`` times, interleaved; a finished run is skipped."""
    env = {**os.environ, "FEDMETA_STATE_DIR": str(work / "state")}
    for k in range(1, repeats + 1):
        for name, candidate in DESIGNS.items():
            sets = overrides(*candidate)
            out = work / "runs" / f"{name}-{k}"
            if (out / "summary.json").exists():
                continue
            args = [sys.executable, "-m", "fedmeta.cli", "simulate", "--config", str(config),
                    "--experiment", f"snr-{name}-{k}", "--out", str(out)]  # fmt: skip
            for s in (f"seed={k}", *COMMON, *sets):
                args += ["--set", s]
            start = time.monotonic()
            log = work / f"log-{name}-{k}.txt"
            with log.open("w") as stream:
                rc = subprocess.call(args, cwd=REPO, env=env, stdout=stream, stderr=stream)
            print(f"{name} {k} rc={rc} wall={time.monotonic() - start:.0f}s", flush=True)


def signal_norms(files: list[Path]) -> tuple[int, dict[float, float]]:
    """``d`` and, per clip, ``G`` averaged over the files of ``bench/signal_norm.py --json``."""
    loaded = [json.loads(f.read_text()) for f in files]
    dims = {r["dimension"] for r in loaded}
    if len(dims) != 1:
        raise ValueError(f"--signal files must share one dimension; got {sorted(dims)}")
    by_clip: dict[float, list[float]] = {}
    for r in loaded:
        for row in r["clips"]:
            by_clip.setdefault(float(row["clip"]), []).append(float(row["signal_norm"]))
    return dims.pop(), {c: statistics.fmean(v) for c, v in by_clip.items()}


def design_rows(work: Path, signal: list[Path]) -> list[dict[str, Any]]:
    """Per design: the planner's numbers and the runs' test MSE."""
    from fedmeta.accounting.plan_request import Candidate, Federation, PlanBudget, PlanRequest
    from fedmeta.accounting.planner import _Precision, evaluate

    dimension, g_by_clip = signal_norms(signal)
    rows = []
    for name, (design, n1, q, rounds, clip) in DESIGNS.items():
        runs = sorted((work / "runs").glob(f"{name}-*/summary.json"))
        if not runs:
            continue
        summaries = [json.loads(p.read_text()) for p in runs]
        g = g_by_clip[clip]
        request = PlanRequest(PlanBudget(8.0, 1e-5), Federation(20, (200,)), rounds=(rounds,),
                              clip=clip, dimension=dimension, signal_norm=g)  # fmt: skip
        row = evaluate(request, Candidate(design, n1, rounds, task_rate=q),  # type: ignore[arg-type]
                       _Precision("pld", 1e-4, True))  # fmt: skip
        assert not isinstance(row, str), row
        mses = [float(s["final_metric"]) for s in summaries]
        rows.append({
            "design": name, "sampling": f"{n1}/20, q={q:g}", "rounds": rounds, "clip": clip,
            "expected_lot": row.expected_lot, "z": row.noise_multiplier,
            "z_runs": [s["noise_multiplier"] for s in summaries],
            "old_proxy": row.proxy, "signal_norm": g, "dimension": dimension,
            "round_snr": row.round_snr, "run_snr": row.run_snr,
            "test_mse_runs": mses, "test_mse_mean": statistics.fmean(mses),
            "test_mse_median_runs": [s["final_metric_median"] for s in summaries],
            "diverged_tasks": sum(int(s["adaptation_diverged_tasks"]) for s in summaries),
            "epsilon_runs": [s["epsilon_spent"] for s in summaries],
            "runs": [p.parent.name for p in runs],  # names only: no machine path in results/
        })  # fmt: skip
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman rank correlation of each proxy with the mean test MSE over designs.

    Over every design, and over the designs at the most rounds (150): both proxies model rounds
    only through ``sqrt(T)``, so the subset shows how they rank the noise alone.
    """
    from scipy.stats import spearmanr

    most = max(r["rounds"] for r in rows)
    out: dict[str, Any] = {"designs": len(rows)}
    for scope, subset in (("", rows), (f"_at_{most}_rounds", [r for r in rows
                                                             if r["rounds"] == most])):  # fmt: skip
        mse = [r["test_mse_mean"] for r in subset]
        for key in ("old_proxy", "round_snr", "run_snr"):
            result = spearmanr([r[key] for r in subset], mse)
            out[f"spearman_{key}{scope}"] = {
                "rho": float(result.statistic),
                "p": float(result.pvalue),
                "designs": len(subset),
            }
    return out


def markdown(rows: list[dict[str, Any]], correlation: dict[str, Any]) -> str:
    """The table of docs/results.md: one line per design, then the correlations."""
    lines = ["| design | sampling | T | C | E[lot] | z | old proxy | G | SNR/round | SNR*sqrtT "
             "| runs | mean test MSE | range | per run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        mses = r["test_mse_runs"]
        lines.append(
            f"| {r['design']} | {r['sampling']} | {r['rounds']} | {r['clip']:g} | "
            f"{r['expected_lot']:.0f} | {r['z']:.3f} | {r['old_proxy']:.3g} | "
            f"{r['signal_norm']:.3f} | {r['round_snr']:.2f} | {r['run_snr']:.1f} | {len(mses)} | "
            f"**{r['test_mse_mean']:.3f}** | {min(mses):.3f}-{max(mses):.3f} | "
            + ", ".join(f"{m:.3f}" for m in mses)
            + " |"
        )
    lines.append("")
    for key, c in correlation.items():
        if key.startswith("spearman_"):
            lines.append(f"{key}: rho {c['rho']:+.2f} (p = {c['p']:.2f}, {c['designs']} designs)")
    return "\n".join(lines)


def main() -> int:
    """``run`` or ``summary`` (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train every design --repeats times")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--config", type=Path, default=REPO / "configs" / "sinusoid.toml")
    s = sub.add_parser("summary", help="proxies, test MSE and rank correlations as JSON")
    s.add_argument("--work", type=Path, required=True)
    s.add_argument("--signal", type=Path, nargs="+", required=True)
    s.add_argument("--out", type=Path, default=None)
    s.add_argument("--markdown", action="store_true", help="print the docs table, not JSON")
    args = p.parse_args()
    if args.command == "run":
        run_all(args.work, args.repeats, args.config)
        return 0
    rows = design_rows(args.work, args.signal)
    payload = {"rows": rows, "correlation": summarise(rows)}
    text = json.dumps(payload, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(markdown(rows, payload["correlation"]) if args.markdown else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
