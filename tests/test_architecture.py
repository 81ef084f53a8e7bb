"""The package contracts of docs/architecture.md, checked on the source (no imports executed)."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.layout import REPO, SOURCE_ROOTS, module_file, package_files, package_folder

pytestmark = pytest.mark.unit

PACKAGES = ("accounting", "metalearning", "fedmeta", "server", "client", "simulation", "cli")
#: The subpackages ``fedmeta.<name>`` (``fedmeta`` itself is the shared floor).
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
#: package -> the floor modules it may import although the floor is forbidden to it: the item
#: set a participant sends and the ledger matches lives on the floor, so that a participant never
#: imports the accountant (issue 54); it imports numpy and the standard library only.
ALLOWED = {"accounting": {"fedmeta.item_identity"}}
#: The longest function allowed anywhere in the package code (one screen; docstring included).
MAX_FUNCTION_LINES = 60
#: The longest package module allowed (issue 54): a longer one holds more than one concept.
MAX_MODULE_LINES = 500


def sources(package: str) -> Iterator[Path]:
    yield from package_files(package)


def _root(module: str) -> str:
    """The package a module belongs to: ``fedmeta.server.round`` is ``server``,
    ``fedmeta.config`` is ``fedmeta``, ``torch.nn`` is ``torch``."""
    parts = module.split(".")
    if parts[0] == "fedmeta" and len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    return parts[0]


def imported_roots(path: Path, allowed: frozenset[str] = frozenset()) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {_root(alias.name) for alias in node.names if alias.name not in allowed}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module in allowed:
                continue
            if node.module == "fedmeta":
                roots |= {_root(f"fedmeta.{alias.name}") for alias in node.names}
            else:
                roots.add(_root(node.module))
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    allowed = frozenset(ALLOWED.get(package, ()))
    offenders = [
        f"{path.relative_to(REPO)} imports {sorted(roots & FORBIDDEN[package])}"
        for path in sources(package)
        if (roots := imported_roots(path, allowed)) & FORBIDDEN[package]
    ]
    assert not offenders, offenders


def test_only_server_monitoring_imports_prometheus_client() -> None:
    users = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in sources(package)
        if "prometheus_client" in imported_roots(path)
    ]
    monitoring = str(package_folder("server").relative_to(REPO) / "monitoring") + "/"
    assert users and all(u.startswith(monitoring) for u in users), users


@pytest.mark.parametrize("package", PACKAGES)
def test_functions_fit_on_one_screen(package: str) -> None:
    long = []
    for path in sources(package):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def module_lines() -> dict[str, int]:
    """Path from the repository root -> lines, for every module of every source root's fedmeta/."""
    return {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for root in SOURCE_ROOTS
        for path in sorted((REPO / root / "fedmeta").rglob("*.py"))
    }


def over_the_limit(lines: dict[str, int]) -> dict[str, int]:
    """The modules of ``lines`` longer than MAX_MODULE_LINES."""
    return {path: n for path, n in lines.items() if n > MAX_MODULE_LINES}


def test_no_module_is_over_the_size_limit() -> None:
    long = over_the_limit(module_lines())
    assert not long, f"over {MAX_MODULE_LINES} lines, cut each along its concepts: {long}"


def test_the_size_check_sees_every_module() -> None:
    """Negative control: the walk reaches every source root and a long module is caught."""
    lines = module_lines()
    assert {path.split("/")[0] for path in lines} == set(SOURCE_ROOTS)
    assert over_the_limit({"a.py": MAX_MODULE_LINES + 1, "b.py": MAX_MODULE_LINES}) == {
        "a.py": MAX_MODULE_LINES + 1
    }


def test_nothing_points_at_files_outside_the_repository() -> None:
    """A user's clone has no ../shared: docs, code and configs stand alone."""
    folders = [package_folder(p) for p in PACKAGES]
    folders += [REPO / f for f in ("docs", "configs", "deploy", "bench")]
    files = [p for f in folders for p in f.rglob("*") if p.is_file()]
    files += [REPO / "README.md", REPO / "pyproject.toml", REPO / "docker-compose.yml"]
    text_files = [
        p for p in files if p.suffix in {".py", ".md", ".toml", ".yml", ".yaml", ".json", ".sh", ""}
    ]
    offenders = [
        str(p.relative_to(REPO)) for p in text_files if "../shared" in p.read_text(errors="ignore")
    ]
    assert not offenders, offenders


#: Directories of one machine: a tracked file that names one works only there (or names its user).
MACHINE_PATH = re.compile(r"(?<![\w.$-])/(?:root|work|home/(?!fedmeta\b)[\w.-]+)/")
#: In recorded data a temporary directory is a machine path too (it was one run's, and is gone).
RECORDED_TMP = re.compile(r"(?<![\w.$-])/tmp/")
RECORDED_DATA = {".jsonl", ".json", ".csv"}
#: Files that must name such paths: this test's own patterns.
MACHINE_PATH_ALLOWED = {"tests/test_architecture.py"}


def tracked_files() -> list[Path]:
    """The files a clone has: git's list, or (an exported tree without .git) every file."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True, timeout=60).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
        return [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.parts)]
    return [REPO / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_names_a_machine_directory() -> None:
    """Records, docs and code name paths relative to the checkout, never this machine's."""
    offenders = []
    for path in tracked_files():
        rel = str(path.relative_to(REPO))
        if rel in MACHINE_PATH_ALLOWED or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary (images)
        for number, line in enumerate(text.splitlines(), 1):
            recorded = path.suffix in RECORDED_DATA and RECORDED_TMP.search(line)
            if MACHINE_PATH.search(line) or recorded:
                offenders.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not offenders, offenders


