"""The compose federation on Docker Engine from the documented commands (scripts/compose-smoke.sh
--engine docker; the steps: tests/deploy/test_compose_podman.py), plain and with the overlay that
runs the SuperLink and SuperNodes from Flower's images, each ``--quick`` (one run of 2 rounds; the
whole sequence of runs is podman's plain test).

The engine: the machine's own Docker Engine where one answers, else Debian's docker.io started
here (tests/deploy/docker_engine.py), once for both tests (``engine``: this module's tests share
one worker under ``pytest -n 2``, whose default ``--dist loadfile`` keeps a file together).

The images: this test run's one build, podman's (the session's ``podman_images``), copied into
the engine (--images-from-podman: ``podman save | docker load``, about 15 s, and nothing where the
engine holds that build already) and run with ``up --no-build``: the Docker Engine path of
docs/deploy.md from ``up`` on. Its ``up --build`` under Docker Engine (the classic builder of
Debian's docker.io 20.10), about 5 minutes more per test here, runs with FEDMETA_DOCKER_BUILD=1.
`slow`; skipped only where no engine can be had (no Docker CLI; not root; no dockerd and no
apt-get), with the reason.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from tests.deploy import docker_engine
from tests.deploy.compose_engine import smoke

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def engine(podman_images: dict[str, str]) -> Iterator[dict[str, str]]:
    """The environment (DOCKER_HOST) of one Docker Engine for this module's tests, podman's images
    of this session built first (``podman_images``) so that they can be copied into it."""
    reason = docker_engine.unavailable()
    if reason is not None:
        print(f"\n[deploy] skipping: Docker Engine tests: {reason}", file=sys.stderr)
        pytest.skip(reason)
    with docker_engine.docker_engine() as env:
        yield env


def _smoke_on_docker_engine(env: dict[str, str], *more: str) -> str:
    """``smoke`` on ``engine``, on podman's images of this session unless FEDMETA_DOCKER_BUILD=1
    asks for a build in Docker Engine."""
    if os.environ.get("FEDMETA_DOCKER_BUILD") != "1":
        more = ("--images-from-podman", *more)
    out = smoke("docker", env, "--quick", *more)
    assert "compose-smoke: Docker Engine" in out
    if "--images-from-podman" in more:
        assert "podman's store" in out or "this engine holds podman's build" in out, out
    return out


@pytest.mark.timeout(5700)
def test_compose_federation_on_docker_engine(engine: dict[str, str]) -> None:
    """The machine's Docker Engine, or one started here (tests/deploy/docker_engine.py)."""
    _smoke_on_docker_engine(engine)


@pytest.mark.timeout(5700)
def test_compose_federation_on_flowers_images_on_docker_engine(engine: dict[str, str]) -> None:
    """The Flower-images overlay on Docker Engine, whose new named volumes start root-owned (the
    one-shot superlink-state-owner gives the SuperLink's to Flower's uid 49999)."""
    out = _smoke_on_docker_engine(engine, "--flower-images")
    assert "as uid 49999, without fedmeta" in out
