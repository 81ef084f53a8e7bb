"""A new user's first hour (issue 40): what the README leads them to do behaves as it says.

``--experiment NAME`` writes to runs/NAME whatever the configuration's output.dir; ``--dry-run``
reads the ledger and forecasts what the real run does; the first Ctrl-C ends the default job within
seconds with a checkpoint; a mistyped configuration flag points at ``--set``; a run piped into
``head`` ends with status 0; the wheel builds without deprecation warnings.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FEDMETA = str(Path(sys.executable).parent / "fedmeta")
#: A few rounds on few tasks: what these tests need of a run is its outputs, not its model.
SHORT = ["rounds=4", "training.eval_every=2", "dataset.validation_tasks=8",
         "dataset.test_tasks=20", "output.plots=false"]  # fmt: skip


def _sets(pairs: list[str]) -> list[str]:
    return [w for s in pairs for w in ("--set", s)]


def _fedmeta(args: list[str], cwd: Path, state: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FEDMETA_STATE_DIR": str(state)}
    return subprocess.run([FEDMETA, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1800, stdin=subprocess.DEVNULL)  # fmt: skip


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_an_experiment_writes_to_runs_name_whatever_the_config_says(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "sinusoid.toml"
    config.write_text((REPO / "configs" / "sinusoid.toml").read_text())
    assert 'dir = "runs/sinusoid"' in config.read_text()  # the case the issue met
    res = _fedmeta(["simulate", "--config", "configs/sinusoid.toml", "--experiment", "long-4",
                    *_sets(SHORT)], tmp_path, tmp_path / "state")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "long-4" / "summary.json").read_text())
    assert summary["experiment"] == "long-4"
    assert not (tmp_path / "runs" / "sinusoid").exists()


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_dry_run_on_spent_data_forecasts_the_run_and_spends_nothing(tmp_path: Path) -> None:
    """The dry run reads the recorded budget and says what the run does, which spent data no
    longer refuses (issue 52, item 6): the second run runs its rounds, charged to nobody."""
    from fedmeta.accounting import BudgetLedger

    state = tmp_path / "state"
    spend = _fedmeta(["simulate", *_sets(SHORT)], tmp_path, state)  # the whole default budget
    assert spend.returncode == 0, spend.stderr[-3000:]
    ledger = state / "ledger.sqlite"
    before = ledger.read_bytes()
    dry = _fedmeta(["simulate", "--dry-run", "--out", "runs/second", *_sets(SHORT)], tmp_path,
                   state)  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "ledger before this run: 4 spends" in dry.stdout, dry.stdout
    assert "recorded in" in dry.stdout and "Traceback" not in dry.stderr
    assert "rounds this run will run: 4" in dry.stdout, dry.stdout
    assert ledger.read_bytes() == before and not (tmp_path / "runs" / "second").exists()
    (fid,) = BudgetLedger.federations(ledger)
    with BudgetLedger.open_readonly(ledger, fid) as book:
        spent = book.epsilon()
    real = _fedmeta(["simulate", "--out", "runs/second", *_sets(SHORT)], tmp_path, state)
    assert real.returncode == 0, real.stderr[-3000:]
    first = json.loads((tmp_path / "runs" / "fedmeta" / "summary.json").read_text())
    second = json.loads((tmp_path / "runs" / "second" / "summary.json").read_text())
    assert second["rounds_completed"] == 4 and second["epsilon_spent"] == first["epsilon_spent"]
    with BudgetLedger.open_readonly(ledger, fid) as book:
        assert book.position() == 8 and book.epsilon() == spent  # charged to nobody


class _Terminal:
    """A pseudo-terminal for a child's stderr, so its progress bar redraws every round."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self.text = ""
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096).decode(errors="replace")
            except OSError:  # the child closed its end
                return
            if not chunk:
                return
            with self.lock:
                self.text += chunk

    def wait_for(self, needle: str, timeout: float, proc: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            with self.lock:
                if needle in self.text:
                    return
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not seen: {self.text[-2000:]}")


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_first_ctrl_c_ends_the_default_job_within_seconds_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    """SIGINT at round 3 of the 200-round default job: exit within 10 s of the signal (issue 40).

    The clock starts at the signal, so a loaded machine's slow start does not count; what is
    bounded is the round in flight, the checkpoint, the summary and the exit, the test
    evaluation and the plots being left to the resume. Measured here: 4.8 and 5.5 s at a load
    average of 10 on 2 cores (12.8 and 13.2 s while the plots were still drawn).
    """
    term = _Terminal()
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([FEDMETA, "simulate"], cwd=tmp_path, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=term.slave)  # fmt: skip
    os.close(term.slave)
    try:
        term.wait_for("round 3/200", 1200, proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.2)  # the reader's last chunk
    assert proc.returncode == 130, term.text[-3000:]
    print(f"stopped {took:.1f} s after the signal")
    assert took < 10, f"{took:.1f} s from the signal to the exit"
    run = tmp_path / "runs" / "fedmeta"
    assert (run / "checkpoint.pt").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_reason"] == "interrupted" and summary["final_metric"] is None
    assert not list(run.glob("*.png"))  # drawn when the resumed run ends
    assert 3 <= summary["rounds_completed"] < 200
    text = " ".join(term.text.split())  # the lines as printed, whatever the terminal wrapped
    assert "test evaluation is left to --resume or `fedmeta evaluate`" in text, text[-3000:]
    assert f"fedmeta simulate --resume --out {Path('runs/fedmeta')}" in text
    assert "fedmeta evaluate --checkpoint runs/fedmeta" in text


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_a_completed_run_piped_into_head_exits_0(tmp_path: Path) -> None:
    """``fedmeta simulate | head``: the reader leaves after the plan; the run completes, exit 0."""
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([FEDMETA, "simulate", *_sets(SHORT)], cwd=tmp_path, env=env,
                            text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    head = [proc.stdout.readline() for _ in range(3)]  # as `head -3` reads, then leaves
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=1800)
    assert head[0].startswith("== fedmeta federation plan ==")
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "cannot write" not in err, err[-3000:]
    summary = json.loads((tmp_path / "runs" / "fedmeta" / "summary.json").read_text())
    assert summary["rounds_completed"] == 4


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_a_reader_gone_before_the_first_line_does_not_end_the_run(tmp_path: Path) -> None:
    """Every print of the run meets a closed pipe (``| head -0``, or a reader that left while the
    plan was still being written, as on a loaded CI machine): the run still completes, exit 0.
    Before ReaderMayLeave the first BrokenPipeError ended it before its first round,
    with status 0 and no summary (checked: this test failed so)."""
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp_path / "state")}
    read, write = os.pipe()
    proc = subprocess.Popen([FEDMETA, "simulate", *_sets(SHORT)], cwd=tmp_path, env=env,
                            text=True, stdin=subprocess.DEVNULL, stdout=write,
                            stderr=subprocess.PIPE)  # fmt: skip
    os.close(write)
    os.close(read)  # no reader at all: the first write (or flush) meets EPIPE
    err = proc.communicate(timeout=1800)[1]
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    summary = json.loads((tmp_path / "runs" / "fedmeta" / "summary.json").read_text())
    assert summary["rounds_completed"] == 4 and summary["stopped_reason"] == "planned_rounds"


