"""Modules cut along concepts (issue 37): few large modules, few private names shared across them.

A module over ``MAX_MODULE_LINES`` usually holds two concepts; a private name (``_x``) imported from
another module is an interface nobody declared. Both are counted on the source, nothing imported.
The limits: at most ``MAX_LARGE_MODULES`` modules over ``MAX_MODULE_LINES`` lines, at most
``MAX_PRIVATE_IMPORTS`` private names imported across modules. The issue allows 4 and 5; each limit
is what the code holds today (2 and 1: fedmeta.config and fedmeta.client.worker, whose splits
are under way), so that no new one comes in unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from layout import SUBPACKAGES, module_of, package_files

MAX_MODULE_LINES = 500
#: At most this many modules over MAX_MODULE_LINES, and at most this many private imports.
MAX_LARGE_MODULES = 2
MAX_PRIVATE_IMPORTS = 1
#: ``fedmeta`` is the shared floor (core/fedmeta).
PACKAGES = ("fedmeta", *SUBPACKAGES)


def package_modules() -> list[Path]:
    return [path for package in PACKAGES for path in package_files(package)]


def large_modules() -> dict[str, int]:
    """Module -> lines, for every package module over MAX_MODULE_LINES."""
    sizes = {module_of(p): len(p.read_text().splitlines()) for p in package_modules()}
    return {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}


def private_imports(path: Path) -> list[str]:
    """``module._name`` for each private name ``path`` imports from another fedmeta module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedmeta"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    return found


def all_private_imports() -> list[str]:
    return sorted(
        f"{module_of(path)} <- {name}"
        for path in package_modules()
        for name in private_imports(path)
    )


@pytest.mark.unit
def test_few_modules_are_large() -> None:
    large = large_modules()
    assert len(large) <= MAX_LARGE_MODULES, large


@pytest.mark.unit
def test_few_private_names_cross_modules() -> None:
    crossing = all_private_imports()
    assert len(crossing) <= MAX_PRIVATE_IMPORTS, crossing


@pytest.mark.unit
def test_the_counts_see_what_they_count(tmp_path: Path) -> None:
    """Negative control: a private import is found; the walk sees every package's modules."""
    module = tmp_path / "m.py"
    module.write_text("from fedmeta.accounting.ledger.storage import _x, y, __all__\n")
    assert private_imports(module) == ["fedmeta.accounting.ledger.storage._x"]
    names = {module_of(path) for path in package_modules()}
    assert {"fedmeta.config", "fedmeta.server.round", "fedmeta.accounting.schemes"} <= names
