"""DP-MAML's table (issue 50), generated from one JSON record a run under results/paper-table/.

    python bench/paper_table.py                 # the table, Markdown, from the committed records
    python bench/paper_table.py --json          # one JSON object a row
    python bench/paper_table.py --check         # exit 1 when README.md / docs/results.md differ
    python bench/paper_table.py --write         # write the table there (between its markers), plot
    OMNIGLOT_DIR=/path/to/omniglot python bench/paper_table.py --run --scale gpu --pack "$OUT"
    OMNIGLOT_DIR=/path/to/omniglot python bench/paper_table.py --run --scale gpu --side-by-side 3
    OMNIGLOT_DIR=/path/to/omniglot nice python bench/paper_table.py --run --scale cpu --ways 5 \
        --rows a c --runs 3
    python bench/paper_table.py --unpack PACK.jsonl   # a device window's records into results/

Rows, for 5-way and 20-way 1-shot Omniglot, all from ``configs/dpmaml-omniglot-{5,20}way.toml``
(DP-MAML's recipe): (a) non-private; (b) DP-MAML's noise, z = 1 on fixed lots (1,600 at the GPU
scale) for the scale's rounds (250), reported with three epsilons: the moments-accountant reading
DP-MAML used (RDP of Poisson sampling at q = lot / tasks), Tombs et al. 2022 Theorem 3 as published
(NOT valid), and the valid one the ledger enforced; (c) the recipe calibrated to a valid
(1.5, 1e-6); (d) a candidate design at a valid (1.5, 1e-6): the recipe from a declared public
warm start (Omniglot's background alphabets, so the evaluation split: other test tasks, which the
table says), Adam 0.001; it was not chosen on validation tasks and is labelled so.

Scales: ``gpu`` is the configuration as written (DP-MAML's scale); ``cpu`` a stated CPU scale of its
own rows (500 tasks a participant, expected lot 20, 15 rounds, 100 test tasks); ``tiny`` the default
suite's seconds-long check of the machinery (its records are never committed).

``--run`` is resumable: a row that already has ``--runs`` whole runs is skipped. Each run is
recorded atomically (written to a temporary file, then renamed) as soon as it ends, and appended to
``--pack DIR``'s ``paper-table-records.jsonl`` (default ``$OUT`` when set), the one file a device
window brings back; ``--unpack`` files those records here. A first SIGINT/SIGTERM stops the run in
progress as bench/results.py does: it is recorded as interrupted (never counted) and no run starts.

``--side-by-side N`` (issue 51) starts a row's missing runs N at a time, each a process of its own
(this script's ``--run-one``) on the same device, as a batch: each run has its own directory, state
directory and experiment ledger (a fresh budget, as one run after another has), and draws its own
sampling and noise from the operating system (the public seed, and so the test tasks and the
starting model, is the row's, as for runs one after another). A signal stops every run of the
batch, each recorded as interrupted (bench/side_by_side.py). Each record says ``side_by_side``
(how many ran together) and its ``batch``; when the batch ends its records are written again with
its throughput: ``batch_wall_s`` (first start to last end), ``batch_runs_wall_sum_s`` (the runs'
own ``wall_s`` summed), ``batch_whole_runs`` and ``batch_runs_per_hour``, and packed again
(``--unpack`` files the later line). The table does not read these fields; ``--throughput`` prints
runs an hour by device, row and N, with the speedup against one run at a time on the same device.

    python bench/paper_table.py --throughput      # one JSON object per (device, row, N)
    python bench/paper_table.py --throughput results/paper-table runs/paper-table-alone
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# bench/side_by_side.py (the child processes of --side-by-side) first: results drops bench/ again.
import side_by_side  # noqa: E402

REPO = HERE.parent
import results  # noqa: E402  (bench/results.py: run_one, provenance, machine; it drops bench/ again)

RECORDS = REPO / "results" / "paper-table"
FORMAT = "fedmeta-paper-table-record-v1"
PACK_NAME = "paper-table-records.jsonl"
DOCS = (REPO / "README.md", REPO / "docs" / "results.md")
START, END = "<!-- paper-table:start (bench/paper_table.py --write) -->", "<!-- paper-table:end -->"
WAYS = (5, 20)
ROWS = ("a", "b", "c", "d")
#: DP-MAML's Table 3 (MAML's column for (a), DP-MAML's at its claimed (1.5, 1e-6) for (b)).
PAPER = {(5, "a"): "99.5", (20, "a"): "96.4", (5, "b"): "93.9", (20, "b"): "88.0"}
WHAT = {
    "a": "non-private, the recipe",
    "b": "DP-MAML's noise: z = 1, fixed lots",
    "c": "the recipe at a valid (1.5, 1e-6)",
    "d": "candidate: public warm start, Adam 0.001, (1.5, 1e-6); not chosen on validation",
}


@dataclass(frozen=True)
class Scale:
    """One scale: overrides on the recipe, and the expected lot and rounds they give."""

    label: str
    sets: tuple[str, ...]
    lot: int  # expected tasks a round (row b: exactly, lot / 20 per participant)
    rounds: int
    warm_steps: int  # row d's public pre-training steps


SCALES = {
    "gpu": Scale("GPU (DP-MAML's scale)", (), 1600, 250, 2000),
    "cpu": Scale("CPU scale (a shared 2-core VM, one thread a run): 500 tasks a participant, "
                 "expected lot 20, 15 rounds, 20 validation and 100 test tasks",
                 ("dataset.tasks_per_participant=500", "rounds=15", "dataset.validation_tasks=20",
                  "dataset.test_tasks=100", "training.eval_every=5"), 20, 15, 50),
    "tiny": Scale("tiny (the test suite's)", ("dataset.tasks_per_participant=50", "rounds=2",
                  "dataset.validation_tasks=4", "dataset.test_tasks=10", "training.eval_every=2",
                  "training.inner_steps=1", "training.eval_inner_steps=1"), 20, 2, 2),
}  # fmt: skip


def config_of(way: int) -> Path:
    return REPO / "configs" / f"dpmaml-omniglot-{way}way.toml"


def row_sets(scale: Scale, row: str, first_order: bool, way: int = 5) -> list[str]:
    """The overrides of one row at one scale (the data's path comes last, apart).

    Row (d) at 20-way splits the evaluation alphabets' characters evenly among the participants:
    whole alphabets (the default) leave one participant 19 characters, too few for a 20-way task.
    """
    sets = [*scale.sets, "sampling.task_rate=" + f"{scale.lot / (20 * _tasks(scale)):g}"]
    if row == "a":
        sets.append("privacy.enabled=false")
    elif row == "b":  # fixed lots of exactly `lot`; a budget wide enough for z = 1 to run them all
        sets += ["sampling.stage2=fixed", f"sampling.tasks_per_round={max(1, scale.lot // 20)}",
                 "privacy.noise_multiplier=1.0", "privacy.epsilon_budget=100"]  # fmt: skip
    elif row == "d":
        sets += ["dataset.split=evaluation", "public.warm_start=true", "training.meta_lr=0.001",
                 f"public.steps={scale.warm_steps}"]  # fmt: skip
        sets += ["dataset.partition=even"] if way == 20 else []
    return [*sets, "training.first_order=true"] if first_order else sets


def _tasks(scale: Scale) -> int:
    found = [s.split("=")[1] for s in scale.sets if s.startswith("dataset.tasks_per_participant=")]
    return int(found[0]) if found else 20_000


# --- one run -------------------------------------------------------------------------------------


def commit() -> str:
    """This checkout's commit (``+dirty``: uncommitted changes); without git, $FEDMETA_COMMIT."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FEDMETA_COMMIT", "unknown")
    return head + ("+dirty" if dirty else "")


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def digests(cfg: Any) -> dict[str, str | None]:
    """The configuration's digest (where the data lies and where outputs go left out), and the
    digests of the test tasks and of the starting model when it is a public warm start."""
    from fedmeta.workload import build_workload

    tree = cfg.to_dict()
    del tree["dataset"]["path"], tree["privacy"]["ledger_path"], tree["output"]
    workload = build_workload(cfg)
    test = workload.held_out("test", cfg.dataset.test_tasks)
    warm = workload.initial_params() if workload.warm_start is not None else None
    return {
        "config_digest": _digest([json.dumps(tree, sort_keys=True).encode()]),
        "test_tasks_digest": _digest([t.contiguous().numpy().tobytes() for t in test]),
        "warm_start_digest": None if warm is None else _digest([warm.numpy().tobytes()]),
    }


def epsilons(cfg: Any, z: float | None, rounds: int) -> dict[str, float | None]:
    """Theorem 3 as published and DP-MAML's moments-accountant reading, for the run's sampler."""
    from fedmeta.accounting import (
        FlatPoissonScheme,
        GaussianRound,
        TwoStageFixedScheme,
        TwoStagePoissonScheme,
        epsilon,
        tombs2022_published_epsilon,
    )

    if z is None or not cfg.privacy.enabled or rounds == 0:
        return {"epsilon_thm3": None, "epsilon_moments": None}
    p, s = cfg.federation.participants, cfg.sampling
    scheme: Any = (TwoStagePoissonScheme(p, cfg.n1, s.task_rate) if s.stage2 == "poisson" else
                   TwoStageFixedScheme(p, cfg.n1, s.tasks_per_round, cfg.min_tasks))  # fmt: skip
    rate = scheme.largest_inclusion_probability  # DP-MAML's q = L / N_train
    # Abadi et al.'s moments accountant is an RDP bound for Poisson sampling at q: DP-MAML applied
    # it to its lots whatever their sampling; dp-accounting's RDP is the same bound on finer orders.
    moments = epsilon([(GaussianRound(FlatPoissonScheme(rate), z), rounds)], cfg.privacy.delta,
                      "task", "rdp")  # fmt: skip
    published = tombs2022_published_epsilon(GaussianRound(scheme, z), rounds, cfg.privacy.delta)
    return {"epsilon_thm3": published, "epsilon_moments": moments}


@dataclass(frozen=True)
class RunSpec:
    """One run of a row: which, where its record goes and where its directory is."""

    key: tuple[str, int, str, bool]  # scale, way, row, first order
    index: int
    data: Path
    records: Path
    work: Path  # the run's own directory (state directory, ledger, outputs)


def new_work(keep: Path, way: int, row: str) -> Path:
    keep.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"paper-{way}-{row}-", dir=keep))


