"""The ``fedmeta`` command line: the entry layer on top of server, client and simulation.

Each sub-command lives next to the code it drives and exposes ``register(subparsers)``; this module
imports them plainly. The registering modules import nothing heavy at module level, so
``fedmeta privacy ...`` never pays for importing torch or Flower (a test checks).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fedmeta.cli import deploy, evaluate, plan_config
from fedmeta.server import exporter
from fedmeta.simulation import simulate

#: Each is ``register(subparsers) -> None``, in the order ``fedmeta --help`` lists them. The
#: accounting commands (privacy, ledger) come through plan_config, which hands ``privacy plan``
#: the configuration writer (accounting knows no configuration).
_REGISTRARS = (
    plan_config.register,
    simulate.register,
    exporter.register,
    evaluate.register,
    deploy.register,
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="fedmeta",
        description="Differentially private federated meta-learning.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for register in _REGISTRARS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)
