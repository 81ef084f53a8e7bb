"""Benchmark of accounting/: ``python bench/accounting.py [--sweep]``; prints markdown for the docs.

1. Epsilon against T (fedmeta PLD, dp-accounting RDP, Opacus PRV when installed), the ledger's
   per-round cost, and ``max_rounds`` from cold caches.
2. The extremes (the queries of issue 13 among them): each query runs in a fresh subprocess, which
   reports its wall time and its peak RSS (VmHWM, interpreter and imports included; the
   ``baseline`` row is an import alone).
3. ``--sweep`` (a fresh process): the slowest ``epsilon``, ``max_rounds`` and ``calibrate`` over a
   grid of rounds (1 to 1e9), epsilon (0.1 to 1e3), noise multipliers (0.1 to 100), both units and
   both neighbouring relations, each from cold caches (about 20 minutes on 2 cores).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# This file is named like the package it measures: run as a script, its own folder would shadow
# `accounting`. Put the repository root first instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

from dp_accounting import dp_event, rdp  # noqa: E402

from fedmeta.accounting import (  # noqa: E402
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    calibrate_noise_multiplier,
    composition,
    epsilon,
    max_rounds,
)

DELTA = 1e-5
#: The configuration's defaults: 20 participants, 4 per round, Poisson stage 2 at 0.1, 200 tasks
#: each (the server's participant-level cap with a Poisson stage 2).
DEFAULT = TwoStagePoissonScheme(20, 4, 0.1)
FIXED = TwoStageFixedScheme(100, 10, 5, 50)
CAP = 200


def timed(f: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    r = f()
    return r, time.perf_counter() - t


def clear_caches() -> None:
    for name in dir(composition):
        cached = getattr(composition, name)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def rdp_poisson(t: int) -> float:
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), t)
    return float(acc.get_epsilon(1e-6))


def part_reference() -> None:
    two = GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 1.0)
    flat = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    try:  # Opacus imports torch: only this benchmark uses it, never accounting/.
        from opacus.accountants import PRVAccountant
    except ImportError:
        PRVAccountant = None
    print("\n#### Epsilon against T (delta 1e-6, cold caches)\n")
    print(
        "| T | two-stage eps (PLD) | s | plain Poisson: dp-accounting RDP | s "
        "| plain Poisson: fedmeta PLD | s | plain Poisson: Opacus PRV | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for t in (1_000, 10_000, 100_000):
        clear_caches()
        e, s = timed(lambda t=t: epsilon([(two, t)], 1e-6))
        er, sr = timed(lambda t=t: rdp_poisson(t))
        ep, sp = timed(lambda t=t: epsilon([(flat, t)], 1e-6))
        if PRVAccountant is not None:
            prv = PRVAccountant()
            prv.history = [(1.0, 0.01, t)]
            eo, so = timed(lambda prv=prv: prv.get_epsilon(1e-6))
            opa = f"{eo:.3f} | {so:.2f}"
        else:
            opa = "n/a | n/a"
        print(f"| {t} | {e:.3f} | {s:.2f} | {er:.3f} | {sr:.3f} | {ep:.3f} | {sp:.2f} | {opa} |")
    print()
    for label, event, budget in (
        ("flat Poisson q=0.01", flat, 2.96),
        ("two-stage 10 of 100, q2=0.1", two, 11.35),
    ):
        clear_caches()
        with tempfile.TemporaryDirectory() as d:
            ledger = BudgetLedger.open(os.path.join(d, "l.db"), "bench", budget, 1e-6)
            n, t0 = 0, time.perf_counter()
            while not ledger.would_exceed(event):
                ledger.spend(event, "bench", n)
                n += 1
            total = time.perf_counter() - t0
            t1 = time.perf_counter()
            for _ in range(1000):
                ledger.would_exceed(event)
            check = (time.perf_counter() - t1) / 1000
            ledger.close()
        print(
            f"- ledger ({label}, budget {budget}): {n} rounds until exhausted; would_exceed+spend "
            f"amortised {1000 * total / n:.2f} ms/round including the one-off max-rounds search; "
            f"cached would_exceed {1000 * check:.3f} ms"
        )
        clear_caches()
        m, s = timed(lambda event=event, budget=budget: max_rounds(event, budget, 1e-6))
        print(
            f"- max_rounds({label}, z=1, eps={budget}): {m} in {s:.2f} s (cold caches); "
            f"eps(T)={epsilon([(event, m)], 1e-6):.5f}, "
            f"eps(T+1)={epsilon([(event, m + 1)], 1e-6):.5f}"
        )


# ------------------------------------------------------------------------------ extremes

G, R1, PART = GaussianRound, "replace_one", "participant"
_EXTREMES: list[tuple[str, str]] = [
    ("baseline (imports only)", "None"),
    (
        "epsilon T=1e9, flat Poisson 0.01, z=1",
        "epsilon([(G(FlatPoissonScheme(0.01), 1.0), 10**9)], DELTA)",
    ),
    ("epsilon T=1e9, default two-stage, z=5", "epsilon([(G(DEFAULT, 5.0), 10**9)], DELTA)"),
    (
        "epsilon T=1e9, default two-stage, z=5, participant",
        "epsilon([(G(DEFAULT, 5.0, CAP), 10**9)], DELTA, PART)",
    ),
    (
        "epsilon T=1e9, two-stage fixed, z=0.1, replace_one",
        "epsilon([(G(FIXED, 0.1, None, R1), 10**9)], DELTA)",
    ),
    (
        "epsilon T=2000, two-stage fixed, z=1, delta 1e-6 (note: 51.0)",
        "epsilon([(G(FIXED, 1.0), 2000)], 1e-6)",
    ),
    (
        "epsilon T=1000, two-stage fixed, z=1e-4, participant",
        "epsilon([(G(FIXED, 1e-4), 1000)], DELTA, PART)",
    ),
    (
        "max_rounds eps=1000, default two-stage, z=5 (issue 13)",
        "max_rounds(G(DEFAULT, 5.0), 1e3, DELTA)",
    ),
    (
        "max_rounds eps=1000, default two-stage, z=5, replace_one",
        "max_rounds(G(DEFAULT, 5.0, None, R1), 1e3, DELTA)",
    ),
    (
        "max_rounds eps=1000, default two-stage, z=100, participant",
        "max_rounds(G(DEFAULT, 100.0, CAP), 1e3, DELTA, PART)",
    ),
    (
        "max_rounds eps=1000, flat Poisson 1e-4, z=50 (range end)",
        "max_rounds(G(FlatPoissonScheme(1e-4), 50.0), 1e3, DELTA)",
    ),
    (
        "calibrate eps=1000, T=1e9, default two-stage",
        "calibrate_noise_multiplier(DEFAULT, 10**9, 1e3, DELTA)",
    ),
    (
        "calibrate eps=0.1, T=1e9, two-stage fixed, replace_one",
        "calibrate_noise_multiplier(FIXED, 10**9, 0.1, DELTA, neighbouring=R1)",
    ),
    (
        "calibrate eps=1000, T=1, two-stage fixed, participant",
        "calibrate_noise_multiplier(FIXED, 1, 1e3, DELTA, PART)",
    ),
    (
        "calibrate eps=1.5, T=2000, two-stage fixed, delta 1e-6 (note: 8.65)",
        "calibrate_noise_multiplier(FIXED, 2000, 1.5, 1e-6)",
    ),
]


def peak_rss_mb() -> float:
    """This process's peak resident set since exec (Linux VmHWM; ru_maxrss keeps the parent's)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(expression: str) -> None:
    """Child process: evaluate one query, print value, seconds and peak RSS as JSON."""
    value, seconds = timed(lambda: eval(expression))  # noqa: S307 - benchmark table entries
    print(json.dumps({"value": value, "seconds": seconds, "rss_mb": peak_rss_mb()}))


