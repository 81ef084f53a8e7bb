"""One answer to "is this run private?" and one reader of the checkpoint (issue 54), on the source.

After start-up the plan answers (``RunPlan.private``); before there is a plan,
``plan.private_requested`` does. No other server module (nor the simulation) reads
``privacy.enabled``: a module that did could disagree with the run's plan (``server/app.py`` once
decided diagnostics from the caller's configuration while the rounds decided from the plan). And no
module outside core/fedmeta/checkpoint.py looks a checkpoint's keys up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tests.layout import REPO, package_files, package_folder

pytestmark = pytest.mark.unit

#: The one module that reads the configuration's privacy flag.
PLAN = package_folder("server") / "plan.py"


def _reads_privacy_enabled(path: Path) -> list[int]:
    """Lines where ``<...>.privacy.enabled`` or ``privacy.enabled`` is read."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr == "enabled"):
            continue
        owner = node.value
        if (isinstance(owner, ast.Attribute) and owner.attr == "privacy") or (
            isinstance(owner, ast.Name) and owner.id == "privacy"
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_plan_reads_privacy_enabled() -> None:
    offenders = {
        str(path.relative_to(REPO)): lines
        for package in ("server", "simulation")
        for path in package_files(package)
        if path != PLAN and (lines := _reads_privacy_enabled(path))
    }
    assert not offenders, offenders
    assert _reads_privacy_enabled(PLAN)  # the check sees the one reader it allows


def test_the_check_sees_a_read(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("def f(cfg):\n    p = cfg.privacy\n    return cfg.privacy.enabled or p\n")
    assert _reads_privacy_enabled(sample) == [3]


def _config_rebindings(path: Path) -> list[str]:
    """Functions that rebind a parameter annotated ``Config`` (a name then means two configs)."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        typed = [(a.arg, a.annotation) for a in fn.args.args + fn.args.kwonlyargs]
        params = {n for n, kind in typed if isinstance(kind, ast.Name) and kind.id == "Config"}
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else []
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            found += [f"{fn.name}:{node.lineno} rebinds {name}" for name in names & params]
    return found


@pytest.mark.parametrize("module", ["startup.py", "run.py", "app.py", "data_budget.py"])
def test_start_up_never_rebinds_the_callers_configuration(module: str) -> None:
    assert not _config_rebindings(package_folder("server") / module)


def _checkpoint_key_lookups(path: Path) -> list[int]:
    """Lines subscripting or ``.get``-ing a name that holds a checkpoint (``ckpt``, ``state``
    from ``read_checkpoint``/``load_checkpoint``/``refuse_to_overwrite_run``)."""
    tree = ast.parse(path.read_text())
    readers = {"read_checkpoint", "load_checkpoint", "refuse_to_overwrite_run"}
    held = {"ckpt"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id in readers):
            held |= {t.id for t in node.targets if isinstance(t, ast.Name)}  # fmt: skip
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            if node.value.id in held:
                lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and node.attr == "get"
              and isinstance(node.value, ast.Name) and node.value.id in held):  # fmt: skip
            lines.append(node.lineno)
    return lines


def test_no_module_looks_a_checkpoints_keys_up() -> None:
    offenders = {
        str(path.relative_to(REPO)): lines
        for package in ("server", "simulation", "cli", "fedmeta")
        for path in package_files(package)
        if path.name != "checkpoint.py" and (lines := _checkpoint_key_lookups(path))
    }
    assert not offenders, offenders


def test_the_look_up_check_sees_one(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("state = read_checkpoint(p)\nx = state['next_round']\ny = ckpt.get('a')\n")
    assert _checkpoint_key_lookups(sample) == [2, 3]
