"""How ``fedmeta deploy`` reaches a SuperLink: TLS settings, the ``flwr`` CLI in its own home.

Every deploy command that reaches the SuperLink (``run``, ``register``, ``status``) names one
connection, :data:`CONNECTION`, in a temporary ``FLWR_HOME`` (:func:`flwr_home`), so the operator's
own Flower configuration is neither read nor changed. A reason a command cannot go on is a
:class:`DeployError`: one line and the exit status it maps to.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fedmeta import exitcodes

CONNECTION = "fedmeta"


class DeployError(RuntimeError):
    """A one-line reason the command cannot go on, with the exit status it maps to."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def refused(command: str, error: DeployError) -> int:
    """Print ``error`` as ``fedmeta deploy COMMAND``'s one line; its exit status."""
    print(f"fedmeta deploy {command}: {error}", file=sys.stderr)
    return error.status


def tls_settings(args: argparse.Namespace) -> tuple[Path | None, bool]:
    """(CA file, insecure): exactly one of the two, checked."""
    ca, insecure = args.root_certificates, bool(args.insecure)
    if ca is not None and insecure:
        raise DeployError("give --root-certificates or --insecure, not both", exitcodes.BAD_INPUT)
    if ca is None and not insecure:
        raise DeployError(
            "--root-certificates CA (the federation's ca.crt) is required; --insecure (no TLS) "
            "only for a local test on a private network",
            exitcodes.BAD_INPUT,
        )
    if ca is not None and not Path(ca).is_file():
        raise DeployError(f"--root-certificates {ca}: no such file", exitcodes.BAD_INPUT)
    return (Path(ca).resolve() if ca is not None else None), insecure


def flwr_bin() -> str:
    """The ``flwr`` CLI beside this interpreter (the one installed with fedmeta), else on PATH."""
    beside = Path(sys.executable).parent / "flwr"
    found = str(beside) if beside.is_file() else shutil.which("flwr")
    if found is None:
        raise DeployError(
            "the flwr CLI is not installed (pip install fedmeta)", exitcodes.BAD_INPUT
        )
    return found


@contextlib.contextmanager
def flwr_home(superlink: str, ca: Path | None) -> Iterator[dict[str, str]]:
    """An environment whose ``flwr`` knows one connection, ``fedmeta``, in a temporary home."""
    with tempfile.TemporaryDirectory(prefix="fedmeta-flwr-") as home:
        tls = f"root-certificates = {json.dumps(str(ca))}" if ca else "insecure = true"
        Path(home, "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f"address = {json.dumps(superlink)}\n{tls}\n"
        )
        env = dict(os.environ, FLWR_HOME=home, FLWR_TELEMETRY_ENABLED="0",
                   FLWR_DISABLE_UPDATE_CHECK="1")  # fmt: skip
        yield env


def flwr(
    env: Mapping[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``flwr ARGS`` with a timeout; a timeout is a failed call (returncode 124)."""
    cmd = [flwr_bin(), *args]
    try:
        return subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(
            cmd, 124, "", f"flwr {args[0]}: no answer in {timeout} s"
        )


def json_in(text: str) -> dict[str, Any]:
    """The JSON object in ``flwr --format json`` output (it may print lines before it)."""
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in flwr's output: {text[-300:]!r}")
    loaded: dict[str, Any] = json.loads(text[start:])
    return loaded
