"""The cost of task-level epsilon after every round (server/fedmeta/server/epsilon_curve.py).

    python bench/epsilon_curve.py compositions --config default \
        --config configs/omniglot-5way-cpu.toml --config "default sampling.stage2=fixed \
        sampling.tasks_per_round=5 sampling.participants_per_round=5 privacy.noise_multiplier=1" \
        --rounds 1,2,10,100,200,300 --repeat 3
    python bench/epsilon_curve.py job --repeat 3 -- --set rounds=200

``compositions``: seconds per composition of the run's event ``k`` times (the value the curve
computes for round ``k``), in a fresh process per repeat (composition.py's caches start empty),
for each configuration's plan at its registered population (every participant with
``dataset.tasks_per_participant`` tasks); a configuration is a TOML path or ``default``, then
``key=value`` overrides.

``job``: ``fedmeta simulate`` (the default job plus the given arguments) with the curve's waits
timed: how long rounds waited for their epsilon (the thread computes it while the round runs),
how many compositions the thread made and their mean time, and the run's wall time; each run in a
fresh working and state directory. ``--baseline`` adds a run with ``privacy.report_every`` large
(epsilon only at round 1, the evaluated rounds and the end) after each, for the wall-time
difference. Prints one JSON line per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _config(spec: str) -> Any:
    """``PATH`` or ``default``, then ``key=value`` overrides, separated by spaces."""
    from fedmeta.config_io import load_config

    name, *overrides = spec.split()
    if name == "default":
        return load_config(None, overrides)
    return load_config(name, ["dataset.path=/unused", *overrides])  # the plan reads no data


def compositions_once(name: str, rounds: list[int]) -> dict[str, Any]:
    """One process: the plan's event, then epsilon after each of ``rounds``, timed."""
    from fedmeta.accounting import Exposures
    from fedmeta.server.plan import build_plan

    cfg = _config(name)
    counts = {str(i): cfg.dataset.tasks_per_participant for i in range(cfg.federation.participants)}
    private = build_plan(cfg, counts).privacy
    assert private is not None
    out: dict[str, Any] = {"config": name, "event": repr(private.event), "seconds": {}}
    for k in rounds:
        t0 = time.perf_counter()
        value = Exposures((((private.event, k),),), cfg.privacy.delta, "task").epsilon()
        out["seconds"][k] = time.perf_counter() - t0
        out.setdefault("epsilon", {})[k] = value
    return out


_TIMED = """
import atexit, json, sys, time
from fedmeta.server import epsilon_curve
from fedmeta.accounting.ledger import projection
waits, computes = [], []
def timed(fn, into):
    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.append(time.perf_counter() - t0)
    return call
epsilon_curve.EpsilonCurve.wait = timed(epsilon_curve.EpsilonCurve.wait, waits)
projection.Exposures.epsilon = timed(projection.Exposures.epsilon, computes)
atexit.register(lambda: print("BENCH " + json.dumps({"waits": waits, "computes": computes}),
                              file=sys.stderr))
from fedmeta.cli import main
sys.argv = ["fedmeta", *sys.argv[1:]]
sys.exit(main())
"""


def job_once(args: list[str]) -> dict[str, Any]:
    """``fedmeta simulate ARGS`` in a fresh directory and state, the curve's waits timed."""
    with tempfile.TemporaryDirectory(prefix="fedmeta-bench-") as tmp:
        work = Path(tmp, "work")
        shutil.copytree(REPO / "configs", work / "configs")
        env = {**os.environ, "FEDMETA_STATE_DIR": str(Path(tmp, "state"))}
        argv = [sys.executable, "-c", _TIMED, "simulate", "--set", "output.progress=false", *args]
        t0 = time.perf_counter()
        res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    found = [line for line in res.stderr.splitlines() if line.startswith("BENCH ")]
    timed = json.loads(found[-1][6:]) if found else {"waits": [], "computes": []}
    waits, computes = timed["waits"], timed["computes"]
    return {
        "args": args, "exit": res.returncode, "wall_s": round(wall, 1),
        "waits": len(waits), "wait_total_s": round(sum(waits), 2),
        "wait_max_s": round(max(waits, default=0.0), 3),
        "compositions": len(computes),
        "composition_mean_s": round(statistics.mean(computes), 3) if computes else None,
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
    }  # fmt: skip


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def _compositions(ns: argparse.Namespace) -> None:
    rounds = ns.rounds
    for name in ns.config:
        runs = []
        for _ in range(ns.repeat):
            code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'bench')!r}); "
                    f"import epsilon_curve as b; "
                    f"print(json.dumps(b.compositions_once({name!r}, {rounds!r})))")  # fmt: skip
            res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                                 text=True, check=True)  # fmt: skip
            runs.append(json.loads(res.stdout.splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
        per_k = {k: _spread([r["seconds"][str(k)] for r in runs]) for k in rounds}
        print(json.dumps({"config": name, "seconds_per_composition_mean_range": per_k,
                          "load_average_1min_at_end": round(os.getloadavg()[0], 1)}))  # fmt: skip


def _job(ns: argparse.Namespace) -> None:
    extra = [w for w in ns.args if w != "--"]
    variants = [extra]
    if ns.baseline:
        variants.append([*extra, "--set", "privacy.report_every=1000000"])
    results: list[list[dict[str, Any]]] = [[] for _ in variants]
    for _ in range(ns.repeat):
        for i, args in enumerate(variants):  # interleaved: a change of load falls on both alike
            results[i].append(job_once(args))
            print(json.dumps(results[i][-1]), flush=True)
    for args, runs in zip(variants, results, strict=True):
        print(json.dumps({"args": args, "wall_s": _spread([r["wall_s"] for r in runs]),
                          "wait_total_s": _spread([r["wait_total_s"] for r in runs]),
                          "wait_max_s": max(r["wait_max_s"] for r in runs)}))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    comp = sub.add_parser("compositions")
    comp.add_argument("--config", action="append", required=True)
    comp.add_argument("--rounds", type=lambda s: [int(x) for x in s.split(",")], required=True)
    comp.add_argument("--repeat", type=int, default=3)
    job = sub.add_parser("job")
    job.add_argument("--repeat", type=int, default=3)
    job.add_argument("--baseline", action="store_true")
    job.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    (_compositions if ns.what == "compositions" else _job)(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
