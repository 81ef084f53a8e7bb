"""Fixtures: a ledger with spends, a synthetic run driven through the observer, and the exposition
page of both the live observer and the exporter (every metric fedmeta exports)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedmeta.server.report import RoundDiagnostics, RoundOutcome, RunFinished, RunStarted

FED = "sinusoid-test"
BUDGET = 8.0
DELTA = 1e-5


def gaussian_round() -> Any:
    from fedmeta.accounting import GaussianRound, TwoStagePoissonScheme

    return GaussianRound(TwoStagePoissonScheme(20, 4, 0.5), 2.0, max_tasks_per_participant=10)


def spend(db: Path, run_id: str, rounds: int, start: int = 0) -> tuple[float, float]:
    """Record ``rounds`` spends for ``run_id``; return (task eps, participant eps) afterwards."""
    from fedmeta.accounting import BudgetLedger

    event = gaussian_round()
    with BudgetLedger.open(db, FED, BUDGET, DELTA) as ledger:
        for i in range(start, start + rounds):
            ledger.spend(event, run_id, i)
        return (
            float(ledger.epsilon(unit="task", method="pld")),
            float(ledger.epsilon(unit="participant", method="rdp")),
        )


def synthetic_run(
    observer: Any, run_id: str, rounds: int, eps: tuple[float, float], diagnostics: bool = True
) -> None:
    observer.run_started(
        RunStarted(
            run_id=run_id,
            federation_id=FED,
            private=True,
            epsilon_budget=BUDGET,
            delta=DELTA,
            noise_multiplier=2.0,
            clip=1.0,
            planned_rounds=rounds,
            rounds_affordable=100,
            epsilon_spent_task=0.0,
            epsilon_spent_participant=0.0,
            participants_registered=20,
            metric_name="mse",
            diagnostics=diagnostics,
        )
    )
    for r in range(1, rounds + 1):
        diag = RoundDiagnostics(
            tasks_requested=12, tasks_received=9, norm_violations=0, nonfinite=0,
            clipped_fraction=0.25, norm_quantiles={0.5: 0.8, 0.9: 1.2}, round_seconds=0.2,
            aggregation_seconds=0.01, compute_seconds_per_task=(0.02, 0.03),
        )  # fmt: skip
        observer.round_finished(
            RoundOutcome(
                run_id=run_id,
                federation_id=FED,
                round=r,
                participants_registered=20,
                participants_sampled=4,
                participants_replied=3,
                participants_failed=1,
                failures={"timeout": 1},
                train_loss=1.0 / r,
                validation_metric=0.5,
                epsilon_task=eps[0] * r / rounds,
                epsilon_participant=eps[1] * r / rounds,
                rounds_affordable=100 - r,
                ledger_position=r,
                noise_std=2.0,
                clip=1.0,
                diagnostics=diag if diagnostics else None,
            )
        )
    observer.run_finished(
        RunFinished(
            run_id=run_id,
            federation_id=FED,
            rounds_completed=rounds,
            stopped_reason="planned",
            epsilon_spent_task=eps[0],
            epsilon_spent_participant=eps[1],
            final_metric=0.4,
            final_metric_ci95=(0.3, 0.5),
        )
    )


def write_summary(run_dir: Path, run_id: str, rounds: int, eps: tuple[float, float]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "run_id": run_id,
                "federation_id": FED,
                "rounds_completed": rounds,
                "stopped_reason": "planned",
                "epsilon_spent": eps[0],
                "epsilon_participant_level": eps[1],
                "delta": DELTA,
                "epsilon_budget": BUDGET,
                "final_metric": 0.4,
                "final_metric_ci95": [0.3, 0.5],
            }
        )
    )


@pytest.fixture(scope="session")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Both exposition pages (observer + exporter) after a synthetic run with diagnostics on."""
    from prometheus_client import generate_latest

    from fedmeta.server.monitoring.ledger import exporter_registry
    from fedmeta.server.monitoring.live import PrometheusRunObserver

    tmp = tmp_path_factory.mktemp("exposition")
    eps = spend(tmp / "ledger.sqlite", "run-1", 3)
    write_summary(tmp / "runs" / "run-1", "run-1", 3, eps)
    obs = PrometheusRunObserver()
    synthetic_run(obs, "run-1", 3, eps)
    registry, collector = exporter_registry(tmp / "ledger.sqlite", [tmp / "runs"])
    try:
        return generate_latest(obs.registry).decode() + generate_latest(registry).decode()
    finally:
        collector.close()
