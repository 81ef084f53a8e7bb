"""A real `docker compose up` of the federation with the TLS overlay, through podman's
Docker-compatible socket and locally built images (scripts/compose-smoke.sh): a private run to
budget_exhausted with `fedmeta deploy run`, the ledger seen by the exporter, and a second run that
finds the budget spent (exit status 3). `slow`: about 10 minutes with the image build, 4 without."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def test_compose_federation_through_podman() -> None:
    if os.geteuid() != 0:
        pytest.skip("the podman service of scripts/podman-setup.sh needs root")
    if shutil.which("podman") is None:
        pytest.skip("podman not installed (scripts/podman-setup.sh install)")
    env_dir = Path(os.environ.get("FEDMETA_PODMAN_DIR", "/var/tmp/fedmeta-podman"))
    if not (env_dir / "podman.sock").exists():
        pytest.skip(f"no podman service socket in {env_dir} (scripts/podman-setup.sh service)")
    args = ["--no-build"] if os.environ.get("FEDMETA_SMOKE_NO_BUILD") == "1" else []
    res = subprocess.run(["bash", str(ROOT / "scripts" / "compose-smoke.sh"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600, check=False)  # fmt: skip
    print(res.stdout)  # the run's record (pytest -s or -rP shows it)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "compose-smoke: ok" in res.stdout
    assert "stopped: budget_exhausted" in res.stdout
