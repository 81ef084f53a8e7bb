"""Hosts: where a deployed federation's processes run.

A *host* is anything with ``popen``, ``run`` and ``kill``: this machine (:class:`LocalHost`), or
a network namespace (tests/deploy/netns.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class Host(Protocol):
    """Where processes run: this machine, or a network namespace (tests/deploy/netns.py)."""

    name: str
    address: str

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in its own process group."""

    def run(
        self, cmd: Sequence[str], *, timeout: float = 60, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` to completion."""

    def kill(self, proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        """Signal ``proc``'s process group."""


@dataclass
class LocalHost:
    """This machine (loopback)."""

    name: str = "local"
    address: str = "127.0.0.1"
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in its own process group (so a kill reaches what it started)."""
        kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(list(cmd), **kwargs)
        self.procs.append(proc)
        return proc

    def run(
        self, cmd: Sequence[str], *, timeout: float = 60, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` with a timeout; ``check``: raise on a non-zero status."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        res: subprocess.CompletedProcess[str] = subprocess.run(
            list(cmd), timeout=timeout, check=False, **kwargs
        )
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr[-500:]}")
        return res

    def kill(self, proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        """Signal ``proc``'s process group (ignored once it has ended)."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
