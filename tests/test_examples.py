"""The examples in the documentation and in module docstrings run, and print what they claim."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest
from tests.layout import REPO, module_of, package_files

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

#: Documents whose ``>>>`` examples are part of the interface.
DOCUMENTS = sorted(p for p in (REPO / "docs").glob("*.md") if ">>>" in p.read_text())
#: Modules whose docstrings hold examples.
MODULES = sorted(
    module_of(p)
    for package in ("accounting", "fedmeta", "server", "client", "metalearning", "simulation",
                    "cli")
    for p in package_files(package)
    if ">>>" in p.read_text()
)


@pytest.mark.integration
@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_documentation_examples(document: Path) -> None:
    result = doctest.testfile(str(document), module_relative=False, optionflags=FLAGS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.unit
@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=FLAGS)
    assert result.failed == 0


def test_the_examples_were_found() -> None:
    assert any(p.name == "architecture.md" for p in DOCUMENTS)
