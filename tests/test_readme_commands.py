"""The README as a test: its commands (and the docs' quick starts) run in a fresh state, in the
order shown, with the exit status it states.

Every line of a ``bash`` block in README.md that runs ``fedmeta`` is run in a fresh working
directory (holding a copy of ``configs/``) with a fresh ``FEDMETA_STATE_DIR``, one after the other,
so a later command sees what an earlier one left (the checkpoint, the ledger). A command's expected
exit status is 0 unless its comment says ``exit N``. The default suite shortens the long runs with
``--set`` (:data:`SHORT`, appended, so it wins), and runs the Omniglot commands, briefly
(:data:`OMNIGLOT_SHORT`), on the real set where it is found (they are experiments, which only data
proven public may run); the slow suite runs the commands as written.
Commands this test cannot run here are listed in :data:`NOT_HERE` with the test that covers them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FEDMETA = str(Path(sys.executable).parent / "fedmeta")

#: Appended to every ``fedmeta simulate`` in the default suite: a few rounds on few tasks.
SHORT = ["rounds=4", "training.eval_every=2", "privacy.report_every=2",
         "dataset.validation_tasks=8", "dataset.test_tasks=20", "output.plots=false"]  # fmt: skip

#: Appended to an Omniglot command in the default suite, which runs it on the real set where the
#: tests find it (:func:`_omniglot`), briefly.
OMNIGLOT_SHORT = ["rounds=2", "dataset.tasks_per_participant=200", "dataset.validation_tasks=4",
                  "dataset.test_tasks=10", "training.eval_every=2",
                  "output.plots=false"]  # fmt: skip

#: Commands (by what they contain) that need what this test lacks, and where they are tested.
NOT_HERE = {
    "bash scripts/install.sh": "the install itself (CI runs it; this test runs in its venv)",
    "python -m pytest": "the test suite itself",
    "flwr run": "tests/federation/test_e2e.py::test_flwr_run_dot (slow)",
    "docker compose": "tests/deploy/test_compose_podman.py (slow)",
}


@dataclass(frozen=True)
class Command:
    """One README command: its words and the exit status the README states."""

    line: str
    words: list[str]
    status: int


def readme_commands(text: str) -> list[Command]:
    """The ``fedmeta`` commands of ``text``'s ``bash`` blocks, continuation lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            comment = line.partition("  #")[2]
            status = re.search(r"\bexit (\d+)", comment)
            if words:
                out.append(Command(line.strip(), words, int(status.group(1)) if status else 0))
    return out


def _runnable(cmd: Command, omniglot: Path | None) -> str | None:
    """Why ``cmd`` cannot run here, or None (``omniglot``: the data, if there is any)."""
    for start, why in NOT_HERE.items():
        if start in cmd.line:
            return why
    if "/path/to/omniglot" in cmd.line and omniglot is None:
        return "needs Omniglot in $FEDMETA_OMNIGLOT_DIR"
    return None


def _omniglot(tmp_path: Path, short: bool) -> Path | None:
    """The Omniglot set the commands run on: the real one, or none (its commands skip).

    The README runs them as experiments, and an experiment ledger opens only for data proven
    public (issue 39): generated strokes are refused, as they should be, so only the real set
    ($FEDMETA_OMNIGLOT_DIR, else the data folder tests/conftest.py names) can run them.
    """
    from tests.conftest import SHARED_OMNIGLOT

    given = os.environ.get("FEDMETA_OMNIGLOT_DIR")
    if given:
        return Path(given)
    if (SHARED_OMNIGLOT / "images_background.npz").is_file():
        return SHARED_OMNIGLOT
    return None


def _argv(cmd: Command, short: bool, omniglot: Path | None = None) -> list[str]:
    words = [w.replace("/path/to/omniglot", str(omniglot or "")) for w in cmd.words]
    while "&&" in words:  # `bash scripts/install.sh && . .venv/bin/activate && fedmeta simulate`:
        words = words[words.index("&&") + 1 :]  # the install and the venv are this test's own
    assert words[0] in ("fedmeta", ".venv/bin/fedmeta"), cmd.line
    argv = [FEDMETA, *words[1:]]
    if short and words[1] == "simulate":
        extra = OMNIGLOT_SHORT if "omniglot" in cmd.line else SHORT
        argv += [w for s in extra for w in ("--set", s)]
    return argv


