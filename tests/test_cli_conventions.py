"""The conventions every ``fedmeta`` command shares (fedmeta.cli.__init__) and the one-line errors.

--version; a usage error is one line with a did-you-mean and exit status 2; ``--set`` takes
``key=value``; a mistyped configuration key gets a did-you-mean and a value given for a section
the fix; ``--epsilon`` is the flag everywhere (the old spelling still works, hidden); Ctrl-C is one
line and exit status 130; a closed pipe ends quietly with status 0; ``simulate --print-config`` and
``--dry-run`` run nothing and record nothing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

FEDMETA = str(Path(sys.executable).parent / "fedmeta")
SCHEME = ["--participants", "20", "--participants-per-round", "5", "--task-rate", "0.1"]


def _main(argv: list[str]) -> int:
    from fedmeta.cli import main

    try:
        return main(argv)
    except SystemExit as stop:  # argparse's --version / usage errors
        return int(stop.code or 0)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.unit
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert _main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fedmeta {version('fedmeta')}"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["simulat"], "did you mean 'simulate'?"),
        (["privacy", "epsilom"], "did you mean 'epsilon'?"),
        (["simulate", "--reusme"], "did you mean '--resume'?"),
        (["ledger", "show", "--jsno"], "did you mean '--json'?"),
    ],
)
def test_mistyped_commands_and_flags_get_one_line_and_a_suggestion(
    argv: list[str], suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert suggestion in line and "--help" in line


@pytest.mark.unit
def test_help_without_the_commands_loaded_is_the_help_with_them() -> None:
    """``fedmeta --help`` lists the commands from commands.COMMANDS without importing them: the
    same text, in the same order, as the parser with every command registered in full."""
    from fedmeta.cli import build_parser
    from fedmeta.cli.commands import COMMANDS

    full, listed = build_parser(), build_parser(["--help"])
    assert listed.format_help() == full.format_help()
    for command in COMMANDS:  # and the one command a command line names is the full one
        chosen = build_parser([command.name])
        assert chosen.format_help() == full.format_help()
        assert _sub_help(chosen, command.name) == _sub_help(full, command.name)


def _sub_help(parser: object, name: str) -> str:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return str(action.choices[name].format_help())


@pytest.mark.unit
def test_set_without_equals_names_the_form(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["simulate", "--set", "rounds", "20"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "argument --set: expects key=value" in line and "--set rounds=20" in line


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["simulate", "--rounds", "20"],
         "fedmeta simulate: error: unrecognized arguments: --rounds 20; use --set rounds=20"),
        (["simulate", "--epsilon-budget=4"],
         "fedmeta simulate: error: unrecognized arguments: --epsilon-budget=4; use --set "
         "privacy.epsilon_budget=4"),
    ],
)  # fmt: skip
def test_a_configuration_key_given_as_a_flag_points_at_set(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(argv) == 2
    assert _one_line(capsys.readouterr().err).startswith(line)


@pytest.mark.unit
def test_evaluate_help_prints_a_plain_percent_sign(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["evaluate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "95% CI" in " ".join(out.split()) and "%%" not in out


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "wanted"),
    [
        ("privacy.epsilon_budgt=4", "did you mean privacy.epsilon_budget?"),
        ("epsilon_budget=4", "did you mean privacy.epsilon_budget?"),  # right name, wrong section
        ("round=20", "did you mean rounds?"),
        (
            "privacy.adaptive_clipping=false",
            "privacy.adaptive_clipping is a section, not a value; set --set "
            "privacy.adaptive_clipping.enabled=false",
        ),
    ],
)
def test_configuration_mistakes_get_the_fix(override: str, wanted: str) -> None:
    from fedmeta.config import ConfigError
    from fedmeta.config_io import load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert wanted in str(error.value)
    assert "\n" not in str(error.value) and "pydantic" not in str(error.value)


@pytest.mark.unit
def test_an_unknown_key_far_from_any_gets_no_guess() -> None:
    from fedmeta.config import ConfigError
    from fedmeta.config_io import load_config

    with pytest.raises(ConfigError, match="unknown key") as error:
        load_config(None, ["zzzzqqq=1"])
    assert "did you mean" not in str(error.value)


@pytest.mark.unit
@pytest.mark.parametrize("value", ["0", "-1", "nan", "1001"])
def test_max_rounds_refuses_what_simulate_refuses(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["privacy", "max-rounds", "--epsilon", value, *SCHEME, "--noise-multiplier", "1"]
    assert _main(argv) == 2
    assert "argument --epsilon: must be in (0, 1000]" in _one_line(capsys.readouterr().err)


@pytest.mark.unit
def test_calibrate_takes_epsilon_and_still_the_old_spelling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["privacy", "calibrate", *SCHEME, "--rounds", "10", "--json"]
    assert _main([*common, "--epsilon", "2"]) == 0
    new = capsys.readouterr().out
    assert _main([*common, "--target-epsilon", "2"]) == 0
    assert capsys.readouterr().out == new
    assert _main([*common, "--target-epsilon", "2", "--epsilon", "2"]) == 2
    assert "same flag" in _one_line(capsys.readouterr().err)
    assert _main([*common]) == 2
    assert "--epsilon" in _one_line(capsys.readouterr().err)
    with pytest.raises(SystemExit):
        _main_help(["privacy", "calibrate", "--help"])
    shown = capsys.readouterr().out
    assert "--epsilon" in shown and "--target-epsilon" not in shown  # the old spelling is hidden


def _main_help(argv: list[str]) -> None:
    from fedmeta.cli import main

    main(argv)


@pytest.mark.unit
def test_ledger_backup_into_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedmeta.accounting import BudgetLedger

    db = tmp_path / "ledger.sqlite"
    with BudgetLedger.open(db, "fed", 2.0, 1e-6):
        pass
    target = tmp_path / "backups"
    target.mkdir()
    assert _main(["ledger", "backup", "--db", str(db), "--to", f"{target}/", "--force"]) == 0
    assert (target / "ledger.sqlite").is_file()
    assert str(target / "ledger.sqlite") in capsys.readouterr().out


@pytest.mark.unit
def test_print_config_is_the_validated_tree_as_toml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedmeta.config_io import config_from_dict, load_config

    monkeypatch.chdir(tmp_path)
    assert _main(["simulate", "--print-config", "--set", "rounds=7"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["rounds"] == 7
    assert config_from_dict(printed) == load_config(None, ["rounds=7"])
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.integration
def test_dry_run_prints_the_plan_and_records_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    assert _main(["simulate", "--dry-run", "--set", "rounds=50"]) == 0
    out = capsys.readouterr().out
    assert "== fedmeta federation plan ==" in out and "planned rounds 50" in out
    assert "noise multiplier z = " in out and "dry run: nothing ran" in out
    assert list(tmp_path.iterdir()) == []  # no ledger, no run directory


@pytest.mark.integration
def test_tensorboard_without_the_package_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed: the missing-package path cannot be shown")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    assert _main(["simulate", "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "needs the tensorboard package" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "state").exists()  # refused before anything was recorded


def _spawn(argv: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp_path / "state")}
    return subprocess.Popen([FEDMETA, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)  # fmt: skip


def _as_from_a_terminal() -> None:
    """SIGINT at its default, as a command typed at a terminal has it.

    The test run itself may have inherited SIGINT ignored (a background job of a script, nohup),
    and a child inherits that, which would make every Ctrl-C test meaningless.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.integration
