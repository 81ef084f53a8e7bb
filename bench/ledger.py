"""Benchmark of the ledger's spend: `python bench/ledger.py [--spends N] [--dir DIR]`.

Measures, on a real file (fsyncs included: put --dir on the disk the ledger will live on):

* the write-lock hold time of a spend (from ``BEGIN IMMEDIATE`` to the end of ``COMMIT``), for
  spends whose affordability search is cached and for the first spend of a new kind of round,
  whose PLD search now runs *before* the lock is taken;
* a spend's end-to-end time (what the round loop waits for);
* how long a second writer waits while a first spend is searching (it used to wait the whole
  search, and ``fedmeta ledger show`` failed with "database is locked").

Prints markdown. No assertion on time anywhere (tests never time things).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Run as a script, bench/ would come first on sys.path; put the repository root first instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import fedmeta.accounting.ledger.budget as ledger_module  # noqa: E402  (the module spend runs in)
from fedmeta.accounting import (  # noqa: E402
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    TwoStagePoissonScheme,  # noqa: E402
)

_HOLDS: list[float] = []
_real_immediate = ledger_module.immediate_transaction


@contextmanager
def _timed_immediate(conn: object) -> Iterator[None]:
    """``immediate_transaction``, timed from BEGIN IMMEDIATE to the end of COMMIT (or ROLLBACK)."""
    t0 = time.perf_counter()
    try:
        with _real_immediate(conn):  # type: ignore[arg-type]
            yield
    finally:
        _HOLDS.append(time.perf_counter() - t0)


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return (
        f"median {1000 * statistics.median(ordered):.2f} ms, p95 {1000 * p95:.2f} ms, "
        f"max {1000 * ordered[-1]:.2f} ms (n={len(ordered)})"
    )


def cached_spends(path: str, spends: int) -> tuple[list[float], list[float]]:
    event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    with BudgetLedger.open(path, "bench", 50.0, 1e-6) as ledger:
        ledger.rounds_affordable(event)  # the one search, before timing
        _HOLDS.clear()
        ends = []
        for i in range(spends):
            t0 = time.perf_counter()
            ledger.spend(event, "bench", i)
            ends.append(time.perf_counter() - t0)
        return list(_HOLDS), ends


def first_spend_of_a_new_round(path: str) -> tuple[float, float]:
    """A two-stage round never seen before: its spend pays the mixture PLD search."""
    event = GaussianRound(TwoStagePoissonScheme(100, 10, 0.1), 1.0)
    with BudgetLedger.open(path, "bench", 50.0, 1e-6) as ledger:
        _HOLDS.clear()
        t0 = time.perf_counter()
        ledger.spend(event, "bench-new", 0)
        return max(_HOLDS), time.perf_counter() - t0


def second_writer_wait(path: str) -> tuple[float, float]:
    """While a spend searches (a new kind of round), time another writer's spend (cached)."""
    slow_event = GaussianRound(TwoStagePoissonScheme(100, 10, 0.12), 1.0)
    fast_event = GaussianRound(FlatPoissonScheme(0.01), 1.0)
    other = BudgetLedger.open(path, "bench", 50.0, 1e-6)
    other.rounds_affordable(fast_event)  # its search, before anything is timed
    entered = threading.Event()
    real_search = ledger_module.max_rounds
    searched: list[float] = []

    def signalling_search(*args: Any, **kwargs: Any) -> int:
        if threading.current_thread().name == "slow-spender":
            entered.set()
        return int(real_search(*args, **kwargs))

    def slow() -> None:
        with BudgetLedger.open(path, "bench") as ledger:
            t0 = time.perf_counter()
            ledger.spend(slow_event, "slow", 0)
            searched.append(time.perf_counter() - t0)

    ledger_module.max_rounds = signalling_search  # type: ignore[assignment]
    thread = threading.Thread(target=slow, name="slow-spender")
    thread.start()
    entered.wait()
    time.sleep(0.5)  # well inside a search of seconds
    t0 = time.perf_counter()
    other.spend(fast_event, "fast", 0)
    waited = time.perf_counter() - t0
    thread.join()
    other.close()
    ledger_module.max_rounds = real_search  # type: ignore[assignment]
    return waited, searched[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spends", type=int, default=300)
    parser.add_argument(
        "--dir", default=None, help="where the ledger files go (default: a temp dir)"
    )
    args = parser.parse_args()
    ledger_module.immediate_transaction = _timed_immediate  # type: ignore[assignment]
    print(
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, loadavg at start {os.getloadavg()}, SQLite "
        f"{ledger_module.sqlite3.sqlite_version}, journal_mode=DELETE synchronous=EXTRA"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        holds, ends = cached_spends(os.path.join(d, "a.sqlite"), args.spends)
        print(f"- lock hold, cached search: {_ms(holds)}")
        print(f"- spend end to end, cached search: {_ms(ends)}")
        hold, end = first_spend_of_a_new_round(os.path.join(d, "a.sqlite"))
        print(
            f"- first spend of a new two-stage round: lock hold {1000 * hold:.2f} ms, end to end "
            f"{end:.2f} s (the PLD search, now outside the lock)"
        )
        waited, searched = second_writer_wait(os.path.join(d, "b.sqlite"))
        print(
            f"- a second writer's spend while a first spend searched for {searched:.2f} s: "
            f"{1000 * waited:.2f} ms"
        )
    print(f"loadavg at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
