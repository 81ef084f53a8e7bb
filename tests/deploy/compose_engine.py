"""The compose tests' podman and images, set up once per test session (tests/deploy/conftest.py).

``scripts/podman-setup.sh all`` (packages, base image, the Docker-compatible API, healthchecks)
and ``scripts/compose-build.sh podman`` (fedmeta's two images, one engine build each) run once;
every compose test of the session then runs compose with ``--no-build``. Before, each of the five
compose tests built its images again through ``docker compose build`` (issue 41: the deploy suite
did not fit in 25 minutes). Under ``pytest -n 2`` each worker runs the session fixtures: a lock
file makes the second wait for the first's setup and build, then find them done.

Each compose project of the tests has its own name and its own published host ports
(``project_env``), so that two can run at once, one per worker. Each name is recorded in
``STARTED`` when a test starts its project; the tests take their projects down, checked
(``take_down``, compose-smoke.sh's own cleanup), and tests/deploy/conftest.py checks at the
session's end that podman holds nothing of them (``podman_leftovers``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fedmeta.cli.deploy_local import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Held while podman is set up or images are built (one xdist worker at a time).
LOCK = Path(os.environ.get("FEDMETA_PODMAN_LOCK", "/var/tmp/fedmeta-podman-setup.lock"))

#: docker-compose.yml's published host ports, by their variables (defaults 8000, 9464, 9090, 3000).
PORT_VARS = ("FEDMETA_SUPERLINK_PORT", "FEDMETA_EXPORTER_PORT", "FEDMETA_PROMETHEUS_PORT",
             "FEDMETA_GRAFANA_PORT")  # fmt: skip


#: The compose projects this session's tests started on podman (one set per xdist worker):
#: nothing of theirs may be left when the session ends (tests/deploy/conftest.py).
STARTED: set[str] = set()
#: The project of ``podman-setup.sh check`` (``all``, run by the podman_images fixture).
SETUP_CHECK_PROJECT = "fedmeta-podman-check"
#: Compose's label naming a container's, network's or volume's project.
PROJECT_LABEL = "com.docker.compose.project"


def project_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with free loopback ports for every port docker-compose.yml publishes."""
    return {**env, **{var: str(free_port()) for var in PORT_VARS}}


