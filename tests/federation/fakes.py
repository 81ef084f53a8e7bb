"""Test doubles: an in-memory ledger with a linear epsilon (so tests do not pay for PLD).

It is patched into ``server.privacy`` - the one seam between the round loop and ``accounting``.
Schemes, events and the sampler stay real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest


class FakeBudgetExhausted(RuntimeError):
    pass


@dataclass(frozen=True)
class FakeRecord:
    run_id: str
    round_index: int
    event: Any


class FakeLedger:
    """epsilon = eps_per_round * number of spends (task level); participant level = 2x."""

    def __init__(self, budget: float, eps_per_round: float) -> None:
        self.budget = budget
        self.eps_per_round = eps_per_round
        self._records: list[FakeRecord] = []
        self.spend_calls = 0

    def _over(self) -> bool:
        return (len(self._records) + 1) * self.eps_per_round > self.budget + 1e-12

    def would_exceed(self, event: Any) -> bool:
        return self._over()

    def spend(self, event: Any, run_id: str, round_index: int) -> FakeRecord:
        self.spend_calls += 1
        if self._over():
            raise FakeBudgetExhausted("budget")
        rec = FakeRecord(run_id, round_index, event)
        self._records.append(rec)
        return rec

    def rounds(self) -> list[tuple[Any, int]]:
        groups: dict[Any, int] = {}
        for r in self._records:
            groups[r.event] = groups.get(r.event, 0) + 1
        return list(groups.items())

    def epsilon(self, unit: str = "task", method: str = "pld") -> float:
        return len(self._records) * self.eps_per_round * (2 if unit == "participant" else 1)

    def rounds_affordable(self, event: Any) -> int:
        return int(self.budget / self.eps_per_round + 1e-9) - len(self._records)

    def records(self) -> list[FakeRecord]:
        return list(self._records)

    def position(self) -> int:
        return len(self._records)


def install_fake_privacy(monkeypatch: pytest.MonkeyPatch, ledger: FakeLedger) -> None:
    import server.privacy as priv

    monkeypatch.setattr(priv, "open_ledger", lambda cfg, out, fid: ledger)
    monkeypatch.setattr(priv, "calibrate_z", lambda cfg, scheme, rounds, target: 1.0)

    def eps_for(groups: list[tuple[Any, int]], delta: float, unit: str = "task") -> float:
        n = sum(c for _, c in groups)
        return n * ledger.eps_per_round * (2 if unit == "participant" else 1)

    monkeypatch.setattr(priv, "epsilon_for", eps_for)
    monkeypatch.setattr(priv, "published_epsilon", lambda e, r, d: None)
    monkeypatch.setattr(priv, "budget_exhausted_error", lambda: FakeBudgetExhausted)