def run_and_record(spec: RunSpec, stop: threading.Event, batch: dict[str, Any]) -> dict[str, Any]:
    """One run of a row, its record (with ``batch``'s fields) written atomically; the record."""
    from fedmeta.config_io import load_config

    scale_name, way, row, first_order = spec.key
    sets = [*row_sets(SCALES[scale_name], row, first_order, way), f"dataset.path={spec.data}"]
    started = datetime.now(UTC).isoformat(timespec="seconds")
    code = commit()  # the code the run starts with: a commit made while it runs is not its code
    # Omniglot is public: each run is an experiment with a ledger of its own, in a state directory
    # of its own, so repeated runs (one after another or side by side) never compose, and it
    # reports what its test tasks had seen. An experiment's ledger is not a production ledger: it
    # is neither entered in the registry of ledgers nor checked against it, so runs side by side on
    # the same data do not refuse each other (server/fedmeta/server/ledger_witness.py).
    os.environ["FEDMETA_STATE_DIR"] = str(spec.work / "state")
    sets.append(f"privacy.experiment=dpmaml-{way}way-{row}")
    out = results.run_one(config_of(way), sets, spec.work, stop)
    cfg = load_config(config_of(way), sets)
    rec = {
        "format": FORMAT, "scale": scale_name, "way": way, "row": row, "first_order": first_order,
        "run": spec.index, "commit": code, "device": results.machine_description(),
        "started": started, "ended": datetime.now(UTC).isoformat(timespec="seconds"),
        "test_accuracy": out["final_metric"], "test_accuracy_ci95": out["final_metric_ci95"],
        "starting_accuracy": out["starting_metric"], "epsilon_valid": out["epsilon_spent"],
        **epsilons(cfg, out["noise_multiplier"], out["rounds_completed"] or 0),
        **digests(cfg), "run_dir": spec.work.name, **out, **batch,
        **results.provenance("paper-table", config_of(way), results.machine_description()),
    }  # fmt: skip
    write_atomically(spec.records / record_name(rec), rec)
    return rec


