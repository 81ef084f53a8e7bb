"""``rounds.csv``: one row per round record.

The released columns and, where a run allows them, the private diagnostics (docs/privacy.md lists
which is which).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedmeta.checkpoint import atomic_write_bytes
from fedmeta.server.report import RoundOutcome

CSV_FIELDS = [
    "round", "mode", "status", "participants_sampled", "participants_replied",
    "participants_failed", "epsilon", "epsilon_participant", "loss", "validation_metric", "clip",
]  # fmt: skip


DIAGNOSTIC_FIELDS = [
    "tasks_requested", "tasks_received", "norm_violations", "nonfinite", "clipped_fraction",
    "round_seconds", "aggregation_seconds",
]  # fmt: skip


def csv_row(outcome: RoundOutcome, private: bool) -> dict[str, Any]:
    """One ``rounds.csv`` row of a round's record."""
    row: dict[str, Any] = {
        "round": outcome.round,
        "mode": "private" if private else "NON-PRIVATE",
        "status": outcome.status,
        "participants_sampled": outcome.participants_sampled,
        "participants_replied": outcome.participants_replied,
        "participants_failed": outcome.participants_failed,
        "epsilon": outcome.epsilon_task,
        "epsilon_participant": outcome.epsilon_participant,
        "loss": outcome.train_loss,
        "validation_metric": outcome.validation_metric,
        "clip": outcome.clip,
    }
    if outcome.diagnostics is not None:
        d = outcome.diagnostics
        row.update({name: getattr(d, name) for name in DIAGNOSTIC_FIELDS})
    return row


def write_rounds_csv(
    out_dir: Path, outcomes: Sequence[RoundOutcome], private: bool, diagnostics: bool
) -> Path:
    """``rounds.csv``: one row per round; diagnostic columns only where they are allowed."""
    buf = io.StringIO()
    fields = CSV_FIELDS + (DIAGNOSTIC_FIELDS if diagnostics else [])
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for outcome in outcomes:
        writer.writerow({k: "" if v is None else v for k, v in csv_row(outcome, private).items()})
    path = Path(out_dir) / "rounds.csv"
    atomic_write_bytes(path, buf.getvalue().encode())
    return path
