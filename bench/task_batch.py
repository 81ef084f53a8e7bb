"""Building a round's tasks: one task at a time and stacked, against one gather of them all.

    python bench/task_batch.py                      # DP-MAML's round: 20 participants x 80 tasks
    python bench/task_batch.py --device cuda        # gathered on the GPU from a copy of the images

Times building ``--participants`` x ``--tasks`` 5-way 1-shot tasks with 5 queries a class (the
paper configuration's shape: 30 images of 28 x 28 a task) from random uint8 images of 1,200
classes of 20, the way the simulation's batched round builds them and joins them into one batch:
``stack_tasks([p.task(t) ...])`` (before) against ``p.tasks(ids)`` (one gather). The two
alternate, so a drift in machine speed hits both alike. Prints one JSON line with each one's
median and range of seconds over ``--repeat`` repetitions, with torch's thread count; the batches
are checked equal first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fedmeta.metalearning as ml  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--participants", type=int, default=20)
    ap.add_argument("--tasks", type=int, default=80, help="tasks per participant in the round")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return ap.parse_args(argv)


def task_set(participants: int, tasks: int) -> ml.FederatedTaskSet:
    """A 5-way 1-shot, 5-query federation over random 28 x 28 images."""
    classes, per_class = 1200, 20
    rng = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (classes * per_class, 1, 28, 28), dtype=torch.uint8,
                           generator=rng)  # fmt: skip
    ds = ml.ClassDataset(images, np.arange(classes + 1) * per_class,
                         [str(i) for i in range(classes)],
                         [f"g{i // 40}" for i in range(classes)])  # fmt: skip
    return ml.FederatedTaskSet.from_classes(ds, participants, n_way=5, k_shot=1, q_query=5,
                                            tasks_per_participant=tasks, seed=1)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Time both ways of building the round's batch; one JSON line."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("task_batch: --device cuda: this torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # as fedmeta simulate's participants
    device = torch.device(args.device)
    fts = task_set(args.participants, args.tasks)
    owners = [fts.participant(str(i)) for i in range(args.participants)]
    ids = list(range(args.tasks))

    def one_by_one() -> ml.Task:
        return ml.stack_tasks([t for p in owners for t in map(p.task, ids)]).to(device)

    def gathered() -> ml.Task:
        return ml.Task(*(torch.cat(x) for x in zip(*(p.tasks(ids, device) for p in owners),
                                                   strict=True)))  # fmt: skip

    ways: dict[str, Callable[[], ml.Task]] = {"one_by_one": one_by_one, "gathered": gathered}
    check = [w() for w in ways.values()]
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(*check, strict=True))
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeat):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[name].append(time.perf_counter() - t0)
    out = {"tasks": args.participants * args.tasks, "device": args.device,
           "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    for name, values in seconds.items():
        out[f"{name}_s"] = round(statistics.median(values), 4)
        out[f"{name}_range_s"] = [round(min(values), 4), round(max(values), 4)]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
