"""An operator-only diagnostic log: which participant failed in which round, and why (issue 39).

A participant whose ClientApp raises every round or times out must leave a trace its operator can
read, yet everything a private run writes to its outputs, metrics, logs or progress lines is a
release, and which participant failed depends on the round's secret sample. So the names go to
one place only, off the release path: ``<state directory>/operator-log/<run id>.log`` (the
state directory already holds the ledger, which is as private), created with mode 0600, one line
per failing participant per round: ``round N participant P: reason (detail)``. Nothing here is
printed, exported, checkpointed or copied into the run's output directory; the released records
keep counting failures by reason only (server/fedmeta/server/releases.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from fedmeta.paths import state_dir

LOG_DIR = "operator-log"


def operator_log_path(run_id: str) -> Path:
    """Where a run's operator log lives (the state directory; never the output directory)."""
    safe = "".join(c for c in run_id if c.isalnum() or c in "-_") or "run"
    return state_dir() / LOG_DIR / f"{safe}.log"


def log_failures(run_id: str, round_number: int, failures: Iterable[tuple[str, str, str]]) -> None:
    """Append ``(participant, reason, detail)`` lines for one round; a write failure is ignored.

    The log is a diagnostic: a full disk must not stop a round whose spend is already recorded.
    """
    lines = [
        f"round {round_number} participant {pid}: {reason}" + (f" ({detail})" if detail else "")
        for pid, reason, detail in failures
    ]
    if not lines:
        return
    path = operator_log_path(run_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
    except OSError:
        pass
