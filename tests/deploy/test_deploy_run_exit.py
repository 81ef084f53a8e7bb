"""`fedmeta deploy run` exits non-zero when the ServerApp fails (`flwr run` exits 0 either way).

A SuperLink on a loopback port (insecure: the test's own loopback only) and no participant: the
ServerApp waits `federation.register_timeout_s` for one, raises RegistrationError, and the command
exits 4 (unavailable), naming the error and where the outputs and the ledger are. The successful
path (exit 0, budget_exhausted) is tests/deploy/test_federation_netns.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmeta import exitcodes
from fedmeta.cli.deploy_local import free_port

pytestmark = [pytest.mark.deploy, pytest.mark.integration]

BIN = Path(sys.executable).parent


def test_a_failed_serverapp_is_a_failed_command(tmp_path: Path) -> None:
    if not (BIN / "flower-superlink").is_file():
        pytest.skip(f"flower-superlink not beside {sys.executable}")
    port = free_port()
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "home"), FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1",
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")  # fmt: skip
    link = subprocess.Popen(
        [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
         "--disable-runtime-dependency-installation"],
        env=env, stdout=(tmp_path / "superlink.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True, cwd=tmp_path,
    )  # fmt: skip
    out = tmp_path / "runs" / "no-participants"
    try:
        res = None
        for _ in range(60):  # the SuperLink answers within seconds
            res = subprocess.run(
                [str(BIN / "fedmeta"), "deploy", "run", "--insecure", "--superlink",
                 f"127.0.0.1:{port}", "--out", str(out), "--poll", "0.5", "--timeout", "300",
                 "--set", "rounds=2", "--set", "federation.register_timeout_s=2",
                 "--set", f"privacy.ledger_path={tmp_path / 'state' / 'ledger.sqlite'}"],
                env=env, capture_output=True, text=True, timeout=400, check=False,
            )  # fmt: skip
            if "did not accept the run" not in res.stderr:
                break
            time.sleep(1)
        assert res is not None
        text = res.stdout + res.stderr
        assert res.returncode == exitcodes.UNAVAILABLE, text
        assert "finished:failed" in res.stdout, text
        assert "RegistrationError" in res.stderr, text
        # Only files that exist are named: the ServerApp failed before writing any.
        assert f"outputs (on the ServerApp's host): {out}: " in res.stdout, text
        assert "summary.json" not in res.stdout, text
        assert "fedmeta ledger backup" in res.stdout, text
    finally:
        os.killpg(link.pid, signal.SIGTERM)
        try:
            link.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(link.pid, signal.SIGKILL)
            link.wait(timeout=15)