def record_name(rec: dict[str, Any]) -> str:
    variant = "-first-order" if rec["first_order"] else ""
    cut = "-interrupted" if rec.get("stopped_reason") == "interrupted" else ""
    stamp = rec["started"].replace(":", "").replace("+0000", "Z")
    return f"{rec['scale']}-{rec['way']}way-{rec['row']}{variant}-{stamp}-{rec['run']}{cut}.json"


def write_atomically(path: Path, rec: dict[str, Any]) -> None:
    """The record whole or not at all: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as sink:
        sink.write(json.dumps(rec, indent=1, sort_keys=True) + "\n")
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(tmp, path)


def pack(pack_dir: Path | None, rec: dict[str, Any], name: str = PACK_NAME) -> None:
    """Append ``rec`` to the window's one file (``name`` in ``pack_dir``), as one line, at once."""
    if pack_dir is None:
        return
    pack_dir.mkdir(parents=True, exist_ok=True)
    with (pack_dir / name).open("a") as sink:
        sink.write(json.dumps(rec, sort_keys=True) + "\n")
        sink.flush()
        os.fsync(sink.fileno())


def unpack(
    pack_files: list[Path],
    records: Path,
    fmt: str = FORMAT,
    name_of: Callable[[dict[str, Any]], str] | None = None,
) -> int:
    """File a window's records of format ``fmt`` under ``records``, one file each, named by
    ``name_of`` (default this table's :func:`record_name`). A run packed twice (as it ended, then
    with its batch's throughput) is filed as packed last; a record already here is kept unless the
    packed one only adds fields to it."""
    record_name_of = name_of or record_name
    latest: dict[str, dict[str, Any]] = {}
    for path in pack_files:
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a killed window: that run is lost
                continue
            if rec.get("format") == fmt:
                latest[record_name_of(rec)] = rec
    added = 0
    for name, rec in latest.items():
        here = records / name
        if here.exists():
            old = json.loads(here.read_text())
            if old == rec or any(rec.get(k, object()) != v for k, v in old.items()):
                continue
        write_atomically(here, rec)
        added += 1
    return added


