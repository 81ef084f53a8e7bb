"""Privacy-utility results (docs/results.md): every number there comes from one of these commands.

    python bench/results.py sinusoid  --out results/sinusoid.jsonl     # MSE against epsilon
    python bench/results.py two-stage --out results/two-stage.jsonl    # sampler trade-off
    python bench/results.py plot results/sinusoid.jsonl results/two-stage.jsonl --png docs/img
    python bench/results.py sinusoid --epsilons 8 --repeats 5 --out results/sinusoid-repeats.jsonl
    python bench/results.py summary results/sinusoid-repeats.jsonl     # mean, range, ratio
    python bench/results.py summary results/sinusoid-repeats20.jsonl --subset 5  # 5-run pass rate
    python bench/results.py from-run runs/DIR --name NAME --config CFG --set ... --out OUT.jsonl
    python bench/results.py plot results/omniglot-5way-cpu*.jsonl --figure omniglot-5way-cpu
    python bench/results.py sinusoid --epsilons 8 --set sampling.participants_per_round=20 ...
    python bench/results.py sinusoid --name omniglot-5way-cpu \
        --config configs/omniglot-5way-cpu.toml --epsilons 8 1.5 \
        --set dataset.path=/path/to/omniglot --out results/omniglot-5way-cpu.jsonl

``sinusoid`` runs ``configs/sinusoid.toml`` (the default main job) privately at each ``--epsilons``
value and once without privacy, all for the same number of rounds, and records the post-adaptation
test metric (MSE, or accuracy for image data) over the held-out test tasks with its 95% confidence
interval; with ``--config`` and ``--name`` it does the same for any configuration (the Omniglot
rows). ``two-stage`` runs the same federation under three samplers at equal expected lot: every
participant every round (flat Poisson), two-stage with Poisson stage 2, and two-stage with fixed-
size stage 2, each calibrated by the accountant to the target epsilon. Each run has its own ledger
(runs on the same data would otherwise compose against one budget, as they must in production).
Output: one JSON object per run.

A first SIGINT or SIGTERM (a time limit's) stops the run in progress (a round not yet spent is
abandoned, one already spent finishes): it is still evaluated and recorded, with
``stopped_reason`` "interrupted" and its ``rounds_completed``, and no further run starts;
``summary`` keeps such runs in groups of their own and ``plot`` leaves them out. A second signal
aborts. ``--keep DIR`` keeps the runs' directories there instead of ``runs/bench-results``.

``from-run DIR`` records a run that ``fedmeta simulate`` made itself, for one too long for one
sitting (``--out DIR``, then ``--resume --out DIR``): the same fields from its ``summary.json``,
with ``--set`` the settings it ran with and its wall time unknown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# bench/accounting.py would shadow the accounting package when run from bench/.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
REPO = _HERE.parent

QUIET = ["federation.backend=inprocess", "output.progress=false", "output.plots=false"]


def run_one(
    config: Path, overrides: list[str], work: Path, stop: threading.Event | None = None
) -> dict[str, Any]:
    """One simulated federation; its summary's result fields and wall time.

    ``stop`` set stops the run (a round not yet spent is abandoned, one spent finishes); it is
    evaluated and summarised as usual (``stopped_reason`` "interrupted", ``rounds_completed`` below
    the plan).
    """
    from fedmeta.config_io import load_config
    from fedmeta.simulation.simulate import main

    tag = f"run-{len(list(work.iterdir()))}"
    # An experiment (public benchmark data) has a ledger of its own by name; otherwise each run
    # is given a fresh ledger file of its own in the work directory.
    own = [] if any(o.startswith("privacy.experiment=") for o in overrides) else [
        f"privacy.ledger_path={work / (tag + '.ledger.sqlite')}"]
    sets = [*QUIET, *own, *overrides]
    t0 = time.perf_counter()
    cfg = load_config(config, sets)
    s = main(cfg, out_dir=work / tag, stop=stop).summary
    return {
        "overrides": [portable(o) for o in overrides],
        **{k: s.get(k) for k in SUMMARY_FIELDS},
        "max_tasks_per_example": group_size(cfg),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


#: What a record keeps of a run's summary.json.
SUMMARY_FIELDS = ("metric", "final_metric", "final_metric_ci95", "final_metric_ci95_method",
                  "final_metric_median", "adaptation_diverged_tasks", "adaptation",
                  "starting_metric", "starting_model", "epsilon_spent", "delta", "rounds_completed",
                  "noise_multiplier", "normaliser", "stopped_reason",
                  "public_warm_start", "trained_parameters", "model_selection",
                  # what the test evaluation had seen (issue 42; null in a private run unless
                  # released: docs/privacy.md "What the test evaluation had seen")
                  "seen_fraction", "held_out", "seen_note", "subspace",
                  # the guarantee's level and a sample-level run's constants (issue 53)
                  "level", "sample_level")  # fmt: skip


def record_run_dir(
    kind: str, run_dir: Path, config: Path, overrides: list[str], out: Path
) -> dict[str, Any]:
    """Append the record of a run made by ``fedmeta simulate`` itself (resumed across sessions).

    A run too long for one sitting (the paper scale on a lent GPU) runs as ``fedmeta simulate
    --out DIR`` and ``--resume --out DIR``; this records it like the runs above, from its
    ``summary.json``: ``overrides`` are the settings it ran with (they group records), its wall
    time is not known (``wall_s`` null), ``machine`` is this one's.
    """
    from fedmeta.config_io import load_config

    summary = json.loads((run_dir / "summary.json").read_text())
    rec = {
        "overrides": [portable(o) for o in overrides],
        **{k: summary.get(k) for k in SUMMARY_FIELDS},
        "max_tasks_per_example": group_size(load_config(config, overrides)),
        "wall_s": None,
        "run_dir": run_dir.name,
        **provenance(kind, config, machine_description()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        sink.write(json.dumps(rec) + "\n")
    return rec


def portable(override: str) -> str:
    """``override`` as recorded: a path outside the checkout is written as ``data/<its name>``.

    A record is read on other machines; this one's directories mean nothing there (and name its
    user). The data's identity, not its place, is what the run depended on (summary's federation).
    """
    key, _, value = override.partition("=")
    path = Path(value)
    if not key.endswith("path") or not path.is_absolute():
        return override
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else Path("data", path.name)
    return f"{key}={where}"


def group_size(cfg: Any) -> int:
    """Most tasks one example appears in: the example-level group size of a task-level guarantee."""
    from fedmeta.workload import build_workload

    return int(build_workload(cfg).task_set.max_tasks_per_example)


def sinusoid_runs(
    epsilons: list[float], rounds: int | None, baseline: bool = True
) -> Iterator[list[str]]:
    base = [] if rounds is None else [f"rounds={rounds}"]
    if baseline:
        yield [*base, "privacy.enabled=false"]
    for eps in epsilons:
        yield [*base, f"privacy.epsilon_budget={eps}"]


def two_stage_runs(epsilons: list[float], rounds: int | None) -> Iterator[list[str]]:
    """Equal expected lot (80 tasks a round from 20 participants of 200 tasks each)."""
    base = [] if rounds is None else [f"rounds={rounds}"]
    samplers = [
        # flat Poisson: every participant every round, q2 = 0.02
        [
            "sampling.participants_per_round=20",
            "sampling.stage2=poisson",
            "sampling.task_rate=0.02",
        ],
        # two-stage Poisson: 4 of 20, q2 = 0.1
        ["sampling.participants_per_round=4", "sampling.stage2=poisson", "sampling.task_rate=0.1"],
        # two-stage fixed-size: 4 of 20, n2 = 20
        [
            "sampling.participants_per_round=4",
            "sampling.stage2=fixed",
            "sampling.tasks_per_round=20",
        ],
    ]
    for eps in epsilons:
        for sets in samplers:
            yield [*base, *sets, f"privacy.epsilon_budget={eps}"]


# Each run's directory (checkpoint, rounds.csv, summary.json, ledger) is kept here so that a
# result can be re-evaluated later (``fedmeta evaluate --checkpoint``); runs/ is not committed.
KEEP = REPO / "runs" / "bench-results"


def _stop_on_signals(stop: threading.Event) -> Any:
    """First SIGINT/SIGTERM: ``stop`` is set, so the run in progress stops and is still recorded
    (marked interrupted), and no further run starts. Second: abort at once. Returns a function
    that restores the previous handlers.

    A run cut short by a time limit (a lent GPU's, a CI job's) then leaves a record of what it
    reached instead of nothing.
    """

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("stopping: a round not yet spent is abandoned; the run is recorded as interrupted "
              "(signal again to abort)", file=sys.stderr, flush=True)  # fmt: skip

    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signal handlers can only be set from the main thread
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, old) for sig, old in previous.items()]


def provenance(kind: str, config: Path, machine: str) -> dict[str, str]:
    """The fields every record ends with: experiment, configuration, date and machine."""
    where = config.relative_to(REPO) if config.is_relative_to(REPO) else config
    now = datetime.now(UTC).isoformat(timespec="minutes")
    return {"experiment": kind, "config": str(where), "date": now, "machine": machine}


def machine_description() -> str:
    """Host, architecture, usable cores and accelerator, for the record (a GPU run must say so)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    cores = len(os.sched_getaffinity(0))
    return f"{platform.node()} {platform.machine()}, {cores} cores, {gpu}"


