"""Benchmark of accounting/: `python bench/accounting.py` (prints a markdown table)."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import tempfile
import time

# This file is named like the package it measures: run as a script, its own folder would shadow
# `accounting`. Put the repository root first instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

from dp_accounting import dp_event, rdp

from accounting import (  # noqa: E402
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    TwoStagePoissonScheme,
    epsilon,
    max_rounds,
)


def timed(f):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    r = f()
    return r, time.perf_counter() - t


def main() -> None:
    print(
        f"date {datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, loadavg {os.getloadavg()}"
    )
    two = GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 1.0)
    flat = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    try:  # Opacus imports torch: only the benchmark uses it, never accounting/.
        from opacus.accountants import PRVAccountant
    except ImportError:
        PRVAccountant = None
    print(
        "| T | two-stage eps (PLD) | s | plain Poisson q=0.01 eps (dp-accounting RDP) | s "
        "| plain Poisson (fedmeta PLD) | s | plain Poisson (Opacus PRV) | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for t in (1_000, 10_000, 100_000):
        e, s = timed(lambda: epsilon([(two, t)], 1e-6))
        acc = rdp.RdpAccountant()

        def r():  # type: ignore[no-untyped-def]
            acc.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), t)
            return acc.get_epsilon(1e-6)

        er, sr = timed(r)
        ep, sp = timed(lambda: epsilon([(flat, t)], 1e-6))
        if PRVAccountant is not None:
            prv = PRVAccountant()
            prv.history = [(1.0, 0.01, t)]
            eo, so = timed(lambda: prv.get_epsilon(1e-6))
            opa = f"{eo:.3f} | {so:.2f}"
        else:
            opa = "n/a | n/a"
        print(f"| {t} | {e:.3f} | {s:.2f} | {er:.3f} | {sr:.3f} | {ep:.3f} | {sp:.2f} | {opa} |")
    with tempfile.TemporaryDirectory() as d:
        ledger = BudgetLedger.open(os.path.join(d, "l.db"), "bench", 2.96, 1e-6)
        n, t0 = 0, time.perf_counter()
        while not ledger.would_exceed(flat):
            ledger.spend(flat, "bench", n)
            n += 1
        total = time.perf_counter() - t0
    print(
        f"ledger: {n} rounds until exhausted, check+spend amortised "
        f"{1000 * total / n:.2f} ms/round "
        f"(includes the one-off max-rounds search)"
    )
    m, s = timed(lambda: max_rounds(flat, 2.96, 1e-6))
    print(
        f"max_rounds(flat q=0.01, z=1, eps=2.96): {m} in {s:.2f} s; "
        f"eps(T)={epsilon([(flat, m)], 1e-6):.5f}, eps(T+1)={epsilon([(flat, m + 1)], 1e-6):.5f}"
    )


if __name__ == "__main__":
    main()
