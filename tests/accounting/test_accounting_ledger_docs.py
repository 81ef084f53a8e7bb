"""docs/ledger.md stays true to the code: its Python blocks compile and name only real API."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import fedmeta.accounting as accounting

DOC = Path(__file__).resolve().parents[2] / "docs" / "ledger.md"


@pytest.mark.unit
def test_every_python_block_compiles_and_imports_only_what_exists() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, "docs/ledger.md lost its Python blocks"
    for block in blocks:
        tree = ast.parse(block)  # a SyntaxError names the line
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "fedmeta.accounting":
                missing = [a.name for a in node.names if not hasattr(accounting, a.name)]
                assert not missing, f"docs/ledger.md imports {missing} from fedmeta.accounting"
