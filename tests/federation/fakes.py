"""The run's ledger in tests: the accounting package's contract-tested fake (a linear epsilon).

``opener(ledger)`` hands it to ``run_federation``/``execute`` as ``open_ledger``; schemes, events,
the sampler, validation and noise stay real.
"""

from __future__ import annotations

from typing import Any

from tests.accounting.fakes import LinearLedger

__all__ = ["LinearLedger", "fake_ledger", "opener"]


def fake_ledger(budget: float, eps_per_round: float, **kw: Any) -> LinearLedger:
    """A fake federation budget where every round costs ``eps_per_round``."""
    return LinearLedger(epsilon_budget=budget, eps_per_round=eps_per_round, delta=1e-5, **kw)


def opener(fake: LinearLedger) -> Any:
    """``open_ledger`` for run_federation / execute, always answering ``fake``."""
    return lambda cfg, identity: fake
