"""scripts/flwr-run-wait.py exits with the run's outcome, where `flwr run` exits 0 either way.

A SuperLink on a loopback port (insecure: the test's own loopback only) runs two tiny ServerApps,
one that returns and one that raises."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deploy, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

APP = """
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    if context.run_config["fail"]:
        raise RuntimeError("boom from the ServerApp")
"""

PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "runwait"
version = "1.0.0"
dependencies = []

[tool.flwr.app]
publisher = "test"

[tool.flwr.app.components]
serverapp = "runwait_app:app"
clientapp = "runwait_app:app"

[tool.flwr.app.config]
fail = false
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_exit_status_follows_the_run(tmp_path: Path) -> None:
    if not (BIN / "flower-superlink").is_file():
        pytest.skip(f"flower-superlink not beside {sys.executable}")
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "runwait_app.py").write_text(APP)
    home = tmp_path / "home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "t"\n\n[superlink.t]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}:{os.environ.get('PATH', '')}",
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")  # fmt: skip
    link = subprocess.Popen(
        [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
         "--disable-runtime-dependency-installation"],
        env=env, stdout=(tmp_path / "superlink.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            probe = subprocess.run([str(BIN / "flwr"), "ls", "t"], env=env, capture_output=True,
                                   timeout=60, check=False)  # fmt: skip
            if probe.returncode == 0:
                break
            time.sleep(1)

        def wait(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "flwr-run-wait.py"), str(app), "t",
                 "--poll", "0.5", "--timeout", "240", *extra],
                env=env, capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip

        ok = wait()
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "finished:completed" in ok.stdout
        failed = wait("--run-config", "fail=true")
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "finished:failed" in failed.stdout and "boom from the ServerApp" in failed.stdout
    finally:
        os.killpg(link.pid, signal.SIGTERM)
        try:
            link.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(link.pid, signal.SIGKILL)
            link.wait(timeout=15)