def _once_per_run(step: str, action: Callable[[], None]) -> None:
    """``action()``, one xdist worker at a time, unless another worker of this test run did it.

    The marker holds the run's PYTEST_XDIST_TESTRUNUID (the same in every worker of one run), so
    a later run does the step again: `podman-setup.sh all` ends with a compose project of its
    own, which on two loaded cores took minutes, and need not run twice in one test run.
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    done = LOCK.with_name(f"{LOCK.name}.{step}")
    with LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        if run is not None and done.is_file() and done.read_text() == run:
            return
        action()
        if run is not None:
            done.write_text(run)


def podman_unavailable() -> str | None:
    """Why scripts/podman-setup.sh cannot run here, or None."""
    if os.geteuid() != 0:
        return "scripts/podman-setup.sh (packages, the API service) needs root"
    if shutil.which("apt-get") is None:
        return "scripts/podman-setup.sh needs Debian's apt-get"
    return None


def _script(*args: str, timeout: float) -> str:
    res = subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, check=False)  # fmt: skip
    assert res.returncode == 0, f"{' '.join(args)}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
    return res.stdout


def podman_with_images() -> dict[str, str]:
    """The environment for compose over podman, its images built; skipped where it cannot run."""
    reason = podman_unavailable()
    if reason:
        pytest.skip(reason)

    def setup_and_build() -> None:
        _script("scripts/podman-setup.sh", "all", timeout=3600)
        print(_script("scripts/compose-build.sh", "podman", timeout=5400), end="")

    STARTED.add(SETUP_CHECK_PROJECT)
    _once_per_run("images", setup_and_build)
    return podman_env()


def with_prometheus_image() -> dict[str, str]:
    """``podman_with_images``' environment once the ``dashboards`` profile's local Prometheus
    image exists (``podman-setup.sh dashboards``: Debian's package on the local base image, kept
    once built), which ``env`` then exports as FEDMETA_PROMETHEUS_IMAGE. Without it the
    dashboards test on podman would skip after ``podman-setup.sh all``, which does not build it.
    """

    def build_prometheus() -> None:
        print(_script("scripts/podman-setup.sh", "dashboards", timeout=1800), end="")

    _once_per_run("dashboards", build_prometheus)
    return podman_env()


def podman_env() -> dict[str, str]:
    """This environment with what ``podman-setup.sh env`` exports (its own DOCKER_HOST)."""
    exports = _script("scripts/podman-setup.sh", "env", timeout=120)
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    for line in exports.splitlines():
        # `export A=1 B=2` lines of plain words (podman-setup.sh prints them so)
        for pair in line.removeprefix("export ").split():
            key, _, value = pair.partition("=")
            env[key] = value.strip("'")
    return env


def podman_leftovers(env: dict[str, str], projects: set[str]) -> list[str]:
    """What podman still holds of the compose ``projects``: containers, pods, networks and
    volumes labelled with one of them or named as compose names them (``PROJECT-...``,
    ``PROJECT_...``), as ``"kind name"``. Nothing else is looked at, and nothing is changed."""
    left = []
    for kind, cmd in (("container", ["ps", "-a"]), ("pod", ["pod", "ps"]),
                      ("network", ["network", "ls"]), ("volume", ["volume", "ls"])):  # fmt: skip
        res = subprocess.run(["podman", *cmd, "--format", "json"], env=env, capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
        assert res.returncode == 0, f"podman {' '.join(cmd)}: {res.stderr[-1000:]}"
        for item in json.loads(res.stdout or "[]"):
            # podman 4.3 spells them so: Names (a list) for containers, name/labels for networks
            names = item.get("Names") or item.get("Name") or item.get("name") or []
            name = names[0] if isinstance(names, list) else str(names)
            labels = item.get("Labels") or item.get("labels") or {}
            if labels.get(PROJECT_LABEL) in projects or any(
                name.startswith((f"{p}-", f"{p}_")) for p in projects
            ):
                left.append(f"{kind} {name}")
    return left


def take_down(cli: list[str], env: dict[str, str], project: str) -> None:
    """``CLI down -v --remove-orphans`` of ``project`` (``cli`` names it), checked: once more if
    it fails or leaves something; after a second failure what is left of the project (by its
    label) is removed with podman and an AssertionError says what ``down`` left and why.

    Unchecked, a failed ``down`` left a project's SuperLink running 50 minutes after the suite
    (issue 54).
    """
    said = ""
    for attempt in (1, 2):
        try:
            res = subprocess.run([*cli, "down", "-v", "--remove-orphans", "-t", "5"], cwd=ROOT,
                                 env=env, capture_output=True, text=True, timeout=300,
                                 check=False)  # fmt: skip
            said = f"exit {res.returncode}: {res.stdout[-1500:]}{res.stderr[-1500:]}"
            done = res.returncode == 0
        except subprocess.TimeoutExpired:
            said, done = "no answer in 300 s", False
        left = podman_leftovers(env, {project})
        if done and not left:
            return
        print(f"`down` of {project} (try {attempt}) left {left}, {said}", file=sys.stderr)
    _remove_project(env, project)
    raise AssertionError(f"`down` of compose project {project} failed twice and left {left} "
                         f"(removed with podman since), {said}")  # fmt: skip


def _remove_project(env: dict[str, str], project: str) -> None:
    """Remove the containers, networks and volumes labelled as ``project``'s (podman)."""
    label = f"label={PROJECT_LABEL}={project}"
    for ls, rm in ((["ps", "-a"], ["rm", "-f", "-v"]), (["network", "ls"], ["network", "rm", "-f"]),
                   (["volume", "ls"], ["volume", "rm", "-f"])):  # fmt: skip
        res = subprocess.run(["podman", *ls, "-q", "--filter", label], env=env,
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        ids = res.stdout.split()
        if ids:
            subprocess.run(["podman", *rm, *ids], env=env, capture_output=True, timeout=300,
                           check=False)  # fmt: skip


def compose_cli() -> list[str]:
    """``docker compose`` where the Docker CLI has the plugin, else the static Compose binary."""
    res = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60,
                         check=False) if shutil.which("docker") else None  # fmt: skip
    if res is not None and res.returncode == 0:
        return ["docker", "compose"]
    return [_script("scripts/podman-setup.sh", "compose-bin", timeout=60).strip()]


def smoke(engine: str, env: dict[str, str], *more: str) -> str:
    """scripts/compose-smoke.sh on ``engine`` (and ``more`` of its flags); its output, checked.
    The project is named after the test, its ports free ones: two can run at once."""
    args = ["--engine", engine, *more]
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    project = "fedmeta-smoke-" + test.removeprefix("test_compose_federation_").replace("_", "-")
    env = {**project_env(env), "FEDMETA_SMOKE_PROJECT": project}
    if engine == "podman":  # Docker Engine's: the script's cleanup checks them
        STARTED.add(project)
    # `flwr run .` against the federation: the flwr CLI installed with fedmeta, beside this
    # interpreter when the environment is not activated (`.venv/bin/python -m pytest`).
    beside = Path(sys.executable).parent / "flwr"
    flwr_cli = str(beside) if beside.is_file() else (shutil.which("flwr") or "")
    try:
        res = subprocess.run(["bash", str(ROOT / "scripts" / "compose-smoke.sh"), *args],
                             cwd=ROOT, env={**env, "FEDMETA_FLWR": flwr_cli},
                             capture_output=True, text=True, timeout=5400, check=False)  # fmt: skip
    finally:
        # The script takes its project down (checked) unless it is killed first (the timeout).
        if engine == "podman" and podman_leftovers(env, {project}):
            take_down([*compose_cli(), "-p", project], env, project)
    print(res.stdout)  # the run's record (pytest -s or -rP shows it)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "compose-smoke: ok" in res.stdout
    if "--quick" in more:  # one run of 2 rounds (compose-smoke.sh, step 3)
        assert "compose-smoke: first run (2 rounds)" in res.stdout
        assert "runs: 2 + 0 + 0 + 0 rounds" in res.stdout
        return res.stdout
    assert "stopped: budget_exhausted" in res.stdout
    if "--tls" not in more:  # `flwr run .` is the step without TLS (compose-smoke.sh, 3b)
        assert "compose-smoke: flwr run . (run" in res.stdout
    assert "compose-smoke: the participant image reads PNG drawings" in res.stdout
    return res.stdout
