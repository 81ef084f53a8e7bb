#!/usr/bin/env python3
"""Byte-compile what the images' services load, and nothing else (an image build step).

pip compiles every module it installs: 241 MB of ``.pyc`` in these images, most of it for modules
no service imports (sympy's printers, scipy's unused subpackages). The Dockerfile deletes them
all, then runs this with byte-code writing on: each module imported here is compiled once, into
the image. Without any ``.pyc`` every process start would recompile torch's Python code (about
5 s more per start, measured on 2 cores); with these it starts as before. A module that a service
imports and this does not is compiled in memory when it is imported: slower then, never wrong.

Loaded: every console script of flwr and fedmeta (the SuperLink, SuperExec, SuperNode, ServerApp
and ClientApp processes, ``fedmeta``), the modules behind fedmeta's ServerApp, ClientApp, warm
worker and exporter, and one short in-process private run of the default job, which goes through
the accountant (scipy, dp_accounting), the noise, torch's optimizer (it imports torch._dynamo and
sympy) and the participants' MAML. Its ledger and outputs are in a temporary directory of the
build stage, which the images do not contain.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

import torch

# The modules behind the services (imported for their byte-code).
import fedmeta.cli  # noqa: F401
import fedmeta.client.app  # noqa: F401
import fedmeta.client.worker  # noqa: F401
import fedmeta.deploy  # noqa: F401  (the package data `fedmeta deploy local` runs)
import fedmeta.metalearning.omniglot  # noqa: F401
import fedmeta.metalearning.warm_start  # noqa: F401
import fedmeta.server.app  # noqa: F401
import fedmeta.server.exporter  # noqa: F401

# Ray (flwr-simulation's engine) is not in the images: its entry point cannot load and is not used.
NOT_INSTALLED = {"flwr-simulation"}


def load_console_scripts() -> None:
    """Import the module behind each flwr and fedmeta console script."""
    for script in entry_points(group="console_scripts"):
        if script.dist is None or script.dist.name not in {"flwr", "fedmeta"}:
            continue
        try:
            script.load()
        except ImportError as error:
            if script.name not in NOT_INSTALLED:
                raise SystemExit(f"compile-used: {script.name} does not load: {error}") from error


def run_a_short_private_job() -> None:
    """Two private rounds of the default job, its ledger and outputs in temporary directories."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            ["fedmeta", "simulate", "--out", f"{out}/run", "--experiment", "image-build",
             "--set", "rounds=2", "--set", "output.plots=false", "--set", "output.progress=false",
             "--set", "dataset.validation_tasks=8", "--set", "dataset.test_tasks=8"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip


def main() -> None:
    """Load the services' modules; check that byte-code was written; say how much."""
    load_console_scripts()
    run_a_short_private_job()
    written = list(Path(torch.__file__).parent.rglob("*.pyc"))
    if not written:
        raise SystemExit(
            "compile-used: no byte-code was written (PYTHONDONTWRITEBYTECODE set, or a read-only "
            "environment?): the images would recompile torch's code at every start"
        )
    print(f"compile-used: {len(sys.modules)} modules loaded here, and a short run's; "
          f"{len(written)} byte-code files under torch")  # fmt: skip


if __name__ == "__main__":
    main()
