"""`fedmeta deploy local`'s teardown ends what its processes started in sessions of their own.

The SuperLink starts its executor (and the executor its ServerApp) detached, in a session of its
own, so the process-group signals that end the SuperLink miss them; the teardown pins every
descendant first and ends those still running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tests.deploy.procs import running

from fedmeta.cli.process_tree import descendants, end_pinned, pin

pytestmark = pytest.mark.integration


def test_a_detached_grandchild_is_pinned_and_ended_after_its_parents_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "detached.pid"
    parent = subprocess.Popen(["sh", "-c", f"setsid sleep 300 & echo $! > {pidfile}; wait"],
                              start_new_session=True)  # fmt: skip
    detached = 0
    try:
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "the grandchild never started"
            time.sleep(0.05)
        detached = int(pidfile.read_text())
        while os.getpgid(detached) == parent.pid and time.monotonic() < deadline:
            time.sleep(0.05)  # setsid() is under way
        assert os.getpgid(detached) != parent.pid
        assert detached in descendants(parent.pid)
        pinned = pin(descendants(parent.pid))
        os.killpg(parent.pid, signal.SIGKILL)  # the group signal: the detached one survives it
        parent.wait(timeout=10)
        assert running(detached)
        end_pinned(list(pinned.values()), grace_s=5.0)
        deadline = time.monotonic() + 10
        while running(detached) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(detached)
    finally:
        parent.kill()
        if detached and running(detached):  # the test failed: end what it started
            os.kill(detached, signal.SIGKILL)
