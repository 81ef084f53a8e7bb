"""Shared test fixtures: paths to optional data, the GPU marker, quiet Flower and Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never phone home, whatever the developer's shell says.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The full Omniglot set: $FEDMETA_OMNIGLOT_DIR, else the data folder beside the checkout in CI.
SHARED_OMNIGLOT = Path(
    os.environ.get("FEDMETA_OMNIGLOT_DIR") or REPO_ROOT.parent / "shared" / "data" / "omniglot"
)


@pytest.fixture(scope="session")
def shared_omniglot() -> Path:
    """The full Omniglot npz set; tests that need it skip when it is absent."""
    if not (SHARED_OMNIGLOT / "images_background.npz").is_file():
        pytest.skip(f"Omniglot npz not found at {SHARED_OMNIGLOT} (set FEDMETA_OMNIGLOT_DIR)")
    return SHARED_OMNIGLOT


_KINDS = {"unit", "integration", "e2e"}


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """A test naming no kind is a unit test unless it is `slow`; `integration`/`e2e` are not."""
    names = {m.name for m in item.iter_markers()}
    if not _KINDS & names and "slow" not in names:
        item.add_marker(pytest.mark.unit)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests when no CUDA device is present, rather than failing them."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def isolated_session_state(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Before any module or session fixture builds an environment from ``os.environ`` (a wheel's
    venv, a deployment), the state directory and the registry of ledgers are this session's own:
    otherwise such a fixture's runs would register their ledgers in the account's registry, and
    the next test session, on the same data, would be refused as a second budget for it."""
    os.environ["FEDMETA_STATE_DIR"] = str(tmp_path_factory.mktemp("session-state"))
    registry = tmp_path_factory.mktemp("session-registry") / "ledgers.json"
    os.environ["FEDMETA_LEDGER_REGISTRY"] = str(registry)


@pytest.fixture(autouse=True)
def isolated_state_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Every test gets its own fedmeta state directory: the default ledger never leaks between tests
    (nor into the developer's ~/.local/state). So does its registry of ledgers, which otherwise
    lives at a fixed place in the account's home (server/fedmeta/server/ledger_registry.py)."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(state))
    registry = tmp_path_factory.mktemp("registry") / "ledgers.json"
    monkeypatch.setenv("FEDMETA_LEDGER_REGISTRY", str(registry))
    return state
