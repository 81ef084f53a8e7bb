"""`fedmeta deploy participant`'s supervisor signals each child exactly once (issue 41).

Flower's SuperNode restores the default action after its first SIGTERM; a second SIGTERM ends it
before it deactivates. A signal to the supervisor's whole process group (Ctrl-C in a terminal)
must therefore reach the children once, from the supervisor, not also from the terminal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

#: A child that counts the SIGTERMs it receives for a while after the first, then writes them.
_CHILD = textwrap.dedent(
    """
    import signal, sys, time
    out, seen = sys.argv[1], []
    signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    open(out + ".ready", "w").close()
    while not seen:
        time.sleep(0.05)
    time.sleep(1.0)  # any second SIGTERM (the group's and the supervisor's) arrives meanwhile
    open(out, "w").write(str(len(seen)))
    """
)

_SUPERVISOR = textwrap.dedent(
    """
    import sys
    from fedmeta.cli.deploy_participant import supervise
    child = [sys.executable, "-c", sys.argv[1]]
    sys.exit(supervise({"a": child + [sys.argv[2]], "b": child + [sys.argv[3]]}, grace_s=10))
    """
)


def _wait_for(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not written within {timeout_s} s: {paths}"
        time.sleep(0.05)


@pytest.mark.parametrize("to_group", [True, False], ids=["process-group", "supervisor-alone"])
def test_each_child_gets_one_sigterm(tmp_path: Path, to_group: bool) -> None:
    outs = [tmp_path / "a", tmp_path / "b"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SUPERVISOR, _CHILD, *map(str, outs)], start_new_session=True
    )
    try:
        _wait_for([p.with_suffix(".ready") for p in outs], 60)
        if to_group:  # what Ctrl-C in the supervisor's terminal does
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        _wait_for(outs, 10)
        assert [p.read_text() for p in outs] == ["1", "1"]
    finally:
        if proc.poll() is None:
            proc.kill()
