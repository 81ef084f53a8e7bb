"""Lint (ruff, with the complexity limits) and strict typing (mypy) are part of the test run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `pip install -e '.[test]'` installs it")
    return path


def test_ruff_passes() -> None:
    res = subprocess.run([_tool("ruff"), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


#: The repository's folders, installed as ``fedmeta.<folder>`` (pyproject's package-dir).
SUBPACKAGES = ("cli", "accounting", "metalearning", "server", "client", "simulation")


def installed_layout(root: Path) -> Path:
    """The installed package tree as links into the checkout, for tools that know no package-dir.

    mypy maps a file to a module by its folders, so ``server/round.py`` would be checked as a
    top-level ``server.round``; through these links it is ``fedmeta.server.round``, as installed.
    """
    package = root / "fedmeta"
    package.mkdir(parents=True)
    for entry in (REPO / "fedmeta").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in SUBPACKAGES:
        (package / name).symlink_to(REPO / name, target_is_directory=True)
    # fedmeta.deploy is data (deploy/__init__.py): its module alone, not the scripts beside it.
    (package / "deploy").mkdir()
    (package / "deploy" / "__init__.py").symlink_to(REPO / "deploy" / "__init__.py")
    return package


def test_mypy_strict_passes(tmp_path: Path) -> None:
    # `strict = true` and the plugins come from pyproject.toml; a private cache keeps runs
    # independent of whatever cache the checkout holds.
    package = installed_layout(tmp_path / "src")
    res = subprocess.run(
        [_tool("mypy"), "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"), "fedmeta"],
        cwd=package.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
