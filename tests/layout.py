"""Where fedmeta's modules live in a checkout, for tests that read the source without importing it.

Each top-level folder listed as a source root in pyproject.toml (``dev-mode-dirs``) holds its part
of the ``fedmeta`` namespace, so a module's file path is its import path below one of them:
``server/fedmeta/server/round.py`` is ``fedmeta.server.round``, ``core/fedmeta/config.py`` is
``fedmeta.config``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_HATCH = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]
#: The source roots, as pyproject.toml lists them.
SOURCE_ROOTS: tuple[str, ...] = tuple(_HATCH["build"]["targets"]["wheel"]["dev-mode-dirs"])
#: The shared floor's folder (``fedmeta.config``, ``fedmeta.protocol``, ...).
CORE = "core"
#: The subpackages, ``fedmeta.<name>``, each in the source root of the same name.
SUBPACKAGES: tuple[str, ...] = tuple(root for root in SOURCE_ROOTS if root != CORE)


def package_folder(label: str) -> Path:
    """The folder of ``fedmeta.<label>``; ``"fedmeta"`` is the shared floor."""
    if label == "fedmeta":
        return REPO / CORE / "fedmeta"
    return REPO / label / "fedmeta" / label


def package_files(label: str) -> list[Path]:
    """Every module of ``fedmeta.<label>`` (the floor: its own modules), sorted."""
    return sorted(package_folder(label).rglob("*.py"))


def module_of(path: Path) -> str:
    """The import name of a source file: ``server/fedmeta/server/round.py`` -> its dotted name."""
    rel = path.resolve().relative_to(REPO)
    if rel.parts[0] not in SOURCE_ROOTS:
        raise ValueError(f"{rel} is not below a source root {SOURCE_ROOTS}")
    parts = rel.with_suffix("").parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str) -> Path | None:
    """The file of module (or package) ``name`` in the checkout, or None."""
    parts = name.split(".")
    for root in SOURCE_ROOTS:
        target = REPO / root / Path(*parts)
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None
