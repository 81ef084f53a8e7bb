"""Child processes run side by side, each stopped cleanly by a signal to their parent (issue 51).

bench/paper_table.py ``--side-by-side N`` starts a row's runs N at a time, each as a process of
its own on the same device (its own state directory, ledger, sampling and noise: nothing is shared
but the device and the read-only public data). This module is the process side of it:

* each child runs in a session of its own, so a terminal's Ctrl-C or ``timeout``'s signal to the
  parent's process group does not reach it twice (once from the group, once forwarded: a second
  signal aborts a run instead of recording it as interrupted); the parent forwards SIGINT once per
  signal it receives, so the first one stops every run at a round's end (each recorded as
  interrupted) and a second aborts them;
* each child starts with SIGINT and SIGTERM blocked (the mask survives ``exec``) and unblocks them
  once its own handler is in place (:func:`ready_for_signals`): a signal that arrives while
  Python starts is held, never lost and never a bare ``KeyboardInterrupt`` before the run exists;
* on Linux each child asks to be killed when its parent dies (``PR_SET_PDEATHSIG``): a window's
  hard kill of the parent does not leave runs holding the device.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Loaded here, not between fork and exec (where a library load may take a lock another thread held).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


class Children:
    """The child processes running now: what a signal to this process is forwarded to."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop  # set by the first signal (:func:`forward_signals`)
        self.live: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], out: Path, err: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` with stdout to ``out`` and stderr to ``err``, signals held (above).

        This process holds its own signals while it starts the child, so that one arriving
        meanwhile is forwarded to it as well, once: it is either handled before (then the child
        is sent its SIGINT here) or after the child is among ``live``.
        """
        parent = os.getpid()
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            stopped = self.stop.is_set()
            with out.open("wb") as stdout, err.open("wb") as stderr:
                proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=lambda: _child_setup(parent))  # fmt: skip
            self.live.append(proc)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        if stopped:
            proc.send_signal(signal.SIGINT)
        return proc

    def forward(self, signum: int) -> None:
        for proc in self.live:
            if proc.poll() is None:
                proc.send_signal(signum)

    def wait(self, on_end: Callable[[subprocess.Popen[bytes]], None]) -> None:
        """Until every child has ended, ``on_end`` each as it ends (in the order they end)."""
        while self.live:
            for proc in [p for p in self.live if p.poll() is not None]:
                self.live.remove(proc)
                on_end(proc)
            time.sleep(0.2)


def _child_setup(parent: int) -> None:
    """In the child, before ``exec``: hold SIGINT/SIGTERM; die with the parent (Linux)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the request: go now
            os._exit(1)


def ready_for_signals() -> None:
    """In a child whose handler is now in place: deliver the signals held since it started."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def forward_signals(stop: threading.Event, children: Children) -> Callable[[], Any]:
    """Every SIGINT/SIGTERM sets ``stop`` (no batch starts) and is forwarded to each child as one
    SIGINT: the first stops their runs (recorded as interrupted), a second aborts them. Returns a
    function that restores the previous handlers."""

    def handler(signum: int, _frame: Any) -> None:
        again = stop.is_set()
        stop.set()
        children.forward(signal.SIGINT)
        print("stopping: " + ("the runs in progress are aborted (no record)" if again else
              "each run in progress stops and is recorded as interrupted, no run starts "
              "(signal again to abort them)"), file=sys.stderr, flush=True)  # fmt: skip

    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    return lambda: [signal.signal(sig, old) for sig, old in previous.items()]
