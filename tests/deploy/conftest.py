"""Fixtures for the deployment tests: the network-namespace harness, skipped with the reason printed
where this machine cannot create namespaces (not root, no `ip`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.deploy.netns import Network, netns_unavailable


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip when namespaces are unusable, and say why on stderr (shown even without -ra)."""
    reason = netns_unavailable()
    if reason is not None:
        print(f"\n[deploy] skipping network-namespace tests: {reason}", file=sys.stderr)
        pytest.skip(reason)


@pytest.fixture
def network3(netns_ok: None) -> Iterator[Network]:
    """One server host and three participant hosts on a bridge; participant 2 shaped to 8 Mbit/s."""
    with Network(participants=3, shaped={2: "8mbit"}) as net:
        yield net
