"""Lint (ruff, with the complexity limits) and strict typing (mypy) are part of the test run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.layout import SOURCE_ROOTS

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
    # `strict = true`, the plugins, the source roots (`mypy_path`) and the files come from
    # pyproject.toml: each module is checked under its import path from a plain checkout. A private
    # cache keeps runs independent of whatever cache the checkout holds.
    res = subprocess.run(
        [_tool("mypy"), "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_pyright_resolves_every_fedmeta_import(tmp_path: Path) -> None:
    """Pyright (Pylance's engine) with the committed [tool.pyright] finds every ``fedmeta.*``
    module from a plain copy of the sources: no install, no import hook, no link farm."""
    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "runs", "data", "*_cache")
    for name in ("pyproject.toml", *SOURCE_ROOTS):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=ignore)
        else:
            copy.mkdir(exist_ok=True)
            shutil.copy2(source, copy / name)
    # The base interpreter, not this venv: the venv's editable install would resolve `fedmeta`
    # whatever the committed settings say.
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    res = subprocess.run(
        [_tool("basedpyright"), "--outputjson", "--pythonpath", str(base_python)],
        cwd=copy, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(res.stdout)
    unresolved = [
        f"{d['file']}:{d['range']['start']['line'] + 1} {d['message']}"
        for d in report["generalDiagnostics"]
        if d.get("rule") in {"reportMissingImports", "reportAttributeAccessIssue"}
        and "fedmeta" in d["message"]
    ]
    assert report["summary"]["filesAnalyzed"] >= 80, report["summary"]
    assert not unresolved, unresolved
