"""Modules cut along concepts (issue 37): few private names shared across them.

A private name (``_x``) imported from another module is an interface nobody declared; it is
counted on the source, nothing imported. The limit, ``MAX_PRIVATE_IMPORTS``, is what the code holds
today, so that no new one comes in unnoticed. (The module-size limit, 500 lines for every module, is
tests/test_architecture.py's.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from layout import SUBPACKAGES, module_of, package_files

#: At most this many private names imported across modules.
MAX_PRIVATE_IMPORTS = 1
#: ``fedmeta`` is the shared floor (core/fedmeta).
PACKAGES = ("fedmeta", *SUBPACKAGES)


def package_modules() -> list[Path]:
    return [path for package in PACKAGES for path in package_files(package)]


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
