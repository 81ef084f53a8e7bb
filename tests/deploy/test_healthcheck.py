"""deploy/images/healthcheck.py, the images' container healthcheck: the `worker` role (fedmeta's
worker alone, its SuperNode in another container) against a stand-in Runtime API."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deploy, pytest.mark.unit]

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "images" / "healthcheck.py"


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def runtime_api() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _check(role: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), role], capture_output=True, text=True,
                          timeout=30, env={"PATH": os.environ.get("PATH", ""), **env})  # fmt: skip


def test_worker_is_healthy_only_with_its_supernode_answering_and_a_fresh_liveness_file(
    runtime_api: str, tmp_path: Path
) -> None:
    alive = tmp_path / "alive"
    env = {"FEDMETA_RUNTIME_API": runtime_api, "FEDMETA_WORKER_ALIVE": str(alive),
           "FEDMETA_WORKER_ALIVE_MAX_AGE_S": "60"}  # fmt: skip
    missing = _check("worker", env)
    assert missing.returncode == 1 and "missing" in missing.stderr
    alive.touch()
    assert _check("worker", env).returncode == 0
    old = time.time() - 120
    os.utime(alive, (old, old))
    stale = _check("worker", env)
    assert stale.returncode == 1 and "s old" in stale.stderr
    alive.touch()
    host = runtime_api.rpartition(":")[0]
    gone = _check("worker", {**env, "FEDMETA_RUNTIME_API": f"{host}:1"})  # nothing listens
    assert gone.returncode == 1
    assert _check("nobody", env).returncode == 2
