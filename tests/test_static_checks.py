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


def test_mypy_strict_passes(tmp_path: Path) -> None:
    # The package list and `strict = true` come from pyproject.toml; a private cache keeps runs
    # independent of whatever cache the checkout holds.
    res = subprocess.run(
        [_tool("mypy"), "--cache-dir", str(tmp_path / "cache")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
