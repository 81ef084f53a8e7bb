"""The compose tests' podman and images, set up once per test session (tests/deploy/conftest.py).

``scripts/podman-setup.sh all`` (packages, base image, the Docker-compatible API, healthchecks)
and ``scripts/compose-build.sh podman`` (fedmeta's two images, one engine build each) run once;
every compose test of the session then runs compose with ``--no-build``. Before, each of the five
compose tests built its images again through ``docker compose build`` (issue 41: the deploy suite
did not fit in 25 minutes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def podman_unavailable() -> str | None:
    """Why scripts/podman-setup.sh cannot run here, or None."""
    if os.geteuid() != 0:
        return "scripts/podman-setup.sh (packages, the API service) needs root"
    if shutil.which("apt-get") is None:
        return "scripts/podman-setup.sh needs Debian's apt-get"
    return None


def _script(*args: str, timeout: float) -> str:
    res = subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, check=False)  # fmt: skip
    assert res.returncode == 0, f"{' '.join(args)}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
    return res.stdout


def podman_with_images() -> dict[str, str]:
    """The environment for compose over podman, its images built; skipped where it cannot run."""
    reason = podman_unavailable()
    if reason:
        pytest.skip(reason)
    _script("scripts/podman-setup.sh", "all", timeout=3600)
    print(_script("scripts/compose-build.sh", "podman", timeout=5400), end="")
    return _podman_env()


def with_prometheus_image() -> dict[str, str]:
    """``podman_with_images``' environment once the ``dashboards`` profile's local Prometheus
    image exists (``podman-setup.sh dashboards``: Debian's package on the local base image, kept
    once built), which ``env`` then exports as FEDMETA_PROMETHEUS_IMAGE. Without it the
    dashboards test on podman would skip after ``podman-setup.sh all``, which does not build it.
    """
    print(_script("scripts/podman-setup.sh", "dashboards", timeout=1800), end="")
    return _podman_env()


def _podman_env() -> dict[str, str]:
    """This environment with what ``podman-setup.sh env`` exports (its own DOCKER_HOST)."""
    exports = _script("scripts/podman-setup.sh", "env", timeout=120)
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    for line in exports.splitlines():
        # `export A=1 B=2` lines of plain words (podman-setup.sh prints them so)
        for pair in line.removeprefix("export ").split():
            key, _, value = pair.partition("=")
            env[key] = value.strip("'")
    return env


def compose_cli() -> list[str]:
    """``docker compose`` where the Docker CLI has the plugin, else the static Compose binary."""
    res = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60,
                         check=False) if shutil.which("docker") else None  # fmt: skip
    if res is not None and res.returncode == 0:
        return ["docker", "compose"]
    return [_script("scripts/podman-setup.sh", "compose-bin", timeout=60).strip()]
