"""Federation benchmark: rounds/s, server overhead per round, peak memory; 10/100/1000 participants.

Server overhead = wall time of a round minus the time spent inside the ClientApp (client compute),
i.e. budget check, sampling, building requests, validation, ledger spend (SQLite, fsync), noise,
Adam step, probe evaluation and bookkeeping. It is measured with the in-process grid (the same
ServerApp round loop and ClientApp, no transport), where the client time is known exactly. The Ray
rows run Flower's simulation engine end to end (rounds/s with transport; Ray start excluded).

Each configuration runs in its own subprocess so that peak RSS is per configuration.

    python bench/federation.py                 # 10/100/1000 in-process + Ray at 10/100, ~6 min
    python bench/federation.py --quick         # 10/100 in-process only
    python bench/federation.py --json          # one JSON object per line
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ holds scripts named like packages (bench/accounting.py): keep them off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

ROUNDS = 30


def _cfg_args(participants: int, backend: str, rounds: int) -> list[str]:
    n1 = max(2, participants // 10)
    return [
        f"federation.participants={participants}",
        f"sampling.participants_per_round={n1}",
        "sampling.task_rate=0.2",
        "dataset.tasks_per_participant=50",
        f"federation.backend={backend}",
        f"rounds={rounds}",
        "privacy.noise_multiplier=1.0",
        "privacy.epsilon_budget=20",
        "privacy.report_every=10",
        "training.eval_every=1000000",
        "training.checkpoint_every=10",
        "dataset.validation_tasks=8",
        "dataset.test_tasks=8",
        "dataset.probe_tasks=0",
        "output.progress=false",
        "output.plots=false",
        # Round timings are private diagnostics (they depend on how many tasks were sampled).
        "metrics.private_diagnostics=true",
    ]


def _child(participants: int, backend: str, rounds: int) -> dict[str, object]:
    """Run one configuration in this process and measure it."""
    import logging

    logging.disable(logging.WARNING)
    from fedmeta.config_io import load_config
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid
    from fedmeta.simulation.simulate import main

    cfg = load_config(None, _cfg_args(participants, backend, rounds))
    out = Path(tempfile.mkdtemp(prefix="fedmeta-bench-"))
    per_round: list[tuple[float, float, float]] = []
    t0 = time.perf_counter()
    if backend == "inprocess":
        grid = InProcessGrid(participants)

        class Obs:
            last = 0.0

            def run_started(self, e: object) -> None:
                Obs.last = grid.client_seconds

            def round_finished(self, r: Any) -> None:
                client = grid.client_seconds - Obs.last
                Obs.last = grid.client_seconds
                d = r.diagnostics
                per_round.append((d.round_seconds, client, d.aggregation_seconds))

            def run_finished(self, e: object) -> None: ...

        result = execute(cfg, grid, out_dir=out, observers=[Obs()], echo=False)
    else:
        result = main(cfg, out_dir=out)
    wall = time.perf_counter() - t0
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    round_s = [o.diagnostics.round_seconds for o in result.outcomes]
    # Skip the first round (lazy imports, allocator warm-up).
    steady = round_s[1:] if len(round_s) > 1 else round_s
    rec: dict[str, object] = {
        "backend": backend,
        "participants": participants,
        "participants_per_round": cfg.sampling.participants_per_round,
        "rounds": len(result.outcomes),
        "rounds_per_s": len(steady) / sum(steady),
        "round_s_mean": sum(steady) / len(steady),
        "peak_rss_mib": round(rss_self, 1),
        "peak_rss_children_mib": round(rss_children, 1),
        "wall_s_including_setup": round(wall, 1),
    }
    if per_round:
        pr = per_round[1:] if len(per_round) > 1 else per_round
        over = [r - c for r, c, _ in pr]
        rec["server_overhead_s_mean"] = sum(over) / len(over)
        rec["server_overhead_s_max"] = max(over)
        rec["client_compute_s_mean"] = sum(c for _, c, _ in pr) / len(pr)
        rec["aggregation_s_mean"] = sum(a for _, _, a in pr) / len(pr)
    else:
        agg = [o.diagnostics.aggregation_seconds for o in result.outcomes[1:]]
        rec["aggregation_s_mean"] = sum(agg) / max(len(agg), 1)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--child", nargs=2, metavar=("PARTICIPANTS", "BACKEND"))
    args = ap.parse_args()
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}  # fmt: skip
    if args.child:
        rec = _child(int(args.child[0]), args.child[1], args.rounds)
        print("RESULT " + json.dumps(rec), flush=True)
        return 0
    plan = [(10, "inprocess"), (100, "inprocess")]
    if not args.quick:
        plan += [(1000, "inprocess"), (10, "ray"), (100, "ray")]
    print(f"# load average before: {os.getloadavg()}", file=sys.stderr)
    for participants, backend in plan:
        child = [sys.executable, __file__, "--child", str(participants), backend]
        proc = subprocess.run(
            [*child, "--rounds", str(args.rounds)],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"# {participants}/{backend} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rec = json.loads(line[len("RESULT ") :])
        rec["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            overhead = rec.get("server_overhead_s_mean", rec.get("non_transport_s_mean", math.nan))
            print(
                f"{backend:9s} P={participants:5d} n1={rec['participants_per_round']:4d} "
                f"{rec['rounds_per_s']:.2f} rounds/s, overhead {overhead:.3f} s/round, "
                f"peak RSS {rec['peak_rss_mib']} MiB "
                f"(+children {rec['peak_rss_children_mib']} MiB)",
                flush=True,
            )
    print(f"# load average after: {os.getloadavg()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
