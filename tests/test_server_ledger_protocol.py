"""The server is typed against the ``Ledger`` Protocol, not branched on ledger classes (issue 37).

Read from the source, nothing imported: an ``isinstance`` whose class is a ledger (a name ending
in ``Ledger``) is a branch on a test fake, and ``x is some_function`` is a branch on which function
a caller passed. None is left in server/: what only the real ledger could answer (its exposures
for the epsilon curve, its checkpoint, its witness) is part of the ``Ledger`` Protocol
(accounting/fedmeta/accounting/ledger/protocol.py), and a fake answers it too.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
from layout import module_of, package_files


def branches_in(source: str) -> list[str]:
    """The function around each isinstance on a ``...Ledger`` class or ``is`` on a function."""
    tree = ast.parse(source)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return [
        outer.name
        for outer in ast.walk(tree)
        if isinstance(outer, ast.FunctionDef)
        for node in ast.walk(outer)
        if _ledger_isinstance(node) or _function_identity(node, functions)
    ]


def ledger_branches(path: Path) -> list[tuple[str, str]]:
    """(module, function) of each branch on a ledger class or a function in ``path``."""
    return [(module_of(path), name) for name in branches_in(path.read_text())]


def _ledger_isinstance(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
        return False
    classes = node.args[1] if len(node.args) == 2 else None
    names = classes.elts if isinstance(classes, ast.Tuple) else [classes]
    return any(isinstance(n, ast.Name) and n.id.endswith("Ledger") for n in names)


def _function_identity(node: ast.AST, functions: set[str]) -> bool:
    if not (isinstance(node, ast.Compare) and any(isinstance(o, ast.Is | ast.IsNot)
                                                  for o in node.ops)):  # fmt: skip
        return False
    sides = [node.left, *node.comparators]
    return any(isinstance(s, ast.Name) and s.id in functions for s in sides)


def server_branches() -> Counter[tuple[str, str]]:
    return Counter(site for path in package_files("server") for site in ledger_branches(path))


@pytest.mark.unit
def test_no_branch_on_a_ledger_class_or_a_function_in_the_server() -> None:
    found = server_branches()
    assert not found, found


@pytest.mark.unit
def test_the_scan_reads_the_server_modules() -> None:
    """The scan sees the modules that hold the ledger (so an empty result is not an empty scan)."""
    modules = {module_of(path) for path in package_files("server")}
    assert {"fedmeta.server.run", "fedmeta.server.startup", "fedmeta.server.round"} <= modules


@pytest.mark.unit
def test_the_check_sees_both_kinds() -> None:
    """Negative control: both kinds of branch are found, and an isinstance on other classes not."""
    sample = (
        "def open_budget(): ...\n"
        "def f(ledger, opener):\n"
        "    return isinstance(ledger, (int, BudgetLedger)) or opener is open_budget\n"
        "def g(x):\n"
        "    return isinstance(x, int) or x is None\n"
    )
    assert branches_in(sample) == ["f", "f"]
