"""Benchmark of accounting/: `python bench/accounting.py`; prints markdown for the docs."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# This file is named like the package it measures: run as a script, its own folder would shadow
# `accounting`. Put the repository root first instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

from dp_accounting import dp_event, rdp  # noqa: E402

from accounting import (  # noqa: E402
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    TwoStagePoissonScheme,
    composition,  # noqa: E402
    epsilon,
    max_rounds,
)


def timed(f: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    r = f()
    return r, time.perf_counter() - t


def rdp_poisson(t: int) -> float:
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), t)
    return float(acc.get_epsilon(1e-6))


def main() -> None:
    print(
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()}, {os.cpu_count()} cores, loadavg at start {os.getloadavg()}"
    )
    two = GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 1.0)
    flat = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    try:  # Opacus imports torch: only this benchmark uses it, never accounting/.
        from opacus.accountants import PRVAccountant
    except ImportError:
        PRVAccountant = None
    print(
        "| T | two-stage eps (PLD) | s | plain Poisson: dp-accounting RDP | s "
        "| plain Poisson: fedmeta PLD | s | plain Poisson: Opacus PRV | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for t in (1_000, 10_000, 100_000):
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
    for label, event, budget in (
        ("flat Poisson q=0.01", flat, 2.96),
        ("two-stage 10 of 100, q2=0.1", two, 11.35),
    ):
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
            f"ledger ({label}, budget {budget}): {n} rounds until exhausted; would_exceed+spend "
            f"amortised {1000 * total / n:.2f} ms/round including the one-off max-rounds search; "
            f"cached would_exceed {1000 * check:.3f} ms"
        )
        for cached in (
            composition._pld_one_round,
            composition._composed_group,
            composition._rdp_one_round,
        ):
            cached.cache_clear()  # time max_rounds from cold caches
        m, s = timed(lambda event=event, budget=budget: max_rounds(event, budget, 1e-6))
        print(
            f"max_rounds({label}, z=1, eps={budget}): {m} in {s:.2f} s (cold caches); "
            f"eps(T)={epsilon([(event, m)], 1e-6):.5f}, "
            f"eps(T+1)={epsilon([(event, m + 1)], 1e-6):.5f}"
        )
    print(f"loadavg at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
