"""Every third-party module that fedmeta's installed code imports comes from a declared dependency.

A package that arrives only as another package's dependency can vanish with that package: Pillow
came only with matplotlib, so when matplotlib became the optional ``plots`` extra, the deployment
images lost the Omniglot zip and image-folder readers without any test noticing. This scans the
sources (every ``import``, at module level or inside a function) and maps each imported top-level
module to the distribution that provides it in this environment.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tests.layout import REPO, SOURCE_ROOTS

pytestmark = pytest.mark.unit

#: The folders the wheel installs as ``fedmeta.*`` (pyproject.toml's source roots).
INSTALLED = tuple(REPO / root / "fedmeta" for root in SOURCE_ROOTS)
#: Imports that are optional by design: an extra names them, and the code says what to install
#: when they are missing.
OPTIONAL = {"matplotlib": "plots"}


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}


def imported_top_levels() -> dict[str, set[str]]:
    """Top-level module -> the files importing it (absolute imports of modules not ours)."""
    found: dict[str, set[str]] = {}
    for folder in INSTALLED:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top != "fedmeta" and top not in sys.stdlib_module_names:
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_imported_distribution_is_declared() -> None:
    providers = packages_distributions()
    wanted = declared()
    undeclared = []
    for top, files in sorted(imported_top_levels().items()):
        if top in OPTIONAL:
            continue
        dists = {canonicalize_name(d) for d in providers.get(top, [])}
        if not dists & wanted:
            undeclared.append(f"{top} ({', '.join(sorted(dists)) or 'not installed'}): "
                              f"{', '.join(sorted(files))}")  # fmt: skip
    assert not undeclared, "imported but not in [project].dependencies:\n" + "\n".join(undeclared)


def test_the_scan_finds_imports_inside_functions() -> None:
    """Negative control: Pillow is imported only inside functions, and the scan sees it."""
    found = imported_top_levels()
    assert "metalearning/fedmeta/metalearning/omniglot.py" in found.get("PIL", set())
    assert "torch" in found and "matplotlib" in found