def test_the_machine_path_patterns_catch_what_they_are_for() -> None:
    assert MACHINE_PATH.search('"dataset.path=/work/shared/data/omniglot"')
    assert MACHINE_PATH.search("cd /root/fedmeta") and MACHINE_PATH.search("/home/alice/x")
    assert not MACHINE_PATH.search("ENV HOME=/home/fedmeta")  # the image's own user
    assert not MACHINE_PATH.search("dataset.path=data/omniglot")
    assert RECORDED_TMP.search('{"out": "/tmp/fedmeta-results-x/run-0"}')
    assert not RECORDED_TMP.search("/var/tmp/fedmeta-podman")


# ------------------------------------------------------------------ edges the import graph sees
#: Text that names a module of ours for something else to import: an edge no import shows.
MODULE_NAME = re.compile(r"fedmeta(?:\.\w+)+")
LAUNCH_OR_COMPONENT = re.compile(r"-m\s+fedmeta\.|fedmeta(?:\.\w+)+:\w+")
#: (file, text) -> why the text must stay text.
QUOTED_MODULES_ALLOWED = {
    # Flower reads an app's components from its pyproject.toml as "module:attribute" strings; the
    # app `fedmeta deploy run` submits holds no code, so this text is its whole interface (the
    # ServerApp process imports the fedmeta installed on the server). pyproject.toml says the same.
    ("cli/fedmeta/cli/deploy_run_config.py", "fedmeta.server.app:app"),
    ("cli/fedmeta/cli/deploy_run_config.py", "fedmeta.client.app:app"),
}


def _our_module(name: str) -> bool:
    """Whether ``fedmeta.a.b`` is a module (or package) of this repository."""
    return name == "fedmeta" or module_file(name) is not None


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _logger_names(tree: ast.AST) -> set[int]:
    """``logging.getLogger("fedmeta.server")``: a logger's name, not a module reference."""
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    return {id(arg) for call in calls if _called_name(call) == "getLogger" for arg in call.args}


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def string_edges(path: Path, rel: str | None = None) -> list[str]:
    """Dynamic imports and quoted module names of ours in one source file (``rel``: its name)."""
    tree = ast.parse(path.read_text())
    rel = rel or str(path.relative_to(REPO))
    skip = _docstrings(tree) | _logger_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) in {"import_module", "__import__"}:
            found.append(f"{rel}:{node.lineno} {_called_name(node)}(...)")
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        text = node.value.strip()
        named = MODULE_NAME.fullmatch(text) and _our_module(text)
        for match in LAUNCH_OR_COMPONENT.finditer(node.value):
            if (rel, match.group(0)) not in QUOTED_MODULES_ALLOWED:
                found.append(f"{rel}:{node.lineno} {match.group(0)!r}")
        if named:
            found.append(f"{rel}:{node.lineno} {text!r}")
    return found


def test_no_module_of_ours_is_reached_through_a_string() -> None:
    """Code launches and imports our modules by importing them (``worker.__name__``), so the
    import graph, the type checker and a rename all see the edge."""
    offenders = [edge for package in PACKAGES for path in sources(package)
                 for edge in string_edges(path)]  # fmt: skip
    assert not offenders, offenders


def test_string_edges_are_found(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Docstring: python -m fedmeta.client.worker is fine here."""\n'
        "import importlib, logging\n"
        'log = logging.getLogger("fedmeta.server")\n'
        'cmd = ["python", "-m", "fedmeta.client.worker"]\n'
        'mod = importlib.import_module("fedmeta.server.round")\n'
        'line = "python -m fedmeta.client.supernode --poll 1"\n'
        'app = "fedmeta.server.app:app"\n'
    )
    found = string_edges(probe, "cli/probe.py")
    # the worker's name, import_module and its argument, the -m line, the component string
    assert len(found) == 5, found
    assert not any(":1 " in f or ":3 " in f for f in found), found
    deploy = "cli/fedmeta/cli/deploy_run_config.py"
    assert string_edges(probe, deploy)[-1:] != [f"{deploy}:7 'fedmeta.server.app:app'"]


def test_ci_runs_the_readme_test_command_and_touches_only_its_own() -> None:
    """.ci/run runs the README's test command as it stands, in a venv of its own; it neither
    deletes a developer's .venv nor ends processes by name."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    test_command = block[1].split("#", 1)[0].strip()
    assert "pytest" in test_command, block
    ci = (REPO / ".ci" / "run").read_text()
    code = [line.strip() for line in ci.splitlines() if not line.strip().startswith("#")]
    assert test_command in code, (test_command, code)
    assert not [line for line in code if "pkill" in line or "killall" in line], code
    assert not [line for line in code if "rm " in line and ".venv" in line], code
    assert "FEDMETA_VENV=" in ci and "mktemp -d" in ci


def test_a_module_path_is_its_import_path() -> None:
    """Each source root holds only its part of the ``fedmeta`` namespace (``server/fedmeta/server``;
    the floor ``core/fedmeta``), and no root has a ``fedmeta/__init__.py``: one would make
    ``fedmeta`` a regular package and hide every other root from an editable install and from
    pyright, jedi and mypy."""
    from tests.layout import CORE, SOURCE_ROOTS

    misplaced = []
    for root in SOURCE_ROOTS:
        namespace = REPO / root / "fedmeta"
        assert not (namespace / "__init__.py").exists(), root
        for path in namespace.rglob("*.py"):
            own = namespace if root == CORE else namespace / root
            if not (path.parent == own if root == CORE else path.is_relative_to(own)):
                misplaced.append(str(path.relative_to(REPO)))
    assert not misplaced, misplaced
    assert not (REPO / "fedmeta").exists(), "the floor lives in core/fedmeta"