@dataclass(frozen=True)
class Plan:
    """What every run of a ``--run`` shares: the data, where records, run directories and the pack
    go, and how many runs start side by side."""

    data: Path
    records: Path
    keep: Path
    pack: Path | None
    side_by_side: int


def run_rows(args: argparse.Namespace) -> int:
    """Run what each asked row still lacks, ``--side-by-side`` at a time; skip rows that have
    their runs. 130: stopped by a signal; 1: a run ended without a record."""
    data = os.environ.get("OMNIGLOT_DIR")
    if not data or not Path(data).is_dir():
        print("paper_table: set OMNIGLOT_DIR to the Omniglot folder (images_background.npz ...)",
              file=sys.stderr)  # fmt: skip
        return 2
    plan = Plan(Path(data).resolve(), args.records, args.keep.resolve(), args.pack,
                args.side_by_side)  # fmt: skip
    stop = threading.Event()
    children = side_by_side.Children(stop)
    restore = (results._stop_on_signals(stop) if plan.side_by_side == 1
               else side_by_side.forward_signals(stop, children))  # fmt: skip
    try:
        for way in args.ways:
            for row in args.rows:
                key = (args.scale, way, row, args.first_order)
                have = len(whole_runs(load_records(plan.records), key))
                missing = list(range(have + 1, args.runs + 1))
                for at in range(0, len(missing), plan.side_by_side):
                    if stop.is_set():
                        return 130
                    indices = missing[at : at + plan.side_by_side]
                    if not run_batch(key, indices, plan, stop, children):
                        return 130 if stop.is_set() else 1
    finally:
        restore()
    return 130 if stop.is_set() else 0


def run_batch(
    key: tuple[str, int, str, bool],
    indices: list[int],
    plan: Plan,
    stop: threading.Event,
    children: side_by_side.Children,
) -> bool:
    """Runs ``indices`` of a row together (one: in this process, as before side by side existed),
    each recorded as it ends, then again with the batch's throughput; whether all left a record."""
    batch = {"side_by_side": len(indices), "batch": uuid.uuid4().hex[:12]}
    t0 = time.perf_counter()
    if plan.side_by_side == 1:
        work = new_work(plan.keep, key[1], key[2])
        recs = [run_and_record(RunSpec(key, indices[0], plan.data, plan.records, work), stop,
                               batch)]  # fmt: skip
    else:
        recs = run_children(key, indices, plan, children, batch)
        if len(recs) != len(indices):
            return False
    finish_batch(recs, time.perf_counter() - t0, plan)
    return True


def run_children(
    key: tuple[str, int, str, bool],
    indices: list[int],
    plan: Plan,
    children: side_by_side.Children,
    batch: dict[str, Any],
) -> list[dict[str, Any]]:
    """Each of ``indices`` as a child process of this script (``--run-one``), all at once; the
    records of those that left one, each packed and printed as it ends."""
    scale, way, row, first_order = key
    works = {}
    for index in indices:
        if children.stop.is_set():  # stopped before all started: those not started never run
            break
        work = new_work(plan.keep, way, row)
        argv = [sys.executable, str(Path(__file__).resolve()), "--run-one", str(index),
                "--work", str(work), "--batch", json.dumps(batch), "--scale", scale,
                "--ways", str(way), "--rows", row, "--records", str(plan.records),
                *(["--first-order"] if first_order else [])]  # fmt: skip
        works[children.start(argv, work / "child.out", work / "child.err").pid] = (index, work)
    recs: list[dict[str, Any]] = []

    def ended(proc: subprocess.Popen[bytes]) -> None:
        index, work = works[proc.pid]
        lines = (work / "child.out").read_text().splitlines()
        if proc.returncode != 0 or not lines:
            err = (work / "child.err").read_text(errors="replace").strip().splitlines()
            print(f"paper_table: run {index} of {scale} {way}-way ({row}) ended (exit "
                  f"{proc.returncode}) without a record; its log: {work / 'child.err'}: "
                  f"{err[-1] if err else ''}", file=sys.stderr, flush=True)  # fmt: skip
            return
        recs.append(json.loads(lines[-1]))
        pack(plan.pack, recs[-1])
        _say(recs[-1])

    children.wait(ended)
    return recs