@pytest.mark.integration
def test_ledger_show_says_experiments_keep_ledgers_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedmeta.accounting import BudgetLedger
    from fedmeta.cli import main
    from fedmeta.paths import default_ledger_path, experiment_ledger_path

    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path))
    for path in (default_ledger_path(secure=True), experiment_ledger_path("eps-1", secure=True)):
        path.parent.mkdir(parents=True, exist_ok=True)
        BudgetLedger.open(path, "fed-a", epsilon_budget=1.0, delta=1e-5).close()
    assert main(["ledger", "show"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "ledgers of their own" in last and ": eps-1;" in last, last
    assert "fedmeta ledger show --experiment NAME" in last
    assert main(["ledger", "show", "--experiment", "eps-1"]) == 0  # not said of an experiment's
    assert "ledgers of their own" not in capsys.readouterr().out


@pytest.mark.integration
def test_the_install_probe_gives_up_within_its_timeout_and_falls_back(tmp_path: Path) -> None:
    """scripts/install.sh asks PyTorch's CPU index only where it answers within seconds.

    A server that accepts the connection and never answers is the slow case (a name that does not
    resolve, or a refused connection, fails at once): the probe gives up after its timeout.
    """
    import socket

    script = ('source scripts/install.sh; PROBE_SECONDS=2; '
              'if index_reachable "$1"; then echo reachable; else echo unreachable; fi'
              )  # fmt: skip
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu"
        started = time.monotonic()
        res = subprocess.run(["bash", "-c", script, "probe", url], cwd=REPO, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        took = time.monotonic() - started
    assert res.stdout.strip() == "unreachable", res.stdout + res.stderr
    assert took < 60, took  # 2 s and the interpreter's start; a hang would be minutes


@pytest.mark.integration
def test_the_install_says_which_torch_build_it_has(tmp_path: Path) -> None:
    venv = Path(sys.executable).parent.parent  # this test run's venv: torch is there already
    res = subprocess.run(["bash", "-c", 'source scripts/install.sh; install_torch "$1" 0',
                          "install", str(venv)], cwd=REPO, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"torch {torch.__version__}: {build}, already in {venv}"]


@pytest.mark.unit
def test_a_signal_before_the_rounds_begin_aborts_at_once() -> None:
    """Loading data or registering: nothing is spent or in flight, so the first Ctrl-C ends it."""
    from fedmeta.simulation.simulate import RoundsStarted, _stop_on_signals

    stop, rounds = threading.Event(), threading.Event()
    restore = _stop_on_signals(stop, rounds)
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert not stop.is_set()
        RoundsStarted(rounds).run_started(None)  # the plan announced: a round may be in flight
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set()  # the run stops after its round, with a checkpoint
        with pytest.raises(KeyboardInterrupt):  # and a second signal aborts at once
            signal.raise_signal(signal.SIGINT)
    finally:
        restore()


@pytest.mark.unit
def test_an_interrupted_runs_plots_say_so_and_an_empty_one_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from fedmeta.server import plots
    from fedmeta.server.report import RoundOutcome

    figures: list[object] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    summary = {"private": True, "stopped_reason": "interrupted", "rounds_completed": 3,
               "epsilon_budget": 8.0, "metric": "mse", "experiment": None}  # fmt: skip
    done = [RoundOutcome("run", "fed", r, epsilon_task=float(r)) for r in (1, 2, 3)]
    assert plots.write_plots(tmp_path, done, summary)
    titles = [fig.axes[0].get_title() for fig in figures]  # type: ignore[attr-defined]
    assert all("interrupted after round 3" in t for t in titles), titles
    notes = [t.get_text() for t in figures[1].axes[0].texts]  # type: ignore[attr-defined]
    assert any("no validation yet" in n for n in notes), notes  # validated every 25 rounds


def _bar_lines(private: bool, target: float | None, spent_before: float) -> list[str]:
    import io

    from fedmeta.server.progress import ProgressBar
    from fedmeta.server.report import RoundOutcome, RunStarted

    stream = io.StringIO()
    bar = ProgressBar(stream=stream, every=1)
    bar.run_started(RunStarted("run", "fed", private, 8.0 if private else None, 1e-5, 1.0, 1.0, 4,
                               4, spent_before, None, 6, "mse", False,
                               target_epsilon=target))  # fmt: skip
    for r in (1, 2):
        bar.round_finished(RoundOutcome("run", "fed", r, epsilon_task=r / 2 if private else None))
    return stream.getvalue().splitlines()


@pytest.mark.unit
def test_the_bar_shows_the_runs_target_and_a_baseline_its_time_left() -> None:
    assert "| eps 1.000/4 (target) |" in _bar_lines(True, 4.0, 0.0)[1]  # flwr run's epsilon=4
    assert "| eps 1.000/8 (budget; this run's target 4) |" in _bar_lines(True, 4.0, 2.0)[1]
    assert "| eps 1.000/8 |" in _bar_lines(True, None, 0.0)[1]
    private = _bar_lines(True, None, 0.0)[1]
    assert "left" not in private and "r/s" not in private  # a private run's timing is a release
    baseline = _bar_lines(False, None, 0.0)[1]
    assert "NON-PRIVATE" in baseline and "r/s, ~" in baseline and baseline.endswith("s left")
