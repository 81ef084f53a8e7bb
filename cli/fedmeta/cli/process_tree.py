"""The processes below a process, and ending them safely: what ``deploy local`` tears down.

Read from /proc (Linux). A process is pinned by a pidfd before it is signalled, so a signal sent
later can only reach that process, never one that reused its id.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Sequence
from pathlib import Path


def _parents() -> dict[int, int]:
    """Process id -> its parent's id, from one read of /proc (Linux)."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parent_of


def child_commands(pid: int) -> dict[int, str]:
    """Child process id -> command line, from /proc (Linux)."""
    out: dict[int, str] = {}
    for child, parent in _parents().items():
        if parent == pid:
            with contextlib.suppress(OSError):
                out[child] = (
                    Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from one read of /proc."""
    parent_of = _parents()
    found: list[int] = []
    frontier = {pid}
    while frontier:
        below = [child for child, parent in parent_of.items() if parent in frontier]
        found += below
        frontier = set(below)
    return found


def pin(pids: Sequence[int]) -> dict[int, int]:
    """Pin the processes of ``pids`` still running: pid -> pidfd.

    A pidfd names its process even after the pid is reused, so a signal sent through it later can
    only reach that process.
    """
    fds: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            fds[pid] = os.pidfd_open(pid)
    return fds


def end_pinned(fds: Sequence[int], grace_s: float) -> None:
    """SIGTERM each pinned process, SIGKILL what still runs after ``grace_s``; close the fds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for fd in fds:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, sig)
        # A pidfd turns readable when its process ends.
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(select.select(fds, [], [], 0)[0]) < len(fds):
            time.sleep(0.1)
    for fd in fds:
        os.close(fd)