def _run_readme(tmp_path: Path, short: bool) -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = readme_commands(text)
    assert len(commands) >= 10, "the README's commands were not found"
    assert _run_in_order(tmp_path, commands, short) >= 10


def quick_start(doc: str) -> list[Command]:
    """The commands of a document's first ``bash`` block (its quick start)."""
    text = (REPO / doc).read_text(encoding="utf-8")
    first = re.search(r"```bash\n.*?```", text, flags=re.S)
    assert first is not None, f"{doc} has no bash block"
    return readme_commands(first.group(0))


def _run_in_order(tmp_path: Path, commands: list[Command], short: bool) -> int:
    """Run ``commands`` one after the other in a fresh directory and state; how many ran."""
    work = tmp_path / "clone"
    shutil.copytree(REPO / "configs", work / "configs")
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp_path / "state"), "FEDMETA_DEBUG": "1"}
    omniglot = _omniglot(tmp_path, short) if any("omniglot" in c.line for c in commands) else None
    if omniglot is not None:
        env["FEDMETA_CACHE_DIR"] = str(tmp_path / "cache")  # the set's decoded cache, this test's
    ran = 0
    for cmd in commands:
        if _runnable(cmd, omniglot) is not None and not cmd.line.startswith(
            "bash scripts/install.sh &&"
        ):
            continue
        res = subprocess.run(_argv(cmd, short, omniglot), cwd=work, env=env, capture_output=True,
                             text=True, timeout=3600, stdin=subprocess.DEVNULL)  # fmt: skip
        assert res.returncode == cmd.status, (
            f"README command {cmd.line!r} exited {res.returncode}, the README says "
            f"{cmd.status}:\n{res.stderr[-3000:]}"
        )
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        print(f"ok (exit {res.returncode}): {cmd.line}", flush=True)
        ran += 1
    return ran


def test_readme_commands_are_found() -> None:
    commands = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
    lines = [c.line for c in commands]
    assert any(c.words[:2] == ["fedmeta", "privacy"] for c in commands), lines
    # A continuation line is one command; a comment is not part of it.
    plan = next(c for c in commands if c.words[:3] == ["fedmeta", "privacy", "plan"])
    assert "--write-config" in plan.words and "#" not in plan.words
    assert all(c.status in (0, 2, 3, 4, 130) for c in commands)
    # Omniglot is public benchmark data: the README runs it as experiments, each with a ledger of
    # its own, so a first try never spends (or is refused by) a production budget (issue 40).
    omniglot = [c for c in commands if c.words[:2] == ["fedmeta", "simulate"]
                and any("omniglot" in w for w in c.words)]  # fmt: skip
    assert len(omniglot) >= 2, lines
    for c in omniglot:
        assert "--experiment" in c.words and c.status == 0, c.line


def test_readme_is_short_and_its_results_are_the_generated_table() -> None:
    # Issue 54: the commands, what fedmeta does, the results table and links; the long form lives
    # in docs/usage.md. The table between the markers is bench/paper_table.py's (its --check, run by
    # tests/test_paper_table.py, says whether it is what the records give).
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200, len(text.splitlines())
    results = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    assert "<!-- paper-table:start" in results and "<!-- paper-table:end -->" in results
    assert "(docs/results.md)" in results and (REPO / "docs" / "usage.md").is_file()


@pytest.mark.e2e
@pytest.mark.timeout(3600)  # about 2 minutes on 2 idle cores; a loaded machine takes many times it
def test_readme_commands_run_in_order_short(tmp_path: Path) -> None:
    _run_readme(tmp_path, short=True)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_readme_commands_run_in_order_as_written(tmp_path: Path) -> None:
    _run_readme(tmp_path, short=False)


#: The docs' quick starts (a document's first bash block) that run as the README's do.
QUICK_STARTS = ["docs/federation.md"]


@pytest.mark.e2e
@pytest.mark.slow  # 2-3 minutes; the README's own commands run in the default suite
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("doc", QUICK_STARTS)
def test_docs_quick_start_runs_in_order_short(tmp_path: Path, doc: str) -> None:
    commands = quick_start(doc)
    assert _run_in_order(tmp_path, commands, short=True) >= 3, [c.line for c in commands]
