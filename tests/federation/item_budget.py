"""A budget on image data named by its items, as the tests of budgets by content spend it.

Shared by test_content_budget.py (issue 39) and test_item_identity.py (issue 52): a budget worth
three rounds of ``EVENT`` (not four), a small configuration of two participants over the data at
a path, what those participants' own ClientApp code registers (their item sets; also
test_overlap_release.py's), and a run that spends the whole budget.
"""

from __future__ import annotations

from pathlib import Path

from fedmeta.accounting import FlatPoissonScheme, GaussianRound, epsilon
from fedmeta.client.gradients import registration
from fedmeta.client_config import client_config
from fedmeta.config import Config
from fedmeta.config_io import load_config
from fedmeta.protocol import RegisterRequest
from fedmeta.server.startup import open_budget
from fedmeta.server.transport import Registered

EVENT = GaussianRound(FlatPoissonScheme(0.05), 1.0)
DELTA = 1e-5
BUDGET = epsilon([(EVENT, 3)], DELTA, "task") * 1.0001  # three rounds, not four


def budget_config(name: str, path: Path, db: Path, *extra: str) -> Config:
    """Two participants over the image data at ``path`` (``dataset.name``), spending from ``db``."""
    return load_config(None, [
        f"dataset.name={name}", f"dataset.path={path}", "dataset.ways=3", "dataset.shots=1",
        "dataset.query=1", "dataset.tasks_per_participant=5", "dataset.partition=even",
        "dataset.split=background", "federation.participants=2",
        "sampling.participants_per_round=1", f"privacy.ledger_path={db}",
        f"privacy.epsilon_budget={BUDGET!r}", f"privacy.delta={DELTA}", *extra,
    ])  # fmt: skip


def registered(cfg: Config) -> list[Registered]:
    """What the participants' own ClientApp code tells the server (their item sets)."""
    request = RegisterRequest("run", client_config(cfg).model_dump_json())
    return [
        Registered(reg.participant_id, 100 + i, reg.task_count, reg.data_fingerprint)
        for i, reg in enumerate(registration(request, str(i)) for i in range(2))
    ]


def spend_all(cfg: Config) -> str:
    """Spend the whole budget (three rounds) on ``cfg``'s data; its federation id."""
    with open_budget(cfg, registered(cfg)) as ledger:
        for i in range(3):
            ledger.spend(EVENT, "first", i)
        assert ledger.would_exceed(EVENT)
        return ledger.federation_id
