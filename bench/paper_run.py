"""DP-MAML's table in one GPU window: a paper configuration's whole run, timed, with GPU samples.

    OMNIGLOT_DIR=/path/to/omniglot python bench/paper_run.py OUT           # 5-way, 250 rounds
    OMNIGLOT_DIR=/path/to/omniglot python bench/paper_run.py OUT --ways 20 # 20-way 1-shot
    OMNIGLOT_DIR=... python bench/paper_run.py OUT --device cpu --set rounds=2 ...  # dry run

Runs ``configs/omniglot-5way-1shot.toml`` (or ``-20way-``) exactly as ``fedmeta simulate
--config CONFIG --experiment NAME --set dataset.path=$OMNIGLOT_DIR --out OUT/run`` would, in this
process, on ``--device`` (``cuda`` by default), with its test evaluation, and writes under OUT:

* ``run/``: the run's own outputs (summary.json, rounds.csv with the per-round private
  diagnostics, which are the round's seconds: Omniglot is public data and the ledger is the
  experiment's own, ``metrics.private_diagnostics = true``);
* ``state/``: a fresh state directory (its experiment ledger), so the command can be rerun with a
  new OUT and never meets an earlier run's spend;
* ``results.jsonl``: the run's results row (``bench/results.py from-run``, docs/results.md);
* ``timing.json``: wall seconds from this command's start to the first round's start
  (``start_s``: imports, data, tasks, calibration), the median and range of the rounds' own
  seconds, the median gap between two rounds' ends (validation every ``training.eval_every``
  rounds included in a few), from the last round to the end (``evaluation_s``: the 600 test tasks,
  trained and untrained), the total, and the task-gradients a second;
* ``gpu.csv``: ``nvidia-smi`` samples every second (timestamp, utilisation %, memory MiB), taken
  in the background for the whole run and ended by its process id; absent without nvidia-smi.

**A machine without internet and without fedmeta installed** (a lent GPU machine holding a copy of
this working tree): the command puts the checkout's source roots first on ``sys.path`` (a plain
checkout imports as is; nothing is built, and an installed fedmeta is not used), and when a
dependency is missing it installs every wheel in ``$WHEELS`` (default ``.device/wheels`` beside
this checkout, a git-ignored folder carried to the machine) with ``pip install --no-index
--no-deps``, then starts again. Anything still missing is one line naming it, exit status 2. So
is a missing ``OMNIGLOT_DIR``, an OUT that already holds a run, or ``--device cuda`` without
CUDA.

A first SIGINT or SIGTERM (a time limit's) stops the run as ``fedmeta simulate`` does (a round not
yet spent is abandoned); what was done is evaluated and recorded, ``stopped_reason``
"interrupted".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

STARTED = time.time()
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = {5: REPO / "configs" / "omniglot-5way-1shot.toml",
           20: REPO / "configs" / "omniglot-20way-1shot.toml"}  # fmt: skip
EXIT_BAD_INPUT = 2
#: Modules the run needs beyond the standard library (their wheels are what $WHEELS must hold).
NEEDED = ("torch", "numpy", "flwr", "grpc", "pydantic", "prometheus_client", "dp_accounting",
          "randomgen", "scipy", "PIL", "cryptography", "httpx")  # fmt: skip
_REEXEC = "FEDMETA_PAPER_RUN_INSTALLED"


def fail(text: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"paper_run: {text}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="output folder (new, or empty)")
    ap.add_argument("--ways", type=int, choices=sorted(CONFIGS), default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="an override after the paper configuration's (repeatable)")  # fmt: skip
    ap.add_argument(
        "--experiment",
        default=None,
        help="the experiment ledger's name (default paper-5way, paper-20way)",
    )
    return ap.parse_args(argv)


def check_inputs(args: argparse.Namespace) -> Path:
    """The Omniglot folder; one line and exit 2 for anything that would fail later."""
    data = os.environ.get("OMNIGLOT_DIR", "")
    if not data:
        fail("set OMNIGLOT_DIR to the folder holding images_background.npz and "
             "images_evaluation.npz (or the official zips)")  # fmt: skip
    folder = Path(data).resolve()
    if not folder.is_dir():
        fail(f"OMNIGLOT_DIR={data}: not a folder")
    if (args.out / "run").exists() or (args.out / "state").exists():
        fail(f"{args.out} already holds a run: give a new OUT (each run starts a fresh ledger)")
    return folder


def ensure_imports() -> None:
    """fedmeta from this checkout, and its dependencies, or one line naming what is missing.

    The checkout's source roots go first on the path whether or not a fedmeta is installed, so
    the code that runs is this tree's (a plain checkout imports as is; nothing is built).
    """
    roots = sorted(str(p.parent) for p in REPO.glob("*/fedmeta") if p.is_dir())
    sys.path[:0] = roots
    before = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*roots, *([before] if before else [])])
    missing = [name for name in NEEDED if not _importable(name)]
    if not missing:
        return
    wheels = Path(os.environ.get("WHEELS", REPO / ".device" / "wheels"))
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found or os.environ.get(_REEXEC):
        fail(f"missing Python packages {', '.join(missing)}: put their wheels (and their "
             f"dependencies') in {wheels} or set WHEELS to such a folder")  # fmt: skip
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet"]
    subprocess.run([*pip, *map(str, found)], check=True)
    os.environ[_REEXEC] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


class Timing:
    """A run observer that notes when each round ends (wall clock), beside the run's own events."""

    def __init__(self) -> None:
        self.round_ends: list[float] = []
        self.round_seconds: list[float] = []
        self.tasks = 0
        self.finished = 0.0

    def run_started(self, event: Any) -> None:  # noqa: D102
        pass

    def round_finished(self, report: Any) -> None:  # noqa: D102
        self.round_ends.append(time.time())
        d = report.diagnostics
        if d is not None:
            self.round_seconds.append(float(d.round_seconds))
            self.tasks += int(d.tasks_received)

    def run_finished(self, event: Any) -> None:  # noqa: D102
        self.finished = time.time()

    def summary(self, ended: float) -> dict[str, Any]:
        """The breakdown written to timing.json (see the module docstring)."""
        ends, seconds = self.round_ends, self.round_seconds
        first_start = ends[0] - seconds[0] if ends and seconds else None
        gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        rounds_wall = (ends[-1] - first_start) if first_start is not None else None
        return {
            "rounds": len(ends),
            "start_s": None if first_start is None else round(first_start - STARTED, 2),
            "round_median_s": round(statistics.median(seconds), 3) if seconds else None,
            "round_range_s": [round(min(seconds), 3), round(max(seconds), 3)] if seconds else None,
            "round_gap_median_s": round(statistics.median(gaps), 3) if gaps else None,
            "rounds_wall_s": None if rounds_wall is None else round(rounds_wall, 2),
            "evaluation_s": round(ended - ends[-1], 2) if ends else None,
            "total_s": round(ended - STARTED, 2),
            "task_gradients": self.tasks,
            "task_gradients_per_s": round(self.tasks / rounds_wall, 1) if rounds_wall else None,
        }