def test_a_closed_pipe_ends_quietly_with_status_0(tmp_path: Path) -> None:
    """`fedmeta privacy epsilon ... --json | head -c0`: the reader is gone before the write."""
    proc = _spawn(["privacy", "epsilon", *SCHEME, "--noise-multiplier", "1", "--rounds", "5",
                   "--json"], tmp_path)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""


def _wait_for_workers(pid: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    return
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.2)
    raise AssertionError(f"process {pid} started no worker in {timeout} s")


@pytest.mark.integration
def test_ctrl_c_in_privacy_plan_is_one_line_and_130(tmp_path: Path) -> None:
    proc = _spawn(["privacy", "plan", "--epsilon", "8", "--participants", "20",
                   "--tasks-per-participant", "200", "--max-tasks-per-round", "200",
                   "--rounds", "100,200,400", "--jobs", "2"], tmp_path)  # fmt: skip
    _wait_for_workers(proc.pid)  # inside the search: its pool of calibrating processes is up
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    # The search's progress lines (stderr, also in a log) may come first; the error is one line.
    progress = re.compile(r"^\S.*: \d+(/\d+)? calibrations( done)?$")
    rest = "\n".join(line for line in err.splitlines() if not progress.match(line))
    assert _one_line(rest) == "fedmeta privacy plan: interrupted", err


@pytest.mark.unit
def test_deploy_run_print_config_needs_no_superlink(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert _main(["deploy", "run", "--print-config", "--set", "rounds=3"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["rounds"] == 3
    assert _main(["deploy", "run", "--set", "rounds", "3"]) == 2
    assert "key=value" in _one_line(capsys.readouterr().err)


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.text, self.tty = "", tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


@pytest.mark.unit
@pytest.mark.parametrize("tty", [True, False])
def test_privacy_plan_shows_its_progress(tty: bool) -> None:
    from fedmeta.cli.privacy_plan import _progress_line

    stream = _Stream(tty)
    show = _progress_line(stream)
    for done in range(21):
        show("searching", done, 20)
    lines = stream.text.replace("\r", "\n").strip("\n").split("\n")
    if tty:  # one line redrawn per calibration, ended when the stage is done
        assert stream.text.startswith("\rsearching: 0/20 calibrations\rsearching: 1/20")
        assert stream.text.endswith("\rsearching: 20/20 calibrations\n") and len(lines) == 21
    else:  # a log gets a line when the stage starts, at each tenth of it, and at its end
        assert lines == ["searching: 0/20 calibrations"] + [
            f"searching: {d}/20 calibrations" for d in range(2, 20, 2)
        ] + ["searching: 20 calibrations done"]


@pytest.mark.unit
def test_the_planner_reports_every_calibration() -> None:
    from fedmeta.accounting.planner import _pool_map

    heard: list[tuple[str, int, int]] = []
    got = _pool_map(str, [(1,), (2,), (3,)], 1, "stage", lambda *a: heard.append(a))
    assert got == ["1", "2", "3"]
    assert heard == [("stage", 0, 3), ("stage", 1, 3), ("stage", 2, 3), ("stage", 3, 3)]
