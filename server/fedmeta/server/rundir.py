"""One run per output directory: an exclusive lock held for the whole run.

Two runs writing into the same directory would replace each other's model, summary and plots. The
run takes ``fcntl.flock`` on ``<out>/.fedmeta.lock`` for as long as it lives; the kernel releases it
when the process ends, also after kill -9, so a crashed run never leaves a stale lock behind. A
second run is refused with one line naming the holder (pid, host, start time, command), which the
holder writes into the lock file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".fedmeta.lock"


class RunDirectoryBusy(RuntimeError):
    """Another process is running in this output directory."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "another process"
    started = info.get("started_day", "an unknown day")
    return f"pid {info.get('pid')} on {info.get('host')} since {started} ({info.get('command')})"


@contextlib.contextmanager
def exclusive_run_directory(out_dir: Path) -> Iterator[None]:
    """Hold the directory's lock for the block; refuse at once if another run holds it."""
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryBusy(
                f"{out_dir} is in use by {_holder(path)}; wait for it to end or use another --out"
            ) from None
        # The day only (UTC): the lock file stays in a private run's outputs, and a finer time
        # would release when the run started (issue 39, item 6).
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started_day": time.strftime("%Y-%m-%d", time.gmtime()),
                "command": " ".join(sys.argv)[:200]}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        try:
            yield
        finally:
            _remove_if_only_the_lock(out_dir, created)
    finally:
        os.close(fd)


def _remove_if_only_the_lock(out_dir: Path, created: bool) -> None:
    """A run that fails before writing anything leaves no empty directory behind."""
    if created and {p.name for p in out_dir.iterdir()} == {LOCK_NAME}:
        (out_dir / LOCK_NAME).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            out_dir.rmdir()
