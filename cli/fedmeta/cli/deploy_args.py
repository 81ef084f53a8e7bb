"""The flags several ``fedmeta deploy`` commands share, defined once so their defaults agree.

``run`` and ``status`` read the same node-keys file and the same runs directory (``status`` shows
the runs ``run`` recorded there), and every command that reaches a SuperLink takes the same
connection flags; each default comes from the same environment variable in every command. Light
on purpose: ``fedmeta --help`` imports it (argparse, os and pathlib only).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_connection_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--superlink``, ``--root-certificates``, ``--insecure``; defaults from the environment."""
    env = os.environ.get
    p.add_argument("--superlink", default=env("FEDMETA_SUPERLINK", "127.0.0.1:8000"),
                   help=f"host:port of the SuperLink's {what} (default $FEDMETA_SUPERLINK or "
                   "127.0.0.1:8000)")  # fmt: skip
    p.add_argument("--root-certificates", type=Path, default=env("FEDMETA_TLS_CA") or None,
                   help="the federation's CA certificate (default $FEDMETA_TLS_CA)")  # fmt: skip
    p.add_argument("--insecure", action="store_true",
                   default=env("FEDMETA_INSECURE", "0") == "1",
                   help="no TLS: only on a private network for local tests (default "
                   "$FEDMETA_INSECURE=1)")  # fmt: skip


def add_node_keys_arg(p: argparse.ArgumentParser, use: str) -> None:
    """``--node-keys``: the ``[federation.node_keys]`` TOML (``use``: what the command does)."""
    p.add_argument("--node-keys", type=Path, default=os.environ.get("FEDMETA_NODE_KEYS") or None,
                   help=f"[federation.node_keys] TOML: {use} (default $FEDMETA_NODE_KEYS)")


def add_runs_dir_arg(p: argparse.ArgumentParser, use: str) -> None:
    """``--runs-dir``: where ``deploy run`` puts new runs and records them (``use``: here)."""
    p.add_argument("--runs-dir", default=os.environ.get("FEDMETA_RUNS_DIR", "runs"),
                   help=f"{use} (default $FEDMETA_RUNS_DIR or runs)")
