"""The ``fedmeta`` commands: names, one-line help, and how each registers, imported only when run.

``fedmeta --help`` needs every command's name and one-line help, but not its flags; a command
needs its own module and nothing else. So the top-level parser is built from :data:`COMMANDS`
alone, and only the command the command line names is registered in full: ``fedmeta ledger show``
never imports the planner (scipy through the accountant's calibration) or Flower, and
``fedmeta --version`` imports no command at all (tests/test_startup.py checks the imports,
bench/cli_latency.py measures the time). Each registrar imports its module in its body, a plain
import statement, so the import graph still shows the edge (no module names in strings).

The help text here is what ``fedmeta --help`` shows before a command is chosen; a test checks it
against the text each module registers (tests/test_cli_conventions.py).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """A top-level command: its name, its one-line help, and ``register(subparsers)``."""

    name: str
    help: str
    register: Callable[[Any], None]


def _privacy(subparsers: Any) -> None:
    from fedmeta.cli import plan_config

    plan_config.register(subparsers)


def _ledger(subparsers: Any) -> None:
    """``ledger`` with fedmeta's ledgers: the state directory's, and experiments' by name."""
    from fedmeta.cli import ledger
    from fedmeta.paths import default_ledger_path, epsilon_cache_path, experiment_ledger_path

    ledger.register(
        subparsers, default_ledger=default_ledger_path(secure=True),
        experiment_ledger=lambda name: experiment_ledger_path(experiment_name(name), secure=True),
        epsilon_cache=epsilon_cache_path(),
    )  # fmt: skip


def experiment_name(name: str) -> str:
    """``--experiment NAME`` of the ledger commands: a name ``privacy.experiment`` accepts."""
    from fedmeta.config_privacy import EXPERIMENT_NAME

    if not re.fullmatch(EXPERIMENT_NAME, name):
        raise argparse.ArgumentTypeError(
            f"must be 1-64 letters, digits, '.', '_' or '-' (as privacy.experiment); got {name!r}"
        )
    return name


def _simulate(subparsers: Any) -> None:
    from fedmeta.simulation import simulate

    simulate.register(subparsers)


def _tune(subparsers: Any) -> None:
    from fedmeta.cli import tune

    tune.register(subparsers)


def _exporter(subparsers: Any) -> None:
    from fedmeta.server import exporter

    exporter.register(subparsers)


def _evaluate(subparsers: Any) -> None:
    from fedmeta.cli import evaluate

    evaluate.register(subparsers)


def _deploy(subparsers: Any) -> None:
    from fedmeta.cli import deploy

    deploy.register(subparsers)


#: In the order ``fedmeta --help`` lists them.
COMMANDS: tuple[Command, ...] = (
    Command("privacy", "privacy accounting and planning", _privacy),
    Command("ledger", "inspect, back up and manage a budget ledger", _ledger),
    Command("simulate", "run a federation locally (in-process Flower grid, or Ray)", _simulate),
    Command("tune", "train candidate configurations on private data, choose on validation, "
            "pay for all", _tune),  # fmt: skip
    Command("exporter", "serve the budget ledger's cumulative state as Prometheus metrics",
            _exporter),  # fmt: skip
    Command("evaluate", "score a checkpoint on held-out tasks and Lake et al.'s one-shot runs",
            _evaluate),  # fmt: skip
    Command("deploy", "deployed federations (Flower SuperLink / SuperNodes): run, worker, ...",
            _deploy),  # fmt: skip
)


def named_in(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs, or None: its first word not a flag (top-level flags take none)."""
    words = [w for w in argv if not w.startswith("-")]
    names = {c.name for c in COMMANDS}
    return words[0] if words and words[0] in names else None
