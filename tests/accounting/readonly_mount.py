"""Run a command with a directory bind-mounted read-only, in a private mount namespace.

As root, ``chmod`` does not stop writes, so "read-only" is tested the way a deployment makes it: a
read-only mount (``unshare -m`` + ``mount --bind -o ro``). Only the command's namespace sees the
read-only mount; the rest of the machine is untouched. Where namespaces or mounts are not
permitted (unprivileged CI, some containers) the caller skips with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_SCRIPT = 'mount --bind -o ro "$0" "$0" && exec "$@"'


def readonly_prefix(directory: Path) -> list[str]:
    """Prefix a command with this to run it with ``directory`` mounted read-only."""
    unshare = shutil.which("unshare")
    assert unshare is not None
    return [unshare, "-m", "--propagation", "private", "sh", "-c", _SCRIPT, str(directory)]


def need_readonly_mount(directory: Path) -> list[str]:
    """The prefix, or skip (printing why) when a read-only bind mount cannot be made here."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("read-only mount test needs `unshare` and `mount` (util-linux)")
    probe = subprocess.run(
        [*readonly_prefix(directory), "sh", "-c", 'touch "$0/.probe"', str(directory)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if (directory / ".probe").exists():
        (directory / ".probe").unlink()
        pytest.skip("the bind mount was not read-only here (touch succeeded)")
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.strip()}")
    return readonly_prefix(directory)
