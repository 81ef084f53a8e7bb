"""Fixtures for the deployment tests: the network-namespace harness, skipped with the reason printed
where this machine cannot create namespaces (not root, no `ip`) or lacks a tool the multi-host
federation runs; and, after the session's last deploy test, the check that nothing the tests
started is left: no network namespace, and no container, pod, network or volume of their compose
projects (``nothing_left_behind``)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.deploy.netns import (
    Network,
    namespaces_left,
    netns_unavailable,
    nginx_unavailable,
    tc_unavailable,
)


def _skip(reason: str) -> None:
    print(f"\n[deploy] skipping: {reason}", file=sys.stderr)  # shown even without -ra
    pytest.skip(reason)


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip when namespaces are unusable, and say why on stderr (shown even without -ra)."""
    reason = netns_unavailable()
    if reason is not None:
        _skip(f"network-namespace tests: {reason}")


@pytest.fixture(scope="session")
def multihost_tools(netns_ok: None) -> None:
    """Skip, with the reason, where this machine lacks a tool the multi-host federation runs."""
    for tool in ("openssl", "ssh-keygen"):
        if shutil.which(tool) is None:
            _skip(f"`{tool}` not found (Debian: apt-get install openssl openssh-client)")
    reason = tc_unavailable()
    if reason:
        _skip(reason)
    if not (Path(sys.executable).parent / "flower-superlink").is_file():
        _skip(f"flower-superlink not beside {sys.executable}")
    reason = nginx_unavailable()
    if reason:
        # The multi-machine layout lets participants in only through the Fleet-only proxy: the
        # tests check that layout or nothing, never a quieter one. nginx that is there but fails
        # to start fails the test (LocalFederation reports nginx's own error).
        _skip(f"{reason}: the Fleet-only proxy of the multi-machine guide is part of this test")


@pytest.fixture
def network3(netns_ok: None) -> Iterator[Network]:
    """One server host and three participant hosts on a bridge; participant 2 shaped to 8 Mbit/s."""
    with Network(participants=3, shaped={2: "8mbit"}) as net:
        yield net


@pytest.fixture(scope="session")
def podman_images() -> dict[str, str]:
    """podman set up and fedmeta's images built once for every compose test of the session."""
    from tests.deploy.compose_engine import podman_with_images

    return podman_with_images()


@pytest.fixture(scope="session")
def podman_dashboards(podman_images: dict[str, str]) -> dict[str, str]:
    """``podman_images`` and the ``dashboards`` profile's local Prometheus image, built once."""
    from tests.deploy.compose_engine import with_prometheus_image

    return with_prometheus_image()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After the session's deploy tests (each xdist worker: its own tests), fail if anything they
    started is still there: a network namespace of theirs, or a container, pod, network or volume
    of a compose project they started on podman (matched by the projects' names and compose's
    project label only: what anyone else runs is neither looked at nor touched). Docker Engine's
    projects are checked by scripts/compose-smoke.sh's cleanup, before its engine stops."""
    yield
    from tests.deploy import compose_engine

    left = [f"network namespace {ns}" for ns in namespaces_left()]
    if compose_engine.STARTED and shutil.which("podman"):
        env = compose_engine.podman_env()
        left += compose_engine.podman_leftovers(env, compose_engine.STARTED)
    assert not left, f"the deploy tests left behind: {', '.join(left)}"
