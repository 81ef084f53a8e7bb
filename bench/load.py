"""Load and long runs: 10,000 participants with 100,000 tasks, and a 10,000-round soak.

    python bench/load.py scale --backend inprocess --participants 10000 --rounds 20
    python bench/load.py scale --backend inprocess --participants 10000 --tasks 100 --rounds 20
    python bench/load.py scale --backend ray --participants 10000 --rounds 10
    python bench/load.py soak --rounds 10000

``scale`` runs a private sinusoid federation of ``--participants`` participants holding ``--tasks``
tasks (default 10) each and reports seconds per round (after the first, which registers
everyone) and the driver's peak and final RSS. ``soak`` runs many short rounds in-process and
samples RSS every ``--every`` rounds, then checks that the ledger, the exporter's view of it and
the final checkpoint agree with the run's summary. Results are JSON lines on stdout
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/accounting.py would shadow the accounting package when this script is run from bench/.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from fedmeta.config_io import load_config  # noqa: E402


def rss_mib() -> float:
    """The current resident set size of this process (Linux /proc)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """An observer that timestamps round ends and samples memory."""

    def __init__(self, every: int) -> None:
        self.every, self.ends, self.memory = every, [], []  # type: ignore[var-annotated]

    def run_started(self, event: Any) -> None:
        self.start = time.perf_counter()

    def round_finished(self, outcome: Any) -> None:
        self.ends.append(time.perf_counter())
        if outcome.round % self.every == 0:
            self.memory.append((outcome.round, round(rss_mib(), 1)))

    def run_finished(self, event: Any) -> None:
        pass


def _config(args: argparse.Namespace, participants: int, rounds: int, extra: list[str]) -> Any:
    return load_config(None, [
        f"federation.participants={participants}", f"federation.backend={args.backend}",
        "sampling.participants_per_round=10", "sampling.task_rate=0.1",
        f"dataset.tasks_per_participant={args.tasks}", f"rounds={rounds}",
        "privacy.noise_multiplier=1.0", "privacy.epsilon_budget=1000", "dataset.test_tasks=50",
        "dataset.validation_tasks=10",
        "dataset.probe_tasks=0", "output.progress=false", "output.plots=false",
        "federation.register_timeout_s=3600", "federation.round_timeout_s=600", *extra,
    ])  # fmt: skip


def scale(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per round and memory at ``--participants`` participants."""
    cfg = _config(args, args.participants, args.rounds,
                  ["training.eval_every=1000000", "privacy.report_every=1000000"])  # fmt: skip
    clock = Clock(every=max(args.rounds // 4, 1))
    out = Path(tempfile.mkdtemp(prefix="fedmeta-load-")) / "run"
    started = time.perf_counter()
    result = _run(cfg, out, clock)
    per_round = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    return {
        "bench": "scale", "backend": args.backend, "participants": args.participants,
        "tasks": args.participants * args.tasks, "rounds": result.summary["rounds_completed"],
        "first_round_s": round(clock.ends[0] - clock.start, 2),
        "seconds_per_round_median": round(sorted(per_round)[len(per_round) // 2], 4),
        "total_s": round(time.perf_counter() - started, 1),
        "driver_peak_rss_mib": round(peak_mib(), 1), "driver_final_rss_mib": round(rss_mib(), 1),
    }  # fmt: skip


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Many rounds: memory stays flat, ledger, exporter and checkpoint stay consistent."""
    import sqlite3

    from fedmeta.accounting import BudgetLedger
    from fedmeta.checkpoint import read_checkpoint

    ledger = Path(tempfile.mkdtemp(prefix="fedmeta-soak-")) / "ledger.sqlite"
    cfg = _config(args, 20, args.rounds, [
        "training.eval_every=1000", "privacy.report_every=1000", "training.checkpoint_every=250",
        f"privacy.ledger_path={ledger}", "privacy.noise_multiplier=50",
    ])  # fmt: skip
    clock = Clock(every=args.every)
    out = ledger.parent / "run"
    result = _run(cfg, out, clock)
    ckpt = read_checkpoint(out)
    spends = sqlite3.connect(ledger).execute("SELECT count(*) FROM spends").fetchone()[0]
    fed = result.summary["federation_id"]
    with BudgetLedger.open_readonly(ledger, fed) as view:  # what the exporter reads
        exporter_eps = view.epsilon()
    return {
        "bench": "soak", "rounds": result.summary["rounds_completed"], "ledger_spends": spends,
        "checkpoint_next_round": ckpt.next_round,
        "checkpoint_outcomes": len(ckpt.outcomes),
        "summary_epsilon": result.summary["epsilon_spent"], "exporter_epsilon": exporter_eps,
        "consistent": spends == result.summary["rounds_completed"] == ckpt.next_round
        and abs(exporter_eps - result.summary["epsilon_spent"]) < 1e-9,
        "rss_mib_by_round": clock.memory,
        "seconds_per_round_median": round(
            sorted(b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False))[
                len(clock.ends) // 2], 4),
    }  # fmt: skip


def _run(cfg: Any, out: Path, clock: Clock) -> Any:
    from fedmeta.server.app import execute

    if cfg.federation.backend == "inprocess":
        from fedmeta.simulation.local_grid import InProcessGrid

        return execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=out,
                       observers=[clock], echo=False)  # fmt: skip
    import fedmeta.server.app
    from fedmeta.simulation.simulate import main as simulate

    # The Ray path builds its observers inside the simulation: hand it this clock instead.
    fedmeta.server.app.make_observers = lambda cfg, progress=None: [clock]  # type: ignore[assignment]
    return simulate(cfg, out_dir=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("scale")
    p.add_argument("--backend", choices=("inprocess", "ray"), default="inprocess")
    p.add_argument("--participants", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--tasks", type=int, default=10, help="tasks per participant")
    p = sub.add_parser("soak")
    p.add_argument("--rounds", type=int, default=10_000)
    p.add_argument("--every", type=int, default=500)
    p.set_defaults(backend="inprocess", tasks=10)
    args = parser.parse_args()
    os.environ.setdefault("FEDMETA_STATE_DIR", tempfile.mkdtemp(prefix="fedmeta-state-"))
    result = scale(args) if args.command == "scale" else soak(args)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result.update({"machine": platform.machine(), "cpus": os.cpu_count(),
                   "load_average": os.getloadavg(), "date": date})  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
