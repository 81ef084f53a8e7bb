"""The package contracts of docs/architecture.md, checked on the source (no imports executed)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("accounting", "metalearning", "fedmeta", "server", "client", "simulation", "cli")
#: The repository's folders, installed as ``fedmeta.<folder>``.
SUBPACKAGES = frozenset(PACKAGES) - {"fedmeta"}

#: package -> top-level modules it must never import (its arrows point elsewhere).
FORBIDDEN = {
    "accounting": {"torch", "flwr", "prometheus_client", "server", "client", "metalearning",
                   "fedmeta", "simulation", "cli"},
    "metalearning": {"flwr", "prometheus_client", "server", "client", "accounting", "fedmeta",
                     "simulation", "cli"},
    "fedmeta": {"prometheus_client", "server", "client", "simulation", "cli"},
    "server": {"client", "simulation", "cli"},
    "client": {"server", "simulation", "prometheus_client", "accounting", "cli"},
    "simulation": {"cli"},
}  # fmt: skip
#: The longest function allowed where the round logic and the Flower glue live.
MAX_FUNCTION_LINES = 80


def sources(package: str) -> Iterator[Path]:
    yield from sorted((REPO / package).rglob("*.py"))


def _root(module: str) -> str:
    """The package a module belongs to: ``fedmeta.server.round`` is ``server``,
    ``fedmeta.config`` is ``fedmeta``, ``torch.nn`` is ``torch``."""
    parts = module.split(".")
    if parts[0] == "fedmeta" and len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    return parts[0]


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {_root(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "fedmeta":
                roots |= {_root(f"fedmeta.{alias.name}") for alias in node.names}
            else:
                roots.add(_root(node.module))
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    offenders = [
        f"{path.relative_to(REPO)} imports {sorted(imported_roots(path) & FORBIDDEN[package])}"
        for path in sources(package)
        if imported_roots(path) & FORBIDDEN[package]
    ]
    assert not offenders, offenders


def test_only_server_monitoring_imports_prometheus_client() -> None:
    users = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in sources(package)
        if "prometheus_client" in imported_roots(path)
    ]
    assert users and all(u.startswith("server/monitoring/") for u in users), users


@pytest.mark.parametrize("package", ["server", "client", "simulation"])
def test_functions_fit_on_one_screen(package: str) -> None:
    long = []
    for path in sources(package):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def test_nothing_points_at_files_outside_the_repository() -> None:
    """A user's clone has no ../shared: docs, code and configs stand alone."""
    folders = [*PACKAGES, "docs", "configs", "deploy", "bench"]
    files = [p for f in folders for p in (REPO / f).rglob("*") if p.is_file()]
    files += [REPO / "README.md", REPO / "pyproject.toml", REPO / "docker-compose.yml"]
    text_files = [
        p for p in files if p.suffix in {".py", ".md", ".toml", ".yml", ".yaml", ".json", ".sh", ""}
    ]
    offenders = [
        str(p.relative_to(REPO)) for p in text_files if "../shared" in p.read_text(errors="ignore")
    ]
    assert not offenders, offenders
