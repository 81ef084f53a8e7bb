"""A Docker Engine for the compose test on a machine that has none running.

Where ``docker info`` already answers (the user's own engine), that engine is used as it is.
Otherwise, as root with apt-get: Debian's ``docker.io`` is installed if ``dockerd`` is absent, and
``dockerd`` is started as a plain process (no systemd) with its own socket, data root, exec root
and pid file under ``$FEDMETA_DOCKER_DIR`` (default ``/var/tmp/fedmeta-docker``), so that it
touches no engine of the machine's. It keeps Docker's default networking (its bridge and iptables
rules, as an installed Docker Engine has them). It is ended by its process id afterwards; its
bridge and rules stay, as after stopping a Docker service, and its image store stays for the next
run's layer cache.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DIR = Path(os.environ.get("FEDMETA_DOCKER_DIR", "/var/tmp/fedmeta-docker"))


def answers(env: dict[str, str]) -> bool:
    """Whether a Docker Engine answers the Docker CLI with this environment."""
    if shutil.which("docker") is None:
        return False
    try:
        res = subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30,
                             check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0


def unavailable() -> str | None:
    """Why this machine can neither use nor start a Docker Engine (None: it can)."""
    if answers(dict(os.environ)):
        return None
    if shutil.which("docker") is None:
        return "no Docker CLI"
    if os.geteuid() != 0:
        return "no Docker Engine answers, and starting one (dockerd) needs root"
    if shutil.which("dockerd") is None and shutil.which("apt-get") is None:
        return "no Docker Engine answers, no dockerd, and no apt-get to install Debian's docker.io"
    return None


def _install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker.io"]
    for cmd in (["apt-get", "update", "-q"], install):
        subprocess.run(cmd, env=env, capture_output=True, timeout=1200, check=True)


@contextlib.contextmanager
def docker_engine() -> Iterator[dict[str, str]]:
    """The environment (``DOCKER_HOST``) of an engine that answers, started here if need be."""
    env = dict(os.environ)
    if answers(env):
        yield env
        return
    if shutil.which("dockerd") is None:
        _install()
    DIR.mkdir(parents=True, exist_ok=True)
    sock = DIR / "docker.sock"
    env["DOCKER_HOST"] = f"unix://{sock}"
    with (DIR / "dockerd.log").open("ab") as log:
        proc = subprocess.Popen(
            ["dockerd", "--host", env["DOCKER_HOST"], "--data-root", str(DIR / "data"),
             "--exec-root", str(DIR / "exec"), "--pidfile", str(DIR / "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not answers(env):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (DIR / "dockerd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"dockerd did not answer on {sock}:\n{tail}")
            time.sleep(1)
        yield env
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
