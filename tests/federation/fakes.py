"""Test doubles: an in-memory ledger with a linear epsilon (so tests do not pay for PLD).

It is handed to the run as ``open_ledger`` (server.run.run_federation); schemes, events, the
sampler, validation and noise stay real.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accounting import BudgetExhausted, GaussianRound


@dataclass(frozen=True)
class FakeRecord:
    run_id: str
    round_index: int
    event: GaussianRound


class LinearLedger:
    """epsilon = eps_per_round x spends (task level); participant level = 2x."""

    def __init__(self, budget: float, eps_per_round: float, path: str = "/fake/ledger.sqlite"):
        self.epsilon_budget = budget
        self.eps_per_round = eps_per_round
        self.delta = 1e-5
        self.unit = "task"
        self.federation_id = "fake-federation"
        self.ledger_id = "fake-ledger"
        self.path = Path(path)
        self._records: list[FakeRecord] = []
        self.spend_calls = 0

    def _over(self) -> bool:
        return (len(self._records) + 1) * self.eps_per_round > self.epsilon_budget + 1e-12

    def would_exceed(self, event: GaussianRound) -> bool:
        return self._over()

    def spend(self, event: GaussianRound, run_id: str, round_index: int) -> FakeRecord:
        self.spend_calls += 1
        if self._over():
            raise BudgetExhausted("budget", epsilon_after=0.0, epsilon_budget=self.epsilon_budget)
        record = FakeRecord(run_id, round_index, event)
        self._records.append(record)
        return record

    def rounds(self) -> list[tuple[GaussianRound, int]]:
        groups: dict[GaussianRound, int] = {}
        for r in self._records:
            groups[r.event] = groups.get(r.event, 0) + 1
        return list(groups.items())

    def epsilon(self, unit: str | None = None, method: str = "pld") -> float:
        return len(self._records) * self.eps_per_round * (2 if unit == "participant" else 1)

    def rounds_affordable(self, event: GaussianRound) -> int:
        return int(self.epsilon_budget / self.eps_per_round + 1e-9) - len(self._records)

    def records(self) -> list[FakeRecord]:
        return list(self._records)

    def position(self) -> int:
        return len(self._records)

    def close(self) -> None:
        pass


def opener(ledger: LinearLedger) -> Any:
    """``open_ledger`` for run_federation / execute, always answering ``ledger``."""
    return lambda cfg, identity: ledger