def record(kind: str, runs: Iterator[list[str]], config: Path, out: Path, keep: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    keep.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    restore = _stop_on_signals(stop)
    try:
        with out.open("a") as sink:
            for overrides in runs:
                if stop.is_set():
                    break
                work = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=keep))
                rec = run_one(config, overrides, work, stop)
                # Outside the checkout only the folder's name: this machine's paths mean nothing
                # elsewhere (and may name its user).
                rec["run_dir"] = str(
                    work.relative_to(REPO) if work.is_relative_to(REPO) else work.name
                )
                rec |= provenance(kind, config, machine)
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
                print(json.dumps(rec), flush=True)
    finally:
        restore()


def summarise(paths: list[Path]) -> list[dict[str, Any]]:
    """Mean, median, range, diverged tasks and runs of repeated runs, by experiment and overrides.

    The data's place (``dataset.path``) is left out of the grouping; every other override counts.

    Every run counts: a run whose mean is not finite makes its group's mean not finite (it is
    reported, not dropped); runs stopped early (interrupted) form groups of their own, flagged, and
    are never a baseline. ``ratio`` is a group's mean over the non-private group's mean of the
    same experiment (and the same overrides apart from the privacy ones), when there is one.
    """
    import math
    import statistics

    recs = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line]
    groups: dict[tuple[str, tuple[str, ...], bool], list[dict[str, Any]]] = {}
    for r in recs:
        # A run stopped before its plan ended is its own group, never averaged with whole runs.
        cut = r.get("stopped_reason") == "interrupted"
        # Where the data was read from is not a setting: the same data at another place groups.
        settings = tuple(o for o in r["overrides"] if not o.startswith("dataset.path="))
        groups.setdefault((r["experiment"], settings, cut), []).append(r)
    rows = []
    for (kind, overrides, cut), runs in groups.items():
        values = [float(r["final_metric"]) for r in runs]
        rows.append({
            "experiment": kind, "overrides": list(overrides), "interrupted": cut,
            "rounds_completed": [r.get("rounds_completed") for r in runs], "runs": len(values),
            "mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "median": statistics.median(values), "values": values,
            "task_medians": [r.get("final_metric_median") for r in runs],
            "diverged_tasks": sum(int(r.get("adaptation_diverged_tasks") or 0) for r in runs),
            # a run with any diverged test task, or whose mean is not finite
            "diverged_runs": sum(bool(r.get("adaptation_diverged_tasks"))
                                 or not math.isfinite(float(r["final_metric"])) for r in runs),
            "private": runs[0]["epsilon_spent"] is not None,
            # per run: the fraction of test items the model had seen (None: not known/released)
            "seen_fraction": [r.get("seen_fraction") for r in runs],
        })  # fmt: skip
    for row in rows:
        rest = [o for o in row["overrides"] if not o.startswith("privacy.")]
        base = [
            b
            for b in rows
            if b["experiment"] == row["experiment"]
            and not b["private"]
            and not b["interrupted"]
            and [o for o in b["overrides"] if not o.startswith("privacy.")] == rest
        ]
        if base and row["private"] and not row["interrupted"]:
            row["ratio_of_means"] = row["mean"] / base[0]["mean"]
            row["worst_run_ratio"] = row["max"] / base[0]["mean"]
            row["_base"] = base[0]["values"]
    return rows


