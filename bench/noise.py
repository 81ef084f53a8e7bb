"""Secure Gaussian noise for one round: time to draw and release N(0, (zC)^2 I) for d parameters.

    python bench/noise.py                 # d = 10 million, 2 streams, 7 repetitions
    python bench/noise.py --dim 1000000 --streams 1 --reps 20

Measures ``server.noise.noised_sum`` (AES-128-CTR keystreams keyed from the OS CSPRNG, numpy's
ziggurat, rounding to the release grid) against a plain torch.normal from a Mersenne Twister (the
insecure baseline it replaced), and prints the median and the range. Target (issue 9): under 0.2 s
for 10 million parameters on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# bench/accounting.py would shadow the accounting package when this script is run from bench/.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from fedmeta.accounting import GaussianRound, TwoStagePoissonScheme  # noqa: E402
from fedmeta.server.noise import NoiseSource, noised_sum  # noqa: E402


def timed(fn, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    fn()  # warm-up: allocations, AES key schedule, threads
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=10_000_000)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    event = GaussianRound(TwoStagePoissonScheme(20, 4, 0.1), 1.0)
    total = torch.randn(args.dim, dtype=torch.float64)
    source = NoiseSource.create(streams=args.streams)
    results = {
        "secure_noised_sum": timed(
            lambda: noised_sum(total, clip=1.0, event=event, source=source), args.reps
        ),
        "secure_draw_only": timed(lambda: source.standard_normal(args.dim), args.reps),
        "torch_normal_mt19937_insecure": timed(
            lambda: torch.normal(0.0, 1.0, (args.dim,), dtype=torch.float64), args.reps
        ),
    }
    print(json.dumps({
        "dim": args.dim, "streams": args.streams, "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
        "load_average": os.getloadavg(),
        **{k: {"median_s": round(statistics.median(v), 4), "min_s": round(min(v), 4),
               "max_s": round(max(v), 4)} for k, v in results.items()},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