def finish_batch(recs: list[dict[str, Any]], wall: float, plan: Plan) -> None:
    """The batch's throughput into each of its records (rewritten atomically), then packed: runs
    an hour of whole runs over the batch's wall, and the runs' own walls summed beside it (their
    sum over the batch's wall is how far they overlapped)."""
    whole = [r for r in recs if r.get("stopped_reason") != "interrupted"]
    fields = {"batch_wall_s": round(wall, 1),
              "batch_runs_wall_sum_s": round(sum(r["wall_s"] for r in recs), 1),
              "batch_whole_runs": len(whole),
              "batch_runs_per_hour": round(3600 * len(whole) / wall, 3)}  # fmt: skip
    for rec in recs:
        rec.update(fields)
        write_atomically(plan.records / record_name(rec), rec)
        pack(plan.pack, rec)
        if plan.side_by_side == 1:
            _say(rec)


def _say(rec: dict[str, Any]) -> None:
    print(json.dumps({k: rec[k] for k in ("scale", "way", "row", "run", "test_accuracy",
                                          "epsilon_valid", "wall_s")}), flush=True)  # fmt: skip


def run_child(args: argparse.Namespace) -> int:
    """``--run-one``: one run in this process, a child of a ``--side-by-side`` batch; its record
    on stdout. Its own handler stops it at a signal (recorded as interrupted), as a run alone."""
    stop = threading.Event()
    restore = results._stop_on_signals(stop)
    side_by_side.ready_for_signals()
    try:
        key = (args.scale, args.ways[0], args.rows[0], args.first_order)
        data = Path(os.environ["OMNIGLOT_DIR"]).resolve()
        spec = RunSpec(key, args.run_one, data, args.records, args.work)
        rec = run_and_record(spec, stop, json.loads(args.batch))
    finally:
        restore()
    print(json.dumps(rec), flush=True)
    return 0