def ratio_interval(private: list[float], base: list[float]) -> tuple[float, float]:
    """95% percentile-bootstrap interval of mean(private) / mean(base), the runs resampled.

    The two groups are resampled independently (they are independent training runs); the seed
    is fixed so that a summary is repeatable from its records.
    """
    import numpy as np
    from scipy import stats

    def ratio(p: Any, b: Any, axis: int = -1) -> Any:
        return np.mean(p, axis=axis) / np.mean(b, axis=axis)

    res = stats.bootstrap((np.asarray(private), np.asarray(base)), ratio, paired=False,
                          vectorized=True, n_resamples=10_000, method="percentile",
                          random_state=np.random.default_rng(0))  # fmt: skip
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def subset_pass_rate(
    private: list[float], base: list[float], k: int, targets: tuple[float, float], draws: int
) -> float:
    """Fraction of random (k private, k non-private) draws of the recorded runs meeting targets.

    ``targets`` is (mean ratio, worst-run ratio): a draw passes when the mean of its k private runs
    is at most ``targets[0]`` times the mean of its k non-private runs and none of the k private
    runs exceeds ``targets[1]`` times that mean. This is how often a done-when stated over k runs
    would pass if run again, estimated from the runs at hand (each draw without replacement).
    """
    import random

    rng = random.Random(0)
    passed = 0
    for _ in range(draws):
        p, b = rng.sample(private, k), rng.sample(base, k)
        base_mean = sum(b) / k
        passed += sum(p) / k <= targets[0] * base_mean and max(p) <= targets[1] * base_mean
    return passed / draws


