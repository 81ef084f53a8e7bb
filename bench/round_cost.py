"""The cost of one private round apart from the model: the server path and the in-process grid.

    python bench/round_cost.py --json --device cpu               # DP-MAML's round: 20 x 80 tasks
    python bench/round_cost.py --json --rows 5 --repeat 7        # the CPU scale: lot 100
    python bench/round_cost.py --json --device cuda              # on a GPU machine

One private round of ``--participants`` participants each answering ``--rows`` tasks with
``--dimension`` parameters (the Omniglot 5-way conv net's 112,261 by default) goes through the real
server round (:func:`fedmeta.server.round.run_round`: sampling, requests, the transport over
Flower messages, validation and re-clip, the ledger spend with its fsync, noise on the release
grid, normalisation, the optimizer step) and the in-process grid, whose nodes answer with
precomputed per-task rows instead of computing gradients: encoding and decoding the replies is
timed, the model is not. The rows are float32 normals scaled so that half the tasks are over the
clip (as in a real round). One JSON object per invocation:

* ``overhead_s``: the median over ``--repeat`` rounds (after one untimed warm-up round) of a whole
  private round: everything but the gradients;
* ``floor_s``: the median of one pass summing the same rows on the same device, in the same
  process: the least any server must do with them;
* ``gradient_s``: the participants' real per-task clipped gradients (the configuration's conv
  net, its inner loop, on ``--device``) for the same number of tasks. On the CPU the per-task loop
  is linear in the tasks, so ``--gradient-tasks`` of them are timed and scaled to the round's
  count (``gradient_tasks_timed`` says how many; ``--gradient-tasks 0`` skips it). On CUDA every
  task is timed by default.

``--device cuda`` without CUDA: one line, exit status 2. The run's ledger is a throw-away file in
a temporary directory; the noise is the secure source the server uses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402

EXIT_NO_DEVICE = 2
#: The paper configuration whose conv net, inner loop and task shape ``gradient_s`` times.
PAPER_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "omniglot-5way-1shot.toml"
CLIP = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the only output)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rows", type=int, default=80, help="tasks per participant in the round")
    ap.add_argument("--dimension", type=int, default=112_261, help="parameters per row")
    ap.add_argument("--participants", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds (after one warm-up)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: what `fedmeta simulate` runs with)",
    )
    ap.add_argument("--gradient-tasks", type=int, default=None,
                    help="tasks whose real gradients are timed (default: 64 on the CPU, every "
                    "task of the round on CUDA; 0: skip)")  # fmt: skip
    args = ap.parse_args(argv)
    for name in ("rows", "dimension", "participants", "repeat", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    return args


def _config(args: argparse.Namespace) -> Any:
    """A private fixed-clip federation of the requested shape (the sampler takes every row)."""
    from fedmeta.config_io import load_config

    return load_config(None, [
        "federation.backend=inprocess",
        f"federation.participants={args.participants}",
        f"sampling.participants_per_round={args.participants}",
        "sampling.stage2=fixed",
        f"sampling.tasks_per_round={args.rows}",
        # Each participant holds 50 times the tasks it answers (a sampling rate of 1/50), so the
        # budget lasts every repeat; the nodes answer with their first rows whatever the ids.
        f"dataset.tasks_per_participant={50 * args.rows}",
        "privacy.noise_multiplier=0.7616",
        "privacy.epsilon_budget=1000",
        "privacy.adaptive_clipping.enabled=false",
        f"privacy.clip={CLIP}",
        "training.meta_lr=0.003",
    ])  # fmt: skip


def _rows(args: argparse.Namespace) -> np.ndarray:
    """``[participants, rows, dimension]`` float32 rows; half of them over the clip."""
    rng = np.random.default_rng(0)
    out = np.empty((args.participants, args.rows, args.dimension), dtype=np.float32)
    for block in out:
        block[...] = rng.standard_normal(block.shape, dtype=np.float32)
        norms = np.linalg.norm(block, axis=1, keepdims=True)
        block *= rng.choice([0.5, 2.0], (args.rows, 1)).astype(np.float32) * CLIP / norms
    return out


def _handler(table: np.ndarray, device: torch.device) -> Callable[[Any, Any], Any]:
    """The ClientApp's train handler with the gradient replaced by the participant's rows.

    Decoding the request, moving the rows to the host (as a deployed participant's gradients
    do; on CUDA in-process they stay on the GPU, as in the batched round's device lane),
    building the reply with its clip bits, and encoding it are the ClientApp's own steps
    (client/fedmeta/client/app.py).
    """
    from flwr.app import Message

    from fedmeta import protocol as P
    from fedmeta.client.app import participant_id
    from fedmeta.client.gradients import clip_bits

    held = [torch.from_numpy(t).to(device) for t in table]
    norms = [np.linalg.norm(t.astype(np.float64), axis=1) for t in table]

    def handler(message: Any, context: Any) -> Any:
        request = P.decode_gradient_request(message.content)
        pid = participant_id(context)
        n = len(request.task_ids)
        shared = context.node_config.get(getattr(P, "NODE_SHARED_MEMORY", ""), False)
        rows: Any = held[int(pid)][:n]
        # A GPU's rows stay there where the simulation's batched round keeps them (a checkout
        # before the device lane has no DEVICE_STYPE: its rows go to the host, as they did then).
        if not (shared and device.type == "cuda" and hasattr(P, "DEVICE_STYPE")):
            rows = rows.detach().to("cpu", torch.float32).numpy()
        bits = clip_bits(norms[int(pid)][:n], float(request.clip or CLIP))
        reply = P.GradientReply(request.run_id, request.round_id, pid, request.task_ids, rows,
                                None, None, 0.0, bits)  # fmt: skip
        # As the ClientApp encodes (a checkout before the shared lane has neither key nor flag,
        # which is how the figures before it were measured).
        if shared:
            return Message(P.encode_gradient_reply(reply, shared=True), reply_to=message)
        return Message(P.encode_gradient_reply(reply), reply_to=message)

    return handler


def _pipeline(cfg: Any, args: argparse.Namespace, table: np.ndarray, ledger_path: Path) -> Any:
    """The round's context and the private release, as ``server/run.py`` builds them.

    Returns ``(context, setup, strategy, ledger)``: ``setup(index, clip)`` is round ``index``'s
    setup (its sampler and private release at adaptive clipping's current bound ``clip``).
    """
    from fedmeta.accounting import BudgetLedger, SystemRandomSource, TwoStageSampler
    from fedmeta.client_config import client_config
    from fedmeta.server.plan import build_plan
    from fedmeta.server.release_strategy import ReleasedRun, private_strategy
    from fedmeta.server.round import RoundContext, RoundSetup
    from fedmeta.server.transport import GridTransport
    from fedmeta.simulation.local_grid import InProcessGrid

    counts = {str(i): args.rows for i in range(args.participants)}
    plan = build_plan(cfg, counts)
    assert plan.privacy is not None  # the benchmark times a private round
    grid = InProcessGrid(args.participants, _handler(table, torch.device(args.device)))
    transport = GridTransport(grid, register_timeout_s=60, round_timeout_s=600)
    nodes = {str(i): nid for i, nid in enumerate(grid.node_ids)}
    ledger = BudgetLedger.open(ledger_path, "round-cost", epsilon_budget=1000,
                               delta=cfg.privacy.delta, neighbouring=plan.neighbouring,
                               mode="insecure")  # fmt: skip

    def exchange(requests: Any) -> Any:
        result = transport.exchange(requests, nodes)
        failed = {pid: d.failure for pid, d in result.deliveries.items() if d.reply is None}
        if failed:  # a private round withholds these: a benchmark must not time a failed round
            raise SystemExit(f"round_cost: replies failed: {failed}")
        return result

    context = RoundContext(
        run_id="round-cost", federation_id="round-cost", transport=exchange,
        config_json=client_config(cfg).model_dump_json(), dim=args.dimension,
        reply_format="per_task", tolerance=cfg.privacy.clip_tolerance, diagnostics=False,
    )  # fmt: skip
    released = ReleasedRun("round-cost", args.dimension, plan.normaliser)
    strategy = private_strategy(plan.privacy, ledger, released, None, lambda r: False)

    def setup(index: int, clip: float | None) -> Any:
        sampler = TwoStageSampler(plan.scheme, SystemRandomSource())
        return RoundSetup(counts, sampler, strategy.for_round(plan.scheme, index, clip))

    return context, setup, strategy, ledger


def round_seconds(args: argparse.Namespace, table: np.ndarray) -> list[float]:
    """Wall seconds of ``--repeat`` private rounds (after one warm-up round)."""
    from fedmeta.server.round import TrainingState, run_round

    cfg = _config(args)
    with tempfile.TemporaryDirectory() as tmp:
        context, setup, strategy, ledger = _pipeline(cfg, args, table, Path(tmp) / "ledger.sqlite")
        state = TrainingState(torch.zeros(args.dimension), cfg.training, planned_rounds=10**6)
        times = []
        for index in range(args.repeat + 1):
            round_setup = setup(index, state.clip)  # the run builds it before the round, too
            t0 = time.perf_counter()
            outcome = run_round(context, round_setup, state, index)
            times.append(time.perf_counter() - t0)
            if outcome is None or outcome.participants_replied != args.participants:
                raise SystemExit(f"round_cost: round {index + 1} did not complete: {outcome}")
        strategy.close()
        ledger.close()
    return times[1:]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_seconds(args: argparse.Namespace, table: np.ndarray) -> list[float]:
    """One pass adding every row into a float64 sum on the device, ``--repeat`` times.

    The fastest single pass measured for each device: on the CPU each float32 row added into the
    float64 sum in place (``Tensor.add_``, 2-6x faster here than ``sum(0, dtype=float64)`` over
    the whole matrix, which reduces across rows); on CUDA one ``sum(0, dtype=float64)``.
    """
    device = torch.device(args.device)
    rows = torch.from_numpy(table.reshape(-1, args.dimension)).to(device)
    times = []
    for _ in range(args.repeat + 1):
        _synchronize(device)
        t0 = time.perf_counter()
        if device.type == "cpu":
            total = torch.zeros(args.dimension, dtype=torch.float64)
            for row in rows:
                total.add_(row)
        else:
            rows.sum(0, dtype=torch.float64)
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return times[1:]


def gradient_seconds(args: argparse.Namespace, total: int) -> tuple[float | None, int]:
    """Seconds of the real clipped gradients of ``total`` tasks (scaled from the timed part)."""
    from fedmeta.adaptation import inner_kwargs
    from fedmeta.config_io import load_config
    from fedmeta.metalearning import per_task_clipped_grads
    from fedmeta.workload import build_model, initial_params

    device = torch.device(args.device)
    timed = args.gradient_tasks
    if timed is None:
        timed = total if device.type == "cuda" else min(total, 64)
    timed = min(timed, total)
    if timed == 0:
        return None, 0
    cfg = load_config(PAPER_CONFIG, ["dataset.path=unused"])
    model = build_model(cfg)
    params = initial_params(cfg, model)
    tasks = _synthetic_tasks(cfg, timed, device)
    kwargs = {**inner_kwargs(cfg.training, evaluation=False),
              "first_order": cfg.training.first_order, "clip": CLIP, "device": device,
              "chunk_size": cfg.training.chunk_size, "nonfinite": "zero"}  # fmt: skip
    first = type(tasks)(*(t[:1] for t in tasks))
    per_task_clipped_grads(model, params, first, **kwargs)  # torch's lazy start: not timed
    _synchronize(device)
    t0 = time.perf_counter()
    per_task_clipped_grads(model, params, tasks, **kwargs)
    _synchronize(device)
    return (time.perf_counter() - t0) * total / timed, timed


def _synthetic_tasks(cfg: Any, n: int, device: torch.device) -> Any:
    """Omniglot-shaped tasks (binary 28x28 images): compute does not depend on the pixels."""
    from fedmeta.metalearning import Task

    ds = cfg.dataset
    g = torch.Generator().manual_seed(0)
    side = ds.image_size
    sx = (torch.rand(n, ds.ways * ds.shots, 1, side, side, generator=g) > 0.8).float()
    qx = (torch.rand(n, ds.ways * ds.query, 1, side, side, generator=g) > 0.8).float()
    sy = torch.arange(ds.ways).repeat_interleave(ds.shots).repeat(n, 1)
    qy = torch.arange(ds.ways).repeat_interleave(ds.query).repeat(n, 1)
    return Task(sx, sy, qx, qy).to(device)


def main(argv: list[str] | None = None) -> int:
    """Measure and print one JSON object (see the module docstring)."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("round_cost: --device cuda: this torch sees no CUDA device "
              f"(torch {torch.__version__}); use --device cpu", file=sys.stderr)  # fmt: skip
        return EXIT_NO_DEVICE
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    # `fedmeta simulate` runs torch on one thread (OMP_NUM_THREADS=1, and the ClientApp sets it
    # for every message): the round is measured as it runs there unless --threads says otherwise.
    torch.set_num_threads(args.threads)
    table = _rows(args)
    rounds = round_seconds(args, table)
    floor = floor_seconds(args, table)
    gradient, timed = gradient_seconds(args, args.participants * args.rows)
    record = {
        "rows": args.participants * args.rows, "participants": args.participants,
        "rows_per_participant": args.rows,
        "dimension": args.dimension, "device": args.device,
        "overhead_s": round(statistics.median(rounds), 4),
        "overhead_range_s": [round(min(rounds), 4), round(max(rounds), 4)],
        "floor_s": round(statistics.median(floor), 4),
        "gradient_s": None if gradient is None else round(gradient, 4),
        "gradient_tasks_timed": timed, "repeat": args.repeat,
        "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "device_name": (torch.cuda.get_device_name() if args.device == "cuda"
                        else platform.processor()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }  # fmt: skip
    print(json.dumps(record) if args.json else "\n".join(f"{k}: {v}" for k, v in record.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