def throughput(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs an hour by device, row and runs side by side, over batches whose runs all ended whole,
    with ``speedup_vs_one``: against the same row on the same device one run at a time."""
    batches: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        if r.get("batch_wall_s") is not None:
            batches.setdefault(r["batch"], []).append(r)
    groups: dict[tuple[Any, ...], list[list[dict[str, Any]]]] = {}
    for runs in batches.values():
        whole = all(r.get("stopped_reason") != "interrupted" for r in runs)
        if whole and len(runs) == runs[0]["side_by_side"]:
            r = runs[0]
            key = (r["device"], r["scale"], r["way"], r["row"], r["first_order"], r["side_by_side"])
            groups.setdefault(key, []).append(runs)
    rows = []
    for key, done in sorted(groups.items()):
        wall = sum(runs[0]["batch_wall_s"] for runs in done)
        runs = sum(len(runs) for runs in done)
        rows.append({"device": key[0], "scale": key[1], "way": key[2], "row": key[3],
                     "first_order": key[4], "side_by_side": key[5], "batches": len(done),
                     "runs": runs, "runs_per_hour": round(3600 * runs / wall, 3),
                     "mean_run_wall_s": round(statistics.fmean(
                         r["wall_s"] for b in done for r in b), 1),
                     "overlap": round(sum(b[0]["batch_runs_wall_sum_s"] for b in done) / wall,
                                      3)})  # fmt: skip
    alone = {tuple(r[k] for k in ("device", "scale", "way", "row", "first_order")): r
             for r in rows if r["side_by_side"] == 1}  # fmt: skip
    for r in rows:
        one = alone.get(tuple(r[k] for k in ("device", "scale", "way", "row", "first_order")))
        r["speedup_vs_one"] = round(r["runs_per_hour"] / one["runs_per_hour"], 3) if one else None
    return rows


# --- the table -----------------------------------------------------------------------------------


def load_records(where: Path = RECORDS) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(where.glob("*.json"))]


def whole_runs(recs: list[dict[str, Any]], key: tuple[str, int, str, bool]) -> list[dict[str, Any]]:
    return [r for r in recs if (r["scale"], r["way"], r["row"], r["first_order"]) == key
            and r.get("stopped_reason") != "interrupted"]  # fmt: skip


def interval(values: list[float]) -> list[float] | None:
    """95% Student-t interval of the mean over runs (None below 2 runs)."""
    from scipy import stats

    if len(values) < 2:
        return None
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return [statistics.fmean(values) - half, statistics.fmean(values) + half]


def command(key: tuple[str, int, str, bool]) -> str:
    scale, way, row, first_order = key
    nice = "nice " if scale == "cpu" else ""
    variant = " --first-order" if first_order else ""
    return (f"OMNIGLOT_DIR=/path/to/omniglot {nice}python bench/paper_table.py --run --scale "
            f"{scale} --ways {way} --rows {row} --runs 3{variant}")  # fmt: skip


def table_rows(recs: list[dict[str, Any]], scales: list[str]) -> list[dict[str, Any]]:
    """One row per (scale, way, row, first order), measured or not."""
    keys = {(s, w, r, False) for s in scales for w in WAYS for r in ROWS}
    keys |= {
        (r["scale"], r["way"], r["row"], r["first_order"]) for r in recs if r["scale"] in scales
    }
    return [summarise(recs, key) for key in sorted(keys, key=_order)]


def _order(key: tuple[str, int, str, bool]) -> tuple[int, int, str, bool]:
    return (list(SCALES).index(key[0]), key[1], key[2], key[3])


def summarise(recs: list[dict[str, Any]], key: tuple[str, int, str, bool]) -> dict[str, Any]:
    runs = whole_runs(recs, key)
    acc = [100 * r["test_accuracy"] for r in runs]
    base = whole_runs(recs, (key[0], key[1], "a", False))
    tasks = sorted({r["test_tasks_digest"] for r in runs})
    start = "public warm start" if any(r["warm_start_digest"] for r in runs) else "untrained"
    start_accuracy = statistics.fmean(100 * r["starting_accuracy"] for r in runs) if runs else None

    def first(field: str) -> Any:
        found = [r[field] for r in runs if r.get(field) is not None]
        return max(found) if found else None

    return {
        "scale": key[0], "way": key[1], "row": key[2], "first_order": key[3], "runs": len(runs),
        "mean": statistics.fmean(acc) if acc else None, "min": min(acc, default=None),
        "max": max(acc, default=None), "ci95": interval(acc),
        "start": start, "start_accuracy": start_accuracy,
        "untrained": start_accuracy if start == "untrained" else None,
        "epsilon_valid": first("epsilon_valid"), "delta": first("delta") if key[2] != "a" else None,
        "epsilon_thm3": first("epsilon_thm3"), "epsilon_moments": first("epsilon_moments"),
        "device": sorted({r["device"] for r in runs}), "test_tasks_digest": tasks,
        "same_test_tasks_as_a": bool(base) and tasks == [base[0]["test_tasks_digest"]],
        "paper": PAPER.get((key[1], key[2])) if key[0] == "gpu" else None, "command": command(key),
    }  # fmt: skip


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scale | way | row | runs | accuracy % (mean) | range | 95% CI over runs | start "
        "(its accuracy) | eps valid | eps Thm 3 (not valid) | eps moments (DP-MAML's reading) "
        "| DP-MAML reports |\n|" + "---|" * 12
    )
    lines = [head]
    for r in rows:
        name = f"({r['row']}) {WHAT[r['row']]}" + (", first order" if r["first_order"] else "")
        if (r["row"], r["way"]) == ("d", 20):  # row_sets: whole alphabets are too small for it
            name += ", characters split evenly among participants"
        if r["row"] != "a" and r["runs"] and not r["same_test_tasks_as_a"]:
            name += ", other test tasks than (a)"
        if not r["runs"]:
            lines.append(f"| {r['scale']} | {r['way']} | {name} | 0 | unmeasured: `{r['command']}` "
                         f"| | | | | | | {r['paper'] or '-'} |")  # fmt: skip
            continue
        ci = "-" if r["ci95"] is None else f"{r['ci95'][0]:.1f}-{r['ci95'][1]:.1f}"
        eps = ["-" if r["row"] == "a" else f"{_num(r['epsilon_valid'], '.2f')} "
               f"(delta {r['delta']:g})", _num(r["epsilon_thm3"], ".2f"),
               _num(r["epsilon_moments"], ".2f")]  # fmt: skip
        start = f"{r['start']} ({r['start_accuracy']:.1f})"
        lines.append(f"| {r['scale']} | {r['way']} | {name} | {r['runs']} | {r['mean']:.1f} | "
                     f"{r['min']:.1f}-{r['max']:.1f} | {ci} | {start} | {' | '.join(eps)} | "
                     f"{r['paper'] or '-'} |")  # fmt: skip
    devices = sorted({d for r in rows for d in r["device"]})
    scales = sorted({r["scale"] for r in rows}, key=list(SCALES).index)
    notes = [
        f"Scales: {'; '.join(f'{s}: {SCALES[s].label}' for s in scales)}. Devices: "
        f"{'; '.join(devices) or 'none yet'}. One JSON record a run in `results/paper-table/`."
    ]
    return "\n".join([*lines, "", *notes])


def sinusoid_line() -> str:
    """The default sinusoid job's row, from its existing records (bench/results.py summary)."""
    rows = results.summarise([REPO / "results" / "sinusoid-current20.jsonl"])
    parts = []
    for r in sorted(rows, key=lambda r: (r["private"], -float(r["overrides"][0].split("=")[1])
                                         if r["private"] else 0)):  # fmt: skip
        name = r["overrides"][0].split("=")[1] if r["private"] else "non-private"
        label = name if name == "non-private" else f"epsilon {float(name):g}"
        parts.append(f"{label} {r['mean']:.3f} ({r['min']:.3f}-{r['max']:.3f}, {r['runs']} runs)")
    return (
        "Sinusoid, the default main job (`configs/sinusoid.toml`, test MSE after adaptation, "
        "delta 1e-5, `results/sinusoid-current20.jsonl`): " + "; ".join(parts) + "."
    )


def generated(recs: list[dict[str, Any]], short: bool) -> str:
    """The section between the markers: every row, or (``short``, the README's) the measured ones
    and a count of the rest."""
    rows = table_rows(recs, ["gpu", "cpu"])
    if not short:
        return f"{START}\n{markdown(rows)}\n\n{sinusoid_line()}\n{END}"
    left = [f"{r['scale']} {r['way']}-way ({r['row']})" for r in rows if not r["runs"]]
    rest = (f"Unmeasured, each with its command in [docs/results.md](docs/results.md): "
            f"{', '.join(left)}.") if left else ""  # fmt: skip
    body = markdown([r for r in rows if r["runs"]]) if len(left) < len(rows) else ""
    return "\n".join(x for x in (START, body, rest, "", sinusoid_line(), END) if x is not None)


def updated(doc: Path, recs: list[dict[str, Any]]) -> str:
    """``doc``'s text with the generated section (the README's short one) in place."""
    return replace_section(doc.read_text(), generated(recs, short=doc.name == "README.md"), doc)


def replace_section(
    text: str, section: str, path: Path, markers: tuple[str, str] = (START, END)
) -> str:
    """``text`` with what lies between ``markers`` (included) replaced by ``section``."""
    start, end = markers
    if start not in text or end not in text:
        raise SystemExit(f"{path} has no {start} ... {end} markers: add them")
    before, rest = text.split(start, 1)
    return before + section + rest.split(end, 1)[1]


def plot(recs: list[dict[str, Any]], png: Path) -> None:
    """Accuracy against the valid epsilon, a panel per way; non-private and start as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, way in zip(axes, WAYS, strict=True):
        for scale, marker in (("gpu", "o"), ("cpu", "s")):
            for r in table_rows(recs, [scale]):
                if r["way"] != way or not r["runs"]:
                    continue
                if r["row"] == "a":
                    ax.axhline(r["mean"], ls="--", c="grey", label=f"{scale} (a) non-private")
                    ax.axhline(r["start_accuracy"], ls=":", c="black", label=f"{scale} untrained")
                    continue
                err = [[r["mean"] - r["min"]], [r["max"] - r["mean"]]]
                ax.errorbar([r["epsilon_valid"]], [r["mean"]], yerr=err, marker=marker, capsize=3,
                            label=f"{scale} ({r['row']})")  # fmt: skip
        ax.set_xscale("log")
        ax.set_title(f"Omniglot {way}-way 1-shot")
        ax.set_xlabel("valid task-level epsilon (delta 1e-6)")
        ax.set_ylabel("test accuracy % (range over runs)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no runs recorded", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def table_parser(doc: str | None, scales: list[str], records: Path, pack_name: str,
                 keep: Path) -> argparse.ArgumentParser:  # fmt: skip
    """The flags every generated table of bench/ has (this one's and bench/sample_table.py's):
    print, ``--json``, ``--check``, ``--write``, ``--run`` at ``--scale`` with ``--runs``, and
    the records' folders and the device window's pack."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON object a row")
    ap.add_argument("--check", action="store_true", help="exit 1 if the docs' table is stale")
    ap.add_argument("--write", action="store_true", help="write the table into the docs")
    ap.add_argument("--run", action="store_true", help="run the rows that lack runs")
    ap.add_argument("--scale", choices=scales, default="gpu")
    ap.add_argument("--runs", type=int, default=3, help="runs a row must have")
    ap.add_argument(
        "--pack",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="append each record to DIR/" + pack_name + " (default $OUT)",
    )
    ap.add_argument("--unpack", type=Path, nargs="+", help="file packed records under --records")
    ap.add_argument("--records", type=Path, default=records, help="the records' folder")
    ap.add_argument("--keep", type=Path, default=keep,
                    help="where each run's directory is kept (runs/ is not committed)")  # fmt: skip
    return ap


