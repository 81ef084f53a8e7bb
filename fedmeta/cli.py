"""The ``fedmeta`` command line: one entry point, sub-commands registered by their own packages.

Each sub-command lives next to the code it drives and exposes ``register(subparsers)``. Modules are
imported only when they are registered, and the registration functions themselves import nothing
heavy, so ``fedmeta privacy ...`` never pays for importing torch or Flower.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (module, attribute): each attribute is ``register(subparsers) -> None``.
_COMMAND_MODULES: tuple[tuple[str, str], ...] = (
    # accounting's privacy and ledger commands, handed the configuration writer of `privacy plan`.
    ("fedmeta.plan_config", "register"),
    ("simulation.simulate", "register"),
    ("server.exporter", "register"),
    ("fedmeta.evaluate", "register"),
    ("fedmeta.deployment", "register"),
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="fedmeta",
        description="Differentially private federated meta-learning.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name, attribute in _COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # Only a missing module *of ours* is tolerated (a partial install); a missing
            # third-party dependency inside it is a real error that the user must see.
            if error.name == module_name:
                continue
            raise
        getattr(module, attribute)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