def add_comparisons(rows: list[dict[str, Any]], subset: int | None,
                    targets: tuple[float, float]) -> None:  # fmt: skip
    """The ratio's bootstrap interval and, with ``subset``, its k-run pass rate, per private row."""
    for row in rows:
        base = row.pop("_base", None)
        if base is None:
            continue
        if row["runs"] >= 2 and len(base) >= 2:
            row["ratio_of_means_ci95"] = ratio_interval(row["values"], base)
        if subset is not None and min(row["runs"], len(base)) >= subset:
            row[f"pass_rate_{subset}_runs"] = subset_pass_rate(
                row["values"], base, subset, targets, draws=20_000
            )
            row["targets"] = list(targets)


def _label(rec: dict[str, Any], with_experiment: bool) -> str:
    """The series name: the sampling overrides, after the experiment's name if asked."""
    sets = [o.split(".", 1)[1] for o in rec["overrides"] if o.startswith("sampling.")]
    parts = [rec["experiment"]] if with_experiment else []
    if sets:
        parts.append(", ".join(sets))
    return ": ".join(parts) or "default sampler"


def _figure(recs: list[dict[str, Any]], png: Path, prefix_series: bool) -> None:
    """One plot: the metric against epsilon, a series per sampler, non-private runs as lines."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "bench/results.py: the figure needs matplotlib, fedmeta's plots extra: "
            "pip install 'fedmeta[plots]' (scripts/install.sh installs it)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[float, float, float]]] = {}
    for r in recs:
        name = _label(r, prefix_series)
        if r["epsilon_spent"] is None:
            ax.axhline(r["final_metric"], ls="--", c="grey", label=f"non-private ({name})")
            continue
        lo, hi = r["final_metric_ci95"]
        series.setdefault(name, []).append((r["epsilon_spent"], r["final_metric"], hi - lo))
    for name, pts in series.items():
        pts.sort()
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] / 2 for p in pts],
                    marker="o", capsize=3, label=name)  # fmt: skip
    deltas = sorted({r["delta"] for r in recs if r.get("delta")}) or [1e-5]
    metric = recs[0].get("metric") or "mse"
    ax.set_xscale("log")
    ticks = sorted({round(pt[0], 1) for pts in series.values() for pt in pts})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(f"task-level epsilon (delta = {', '.join(f'{d:g}' for d in deltas)})")
    ax.set_ylabel("test MSE after adaptation" if metric == "mse" else f"test {metric}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot(paths: list[Path], png_dir: Path, figure: str | None = None) -> None:
    """A figure per experiment, or all the records in one figure named ``figure``."""
    recs = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line]
    # A run stopped before its plan ended would sit at a lower epsilon as if it were whole.
    recs = [r for r in recs if r.get("stopped_reason") != "interrupted"]
    png_dir.mkdir(parents=True, exist_ok=True)
    if figure is not None:
        _figure(recs, png_dir / f"results-{figure}.png", prefix_series=True)
        return
    for kind in sorted({r["experiment"] for r in recs}):
        mine = [r for r in recs if r["experiment"] == kind]
        _figure(mine, png_dir / f"results-{kind}.png", prefix_series=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("experiment", choices=["sinusoid", "two-stage", "plot", "summary", "from-run"])
    ap.add_argument(
        "inputs", nargs="*", type=Path, help="plot, summary: JSON-lines files; from-run: run dirs"
    )
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "sinusoid.toml")
    ap.add_argument("--epsilons", type=float, nargs="*", default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--rounds", type=int, default=None, help="default: the config's")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="an override applied to every run (repeatable)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1, help="run each setting this many times")
    ap.add_argument("--no-baseline", action="store_true", help="sinusoid: skip the non-private run")
    ap.add_argument(
        "--subset",
        type=int,
        default=None,
        metavar="K",
        help="summary: how often K private and K non-private runs drawn from the "
        "records meet --targets",
    )
    ap.add_argument(
        "--targets",
        type=float,
        nargs=2,
        default=[1.15, 1.4],
        metavar=("MEAN", "WORST"),
        help="summary: mean ratio and worst-run ratio targets (issue 19's 1.15, 1.4)",
    )
    ap.add_argument("--name", default=None, help="the experiment's name in the records and plot")
    ap.add_argument("--figure", default=None, help="plot: every input in one figure of this name")
    ap.add_argument("--out", type=Path, default=Path("results") / "results.jsonl")
    ap.add_argument("--png", type=Path, default=REPO / "docs" / "img")
    ap.add_argument("--keep", type=Path, default=KEEP, help="where each run's directory is kept")
    args = ap.parse_args()
    if args.experiment == "plot":
        plot(args.inputs, args.png, args.figure)
        return 0
    if args.experiment == "summary":
        rows = summarise(args.inputs)
        add_comparisons(rows, args.subset, (args.targets[0], args.targets[1]))
        for row in rows:
            print(json.dumps(row))
        return 0
    if args.experiment == "from-run":
        for run_dir in args.inputs:
            rec = record_run_dir(args.name or "from-run", run_dir, args.config.resolve(),
                                 args.sets, args.out)  # fmt: skip
            print(json.dumps(rec))
        return 0
    if args.experiment == "sinusoid":
        runs = sinusoid_runs(args.epsilons, args.rounds, baseline=not args.no_baseline)
    else:
        runs = two_stage_runs(args.epsilons, args.rounds)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1; got {args.repeats}")
    plan = ([*args.sets, *sets] for sets in runs for _ in range(args.repeats))
    record(args.name or args.experiment, plan, args.config.resolve(), args.out, args.keep.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