def sample_gpu(out: Path) -> subprocess.Popen[bytes] | None:
    """``nvidia-smi`` every second into gpu.csv, in the background; None where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = "--query-gpu=timestamp,utilization.gpu,memory.used"
    with (out / "gpu.csv").open("wb") as sink:
        sink.write(b"timestamp, utilization_gpu_percent, memory_used_mib\n")
        sink.flush()
        return subprocess.Popen([smi, query, "--format=csv,noheader,nounits", "-lms", "1000"],
                                stdout=sink, stderr=subprocess.DEVNULL)  # fmt: skip


def run(args: argparse.Namespace, data: Path) -> int:
    """The run, its timing and its results row; the exit status of ``fedmeta simulate``."""
    os.environ["FEDMETA_STATE_DIR"] = str((args.out / "state").resolve())
    import torch

    from fedmeta.config_io import load_config
    from fedmeta.server.app import make_observers
    from fedmeta.simulation.simulate import main

    if args.device == "cuda" and not torch.cuda.is_available():
        fail(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; use a GPU "
             "machine, or --device cpu for a dry run")  # fmt: skip
    name = args.experiment or f"paper-{args.ways}way"
    sets = [f"dataset.path={data}", f"federation.client_device={args.device}",
            f"privacy.experiment={name}", "metrics.private_diagnostics=true",
            "output.progress=true", *args.sets]  # fmt: skip
    cfg = load_config(CONFIGS[args.ways], sets)
    timing = Timing()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sampler = sample_gpu(args.out)
    try:
        result = main(cfg, out_dir=args.out / "run", stop=stop,
                      observers=[*make_observers(cfg), timing])  # fmt: skip
    finally:
        if sampler is not None:  # ended by its process id, as it was started
            os.kill(sampler.pid, signal.SIGTERM)
            sampler.wait(timeout=10)
    ended = time.time()
    environment = {"torch": torch.__version__, "python": sys.version.split()[0],
                   "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "config": str(CONFIGS[args.ways].relative_to(REPO)), "overrides": args.sets,
                   "stopped_reason": result.summary.get("stopped_reason")}  # fmt: skip
    record = {**timing.summary(ended), **environment}
    (args.out / "timing.json").write_text(json.dumps(record, indent=2) + "\n")
    _results_row(args, data, name)
    print(json.dumps(record))
    return 0


def _results_row(args: argparse.Namespace, data: Path, name: str) -> None:
    """``bench/results.py from-run``: the run's row in results.jsonl, as docs/results.md records."""
    command = [sys.executable, str(HERE / "results.py"), "from-run", str(args.out / "run"),
               "--name", f"omniglot-{args.ways}way-paper", "--config", str(CONFIGS[args.ways]),
               "--set", f"dataset.path={data}", "--set", f"privacy.experiment={name}",
               *[x for s in args.sets for x in ("--set", s)],
               "--out", str(args.out / "results.jsonl")]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    """Check the inputs, make fedmeta importable, run (see the module docstring)."""
    args = parse_args(argv)
    data = check_inputs(args)
    ensure_imports()
    args.out.mkdir(parents=True, exist_ok=True)
    return run(args, data)


if __name__ == "__main__":
    raise SystemExit(main())
