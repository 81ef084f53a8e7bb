"""The compose federation on podman from the documented commands only (scripts/compose-smoke.sh):
`scripts/podman-setup.sh all` where no Docker Engine answers (packages, base image, API socket,
healthcheck runner), `docker compose up -d --build`, `docker compose exec serverapp fedmeta deploy
run` (4 rounds), `flwr run .` from this checkout (3 rounds; its status and summary are checked, as
it exits 0 either way), `fedmeta deploy run` again to budget_exhausted (the runs compose in the same
ledger; a third deploy run of 1 round over the spent data exits 0, charged to nobody), the
exporter's view of the ledger, `down -v`.

Run on podman (set up as the guide says), plain, with the overlay that runs the SuperLink and
SuperNodes from Flower's images (--flower-images), and that with TLS; the same on Docker Engine:
tests/deploy/test_compose_docker_engine.py. The whole sequence runs once, on podman's plain files;
the overlays and Docker Engine run ``--quick`` (up, the image checks, one run of 2 rounds, its 2
spends in the exporter, down): how runs compose in the ledger does not depend on the engine or the
overlay, and the whole sequence took 5-7 minutes a test in the deploy suite (issue 41: the suite
in 20 minutes). `slow`. Every compose test shares one set of images,
built once per test session by the ``podman_images`` fixture (scripts/compose-build.sh;
tests/deploy/compose_engine.py); these run the script with --no-build and --no-setup
(``podman-setup.sh all``, whose check is a compose project of its own, also ran once, in the
fixture). Each test has its own project name and host ports (compose_engine.smoke), so a compose
test of another file can run beside it (``pytest -n 2``: one worker per file). Skipped only where
it cannot run: not root (podman-setup installs packages) or no apt-get, with the reason."""

from __future__ import annotations

import os

import pytest
from tests.deploy.compose_engine import smoke

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.e2e]


# The script's own steps are bounded by their timeouts; the test's bound covers them all.
def _smoke_on_podman(images: dict[str, str], *more: str) -> str:
    """``smoke`` through podman, on the images the session's ``podman_images`` fixture built once
    (tests/deploy/compose_engine.py: podman-setup.sh all, compose-build.sh podman)."""
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}  # podman-setup sets it
    return smoke("podman", {**env, **images}, "--no-build", "--no-setup", *more)


@pytest.mark.timeout(5700)
def test_compose_federation_on_podman(podman_images: dict[str, str]) -> None:
    _smoke_on_podman(podman_images)


@pytest.mark.timeout(5700)
def test_compose_federation_on_flowers_images_on_podman(podman_images: dict[str, str]) -> None:
    """The overlay deploy/compose/flower-images.yml: the SuperLink and SuperNodes from Flower's
    published images (or, where no registry has them, the stand-ins built to their contract, which
    the script says), fedmeta's worker beside each SuperNode; the same runs and ledger checks."""
    out = _smoke_on_podman(podman_images, "--flower-images", "--quick")
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
    out = _smoke_on_podman(podman_images, "--flower-images", "--tls", "--quick")
    assert "as uid 49999, without fedmeta" in out