@dataclass(frozen=True)
class Table:
    """What a generated table of bench/ (this one, bench/sample_table.py's) is made of: the
    script's name (its messages and ``--write`` command), its records' format and file names, its
    rows (``--json``), its printed section, the docs it stands in and each doc's text with it in
    place, and what ``--write`` makes besides (this table's plot)."""

    script: str
    fmt: str
    record_name: Callable[[dict[str, Any]], str]
    rows: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
    section: Callable[[list[dict[str, Any]]], str]
    docs: tuple[Path, ...]
    updated: Callable[[Path, list[dict[str, Any]]], str]
    also_written: Callable[[list[dict[str, Any]]], None] | None = None


def show_table(args: argparse.Namespace, table: Table) -> int:
    """What every generated table of bench/ does with its records (the flags of
    :func:`table_parser` but ``--run``): ``--unpack``, ``--json``, ``--check`` (exit 1 when a doc
    differs; it writes nothing, even with ``--write``), ``--write``, or print the section."""
    if args.unpack:
        added = unpack(args.unpack, args.records, table.fmt, table.record_name)
        print(f"{table.script}: {added} new records in {args.records}")
        return 0
    recs = load_records(args.records)
    if args.json:
        for row in table.rows(recs):
            print(json.dumps(row))
        return 0
    if args.check:
        stale = [str(p.relative_to(REPO)) for p in table.docs
                 if table.updated(p, recs) != p.read_text()]  # fmt: skip
        if stale:
            print(f"{table.script}: the table in {', '.join(stale)} is not what the records give: "
                  f"run python bench/{table.script}.py --write", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    if args.write:
        for p in table.docs:
            p.write_text(table.updated(p, recs))
        if table.also_written is not None:
            table.also_written(recs)
        return 0
    print(table.section(recs))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = table_parser(__doc__, sorted(SCALES), RECORDS, PACK_NAME, REPO / "runs" / "paper-table")
    ap.add_argument("--ways", type=int, nargs="+", choices=WAYS, default=list(WAYS))
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--first-order", action="store_true", help="the labelled first-order variant")
    ap.add_argument("--side-by-side", type=int, default=1, metavar="N",
                    help="--run: start a row's missing runs N at a time, each a process of its "
                    "own on the same device (default 1: one after another, in this process)")
    ap.add_argument("--throughput", type=Path, nargs="*", metavar="DIR",
                    help="runs an hour by device, row and --side-by-side, from the records in "
                    "DIR ... (default --records)")  # fmt: skip
    ap.add_argument("--run-one", type=int, help=argparse.SUPPRESS)  # a --side-by-side child
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--batch", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side_by_side < 1:
        ap.error(f"--side-by-side must be >= 1 (runs started together); got {args.side_by_side}")
    if args.run_one is not None:
        return run_child(args)
    if args.run:
        return run_rows(args)
    if args.throughput is not None:
        folders = args.throughput or [args.records]
        for row in throughput([r for f in folders for r in load_records(f)]):
            print(json.dumps(row))
        return 0
    table = Table(
        script="paper_table", fmt=FORMAT, record_name=record_name,
        rows=lambda recs: table_rows(recs, ["gpu", "cpu"]),
        section=lambda recs: generated(recs, short=False), docs=DOCS, updated=updated,
        also_written=lambda recs: plot(recs, REPO / "docs" / "img" / "paper-table.png"),
    )  # fmt: skip
    return show_table(args, table)


if __name__ == "__main__":
    raise SystemExit(main())