def part_extremes() -> None:
    print("\n#### Extremes, one fresh process each (wall time of the query; peak RSS)\n")
    print("| query | result | s | peak RSS (MB) |")
    print("|---|---|---|---|")
    for label, expression in _EXTREMES:
        out = subprocess.run(
            [sys.executable, __file__, "--one", expression],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            print(f"| {label} | error: {out.stderr.strip().splitlines()[-1]} | - | - |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        v = r["value"]
        shown = "-" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
        print(f"| {label} | {shown} | {r['seconds']:.2f} | {r['rss_mb']:.0f} |")


# --------------------------------------------------------------------------------- sweep


def part_sweep() -> None:
    print("\n#### Sweep: slowest query of each kind (cold caches)\n")
    schemes = {"default two-stage Poisson": DEFAULT, "two-stage fixed 5 of 50": FIXED}
    zs, rounds, targets = (0.1, 1.0, 10.0, 100.0), (1, 10**3, 10**6, 10**9), (0.1, 1.0, 10.0, 1e3)
    worst: dict[str, tuple[float, str]] = {}
    count: dict[str, int] = {}

    def record(kind: str, label: str, f: Callable[[], Any]) -> None:
        clear_caches()
        try:
            _, s = timed(f)
        except ValueError as error:  # a range end: part of the contract, timed as well
            s, label = 0.0, f"{label} -> ValueError: {error}"
        count[kind] = count.get(kind, 0) + 1
        if s >= worst.get(kind, (-1.0, ""))[0]:
            worst[kind] = (s, label)

    cases = itertools.product(
        schemes.items(), ("add_remove", "replace_one"), ("task", "participant")
    )
    for (name, scheme), rel, unit in cases:
        for z, t in itertools.product(zs, rounds):
            event = GaussianRound(scheme, z, CAP, rel)  # type: ignore[arg-type]
            record("epsilon", f"{name}, {rel}, {unit}, z={z}, T={t}",
                   lambda e=event, t=t, u=unit: epsilon([(e, t)], DELTA, u))  # fmt: skip
        for z, b in itertools.product(zs, targets):
            event = GaussianRound(scheme, z, CAP, rel)  # type: ignore[arg-type]
            record("max_rounds", f"{name}, {rel}, {unit}, z={z}, eps={b}",
                   lambda e=event, b=b, u=unit: max_rounds(e, b, DELTA, u))  # fmt: skip
        for t, b in itertools.product(rounds, targets):
            record(
                "calibrate",
                f"{name}, {rel}, {unit}, T={t}, eps={b}",
                lambda s=scheme, t=t, b=b, u=unit, r=rel: calibrate_noise_multiplier(
                    s, t, b, DELTA, u, max_tasks_per_participant=CAP, neighbouring=r
                ),
            )
    print("| query | cases | slowest (s) | slowest case |")
    print("|---|---|---|---|")
    for kind, (s, label) in worst.items():
        print(f"| {kind} | {count[kind]} | {s:.2f} | {label} |")
    print(f"\nPeak RSS of the whole sweep (one process, caches included): {peak_rss_mb():.0f} MB")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        run_one(sys.argv[2])
        return
    if sys.argv[1:] == ["--sweep-only"]:
        part_sweep()
        return
    print(
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()}, {os.cpu_count()} cores, loadavg at start {os.getloadavg()}"
    )
    part_reference()
    part_extremes()
    if "--sweep" in sys.argv:  # in a fresh process: its peak RSS is the sweep's alone
        sys.stdout.flush()
        subprocess.run([sys.executable, __file__, "--sweep-only"], check=True)
    print(f"\nloadavg at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
