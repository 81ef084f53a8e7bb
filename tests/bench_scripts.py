"""The scripts of ``bench/`` as modules, for the tests of their pure parts.

``bench/`` holds scripts run from the repository root, not a package, so a test loads one by its
file. The module is registered under ``bench_<name>`` first: a dataclass a script defines looks its
module up there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py``, loaded afresh."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
