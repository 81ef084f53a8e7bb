"""The server's per-task re-check of a round's replies (fedmeta.server.validation), whole/blocked.

    python bench/server_validation.py                       # DP-MAML's lot: 20 replies of 80 rows
    python bench/server_validation.py --rows 5 --repeat 7   # the CPU scale: lot 100

Times :func:`fedmeta.server.validation.clipped_row_sum` on ``--replies`` synthetic replies of
``--rows`` float32 rows of ``--dim`` values (the 20-way Omniglot conv net's 113,236 by default;
5-way has 112,261), with the whole reply converted and clipped at once (``--rows`` rows per
block: the server before blocks) and with :data:`~fedmeta.server.validation.ROWS_PER_BLOCK`
rows per block. The two alternate, so a drift in machine speed hits both alike; prints one JSON
line with each one's median and range of seconds per round over ``--repeat`` rounds, with torch's
thread count.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedmeta.server.validation import ROWS_PER_BLOCK, clipped_row_sum  # noqa: E402


def _round_seconds(replies: list[np.ndarray], rows_per_block: int) -> float:
    t0 = time.perf_counter()
    for rows in replies:
        clipped_row_sum(rows, 1.0, rows_per_block)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replies", type=int, default=20, help="participants replying in a round")
    ap.add_argument("--rows", type=int, default=80, help="tasks per reply")
    ap.add_argument("--dim", type=int, default=113_236, help="parameters")
    ap.add_argument("--repeat", type=int, default=5, help="rounds timed per variant")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    # Norms spread around C = 1, so some rows are clipped and some are not, as in a real round.
    scale = rng.choice([0.001, 0.01], (args.rows, 1))
    replies = [
        (rng.standard_normal((args.rows, args.dim)) * scale).astype(np.float32)
        for _ in range(args.replies)
    ]
    times: dict[str, list[float]] = {"whole reply": [], f"{ROWS_PER_BLOCK} rows": []}
    for _ in range(args.repeat):
        times["whole reply"].append(_round_seconds(replies, args.rows))
        times[f"{ROWS_PER_BLOCK} rows"].append(_round_seconds(replies, ROWS_PER_BLOCK))
    print(json.dumps({
        "replies": args.replies, "rows": args.rows, "dim": args.dim, "repeat": args.repeat,
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or "cpu",
        **{k: {"median_s": round(statistics.median(v), 3), "min_s": round(min(v), 3),
               "max_s": round(max(v), 3)} for k, v in times.items()},
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
