"""A Docker Engine for the compose test on a machine that has none running.

Where a Docker Engine already answers (the user's own; not podman's Docker-compatible API), that
engine is used as it is: the compose test then builds and tags ``fedmeta-server:dev``,
``fedmeta-participant:dev`` and, without a registry, ``localhost/fedmeta-base:bookworm`` in it.
Otherwise, as root with apt-get: Debian's ``docker.io`` is installed if ``dockerd`` is absent (on a
systemd host that starts Docker's own service, which is then used), and ``dockerd`` is started as a
plain process (no systemd) with its own socket, data root, exec root and pid file under
``$FEDMETA_DOCKER_DIR`` (default ``/var/tmp/fedmeta-docker``). It keeps Docker's default
networking (the ``docker0`` bridge and Docker's iptables chains, shared with any other Docker
Engine of the machine). It is ended with its process group afterwards (its containerd and
shims included); the bridge and rules stay, as after stopping a Docker service, and its image
store stays for the next run's layer cache.
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
    """Whether a Docker Engine (not podman's API) answers the Docker CLI with this environment."""
    if shutil.which("docker") is None:
        return False
    try:
        # podman's API names its components "Podman Engine", ...; Docker Engine's "Engine", ...
        res = subprocess.run(["docker", "version", "--format",
                              "{{range .Server.Components}}{{.Name}};{{end}}"],
                             env=env, capture_output=True, text=True, timeout=30,
                             check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0 and "podman" not in res.stdout.lower()


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
        if answers(env):  # a systemd host started Docker's own service with the package
            yield env
            return
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
            proc.send_signal(signal.SIGTERM)  # dockerd stops its containers and containerd
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its session is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
