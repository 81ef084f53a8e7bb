"""The compose federation from the documented commands only (scripts/compose-smoke.sh):
`scripts/podman-setup.sh all` where no Docker Engine answers (packages, base image, API socket,
healthcheck runner), `docker compose up -d --build`, `docker compose exec serverapp fedmeta deploy
run` (4 rounds), `flwr run .` from this checkout (3 rounds; its status and summary are checked, as
it exits 0 either way), `fedmeta deploy run` again to budget_exhausted (the runs compose in the same
ledger; a third deploy run finds nothing left and exits 3), the exporter's view of the ledger,
`down -v`.

Run on both engines: podman (set up by the script, as the guide says) and Docker Engine (the
machine's own, or Debian's docker.io started here: tests/deploy/docker_engine.py); and with the
overlay that runs the SuperLink and SuperNodes from Flower's images (--flower-images), on both
engines, and with TLS on podman.
`slow`. The podman tests share one set of images, built once per test session by the
``podman_images`` fixture (scripts/compose-build.sh; tests/deploy/compose_engine.py), and run
the script with --no-build and --no-setup (``podman-setup.sh all``, whose check is a compose
project of its own, also ran once, in the fixture); the Docker Engine tests build in their own
engine (FEDMETA_SMOKE_NO_BUILD=1 skips that where the images exist). Skipped only where it
cannot run: not root (podman-setup installs packages; dockerd needs root) or no apt-get, with the
reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.deploy import docker_engine

# One compose project at a time: each publishes 127.0.0.1:8000 and 9464 (the dashboards 9090), so
# under `pytest -m deploy -n 2 --dist loadgroup` these files share one worker.
pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.xdist_group("compose")]  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]


def _smoke(engine: str, env: dict[str, str], *more: str) -> str:
    """scripts/compose-smoke.sh on ``engine`` (and ``more`` of its flags); its output, checked."""
    args = ["--engine", engine, *more]
    if os.environ.get("FEDMETA_SMOKE_NO_BUILD") == "1":
        args.append("--no-build")
    # `flwr run .` against the federation: the flwr CLI installed with fedmeta, beside this
    # interpreter when the environment is not activated (`.venv/bin/python -m pytest`).
    beside = Path(sys.executable).parent / "flwr"
    flwr_cli = str(beside) if beside.is_file() else (shutil.which("flwr") or "")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "compose-smoke.sh"), *args], cwd=ROOT,
                         env={**env, "FEDMETA_FLWR": flwr_cli},
                         capture_output=True, text=True, timeout=5400, check=False)  # fmt: skip
    print(res.stdout)  # the run's record (pytest -s or -rP shows it)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "compose-smoke: ok" in res.stdout
    assert "stopped: budget_exhausted" in res.stdout
    if "--tls" not in more:  # `flwr run .` is the step without TLS (compose-smoke.sh, 3b)
        assert "compose-smoke: flwr run . (run" in res.stdout
    assert "compose-smoke: the participant image reads PNG drawings" in res.stdout
    return res.stdout


# The image build alone can take 20 minutes on 2 shared cores (docs/benchmarks.md); the script's
# own steps are bounded by their timeouts.
def _smoke_on_podman(images: dict[str, str], *more: str) -> str:
    """_smoke through podman, on the images the session's ``podman_images`` fixture built once
    (tests/deploy/compose_engine.py: podman-setup.sh all, compose-build.sh podman)."""
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}  # podman-setup sets it
    return _smoke("podman", {**env, **images}, "--no-build", "--no-setup", *more)


def _smoke_on_docker_engine(*more: str) -> str:
    """_smoke on the machine's Docker Engine, or one started here (docker_engine.py)."""
    reason = docker_engine.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with docker_engine.docker_engine() as env:
        out = _smoke("docker", env, *more)
    assert "compose-smoke: Docker Engine" in out
    return out


@pytest.mark.timeout(5700)
def test_compose_federation_on_podman(podman_images: dict[str, str]) -> None:
    _smoke_on_podman(podman_images)


@pytest.mark.timeout(5700)
def test_compose_federation_on_flowers_images_on_podman(podman_images: dict[str, str]) -> None:
    """The overlay deploy/compose/flower-images.yml: the SuperLink and SuperNodes from Flower's
    published images (or, where no registry has them, the stand-ins built to their contract, which
    the script says), fedmeta's worker beside each SuperNode; the same runs and ledger checks."""
    out = _smoke_on_podman(podman_images, "--flower-images")
    # Which images ran is said: Flower's published ones, a mirror's given ones, or the stand-ins.
    said = ("compose-smoke: Flower's published images", "compose-smoke: Flower's images as given",
            "stand-ins built from deploy/images/flower-standin.Dockerfile")  # fmt: skip
    assert any(line in out for line in said)
    assert "as uid 49999, without fedmeta" in out


@pytest.mark.timeout(5700)
def test_compose_federation_on_flowers_images_with_tls_on_podman(
    podman_images: dict[str, str],
) -> None:
    """The same with TLS and node authentication: the four files of docs/deploy.md, the keys
    readable by fedmeta's and Flower's users (--owner 10001:49999 --group-read)."""
    out = _smoke_on_podman(podman_images, "--flower-images", "--tls")
    assert "as uid 49999, without fedmeta" in out


@pytest.mark.timeout(5700)
def test_compose_federation_on_docker_engine() -> None:
    """The machine's Docker Engine, or one started here (tests/deploy/docker_engine.py)."""
    _smoke_on_docker_engine()


@pytest.mark.timeout(5700)
def test_compose_federation_on_flowers_images_on_docker_engine() -> None:
    """The Flower-images overlay on Docker Engine, whose new named volumes start root-owned (the
    one-shot superlink-state-owner gives the SuperLink's to Flower's uid 49999)."""
    out = _smoke_on_docker_engine("--flower-images")
    assert "as uid 49999, without fedmeta" in out
