"""The dashboards as an operator sees them: Prometheus's graph of a run's epsilon, in a browser.

Debian's Prometheus (the package the ``dashboards`` profile's local image installs,
deploy/images/prometheus.Dockerfile) runs as a plain process with the repository's
deploy/prometheus/prometheus.yml, its targets pointed at loopback: the live metrics of a private
``fedmeta simulate`` run (``metrics.port``) and ``fedmeta exporter`` on that run's ledger. While
the run is in its round loop, headless Chromium (Debian's ``chromium``) opens Prometheus's graph of
``fedmeta_epsilon_spent_task`` and the DOM it renders is checked: the series is drawn (an SVG line
with one point per scrape, and the series in the legend) where a query for a series that does not
exist draws none. A screenshot is written beside the test's files (docs/img/ holds one).

Not run here: the same inside compose (``--profile dashboards``), and Grafana, which has no
Debian package (docs/monitoring.md, "Dashboards without a registry").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tests.monitoring.helpers import PROM_DIR, ROOT, free_port, http_get, prom_query, wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.e2e]

SERIES = "fedmeta_epsilon_spent_task"
#: Chromium headless on a machine without a display, a GPU or network beyond loopback.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--window-size=1280,800")  # fmt: skip


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` not installed (Debian: apt-get install -y {package})")
    return path


def _start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _config(tmp: Path, exporter: int, run: int) -> Path:
    """deploy/prometheus/prometheus.yml with loopback targets and a 1 s scrape."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(PROM_DIR / r) for r in config["rule_files"]]
    targets = {"fedmeta-exporter": f"127.0.0.1:{exporter}", "fedmeta-run": f"127.0.0.1:{run}"}
    for job in config["scrape_configs"]:
        job["scrape_interval"] = "1s"
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[str]:
    """A private run with live metrics, the exporter on its ledger, Prometheus: its base URL."""
    prometheus = _tool("prometheus", "prometheus")
    ports = {name: free_port() for name in ("run", "exporter", "prometheus")}
    db, runs = tmp_path / "ledger.sqlite", tmp_path / "runs"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    fedmeta = [sys.executable, "-m", "fedmeta.cli"]
    procs = []
    try:
        procs.append(_start([*fedmeta, "simulate", "--out", str(runs / "run"), *[a for s in (
            "rounds=2000", "federation.backend=inprocess", "privacy.noise_multiplier=2.0",
            "privacy.epsilon_budget=1000", f"privacy.ledger_path={db}", "dataset.test_tasks=20",
            "training.eval_every=1000000", "output.progress=false", "output.plots=false",
            f"metrics.port={ports['run']}") for a in ("--set", s)]],
            tmp_path / "simulate.log", env))  # fmt: skip
        procs.append(_start([*fedmeta, "exporter", "--db", str(db), "--runs-dir", str(runs),
                             "--port", str(ports["exporter"])], tmp_path / "exporter.log",
                            env))  # fmt: skip
        base = f"http://127.0.0.1:{ports['prometheus']}"
        config = _config(tmp_path, ports["exporter"], ports["run"])
        procs.append(_start([prometheus, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{ports['prometheus']}"],
                            tmp_path / "prometheus.log"))  # fmt: skip
        wait_for(lambda: "Ready" in http_get(f"{base}/-/ready"), 60, what="Prometheus")
        yield base
    finally:
        _end(procs)


def _chromium(url: str, user_data: Path, *how: str) -> str:
    """Chromium's output for ``url`` (``--dump-dom`` or ``--screenshot=FILE``)."""
    cmd = [_tool("chromium", "chromium"), *CHROMIUM_FLAGS, f"--user-data-dir={user_data}",
           "--virtual-time-budget=15000", *how, url]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def _graph(base: str, expr: str) -> str:
    query = urllib.parse.urlencode({"g0.expr": expr, "g0.tab": "0", "g0.range_input": "5m"})
    return f"{base}/graph?{query}"  # Debian's 2.42 redirects to its classic UI's graph


#: A drawn line: Rickshaw's SVG path for a series, a move and at least a few line segments.
_LINE = re.compile(r'<path class="path" d="M[-\d.]+,[-\d.]+(?:L[-\d.]+,[-\d.]+){4,}')


def test_dashboards_prometheus_draws_the_runs_epsilon_in_a_browser(
    stack: str, tmp_path: Path
) -> None:
    base = stack
    wait_for(lambda: prom_query(base, f"count_over_time({SERIES}[5m]) >= 10"), 300, interval=1,
             what=f"10 scrapes of {SERIES} from the live run")  # fmt: skip
    assert prom_query(base, "fedmeta_run_active == 1"), "the run is no longer in its round loop"
    assert prom_query(base, "fedmeta_ledger_epsilon_spent_task > 0")  # the exporter, same ledger

    drawn = _chromium(_graph(base, SERIES), tmp_path / "chromium", "--dump-dom")
    assert _LINE.search(drawn), drawn[-3000:]
    assert SERIES in drawn and 'class="legend' in drawn  # the series, named in the legend
    assert prom_query(base, "fedmeta_run_active == 1"), "the run ended before the check"

    # Negative control: the same page for a series that does not exist draws no line.
    empty = _chromium(_graph(base, "fedmeta_no_such_series"), tmp_path / "chromium", "--dump-dom")
    assert "<html" in empty and not _LINE.search(empty)

    shot = tmp_path / "prometheus-epsilon.png"
    _chromium(_graph(base, SERIES), tmp_path / "chromium", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")


@pytest.mark.slow
def test_dashboards_profile_on_podman_draws_a_deployed_runs_epsilon(
    podman_dashboards: dict[str, str], tmp_path: Path
) -> None:
    """``docker compose --profile dashboards up`` on podman with no image registry: Prometheus
    from Debian's package (``scripts/podman-setup.sh dashboards``, FEDMETA_PROMETHEUS_IMAGE; the
    session fixture builds it once), scraping the ServerApp of a ``deploy run``; the same browser
    check on Prometheus's published port (a free one here: FEDMETA_PROMETHEUS_PORT)."""
    from tests.deploy.test_compose_faults import Compose

    image = podman_dashboards.get("FEDMETA_PROMETHEUS_IMAGE", "")
    if not image.startswith("localhost/"):
        pytest.skip(f"FEDMETA_PROMETHEUS_IMAGE is {image!r} here, not the local image of "
                    "`scripts/podman-setup.sh dashboards` that this test checks")  # fmt: skip
    dc = Compose(podman_dashboards, "fedmeta-dashboards", "--profile", "dashboards")
    dc.down()  # what an interrupted earlier session left of this project
    try:
        up = dc("up", "-d", "--no-build", "--wait", "--wait-timeout", "840", timeout=900)
        assert up.returncode == 0, up.stdout + up.stderr
        # Long enough to be checked during: a budget of 20 and rounds of at least 1 s (the
        # module's budget of 2 ended this run in 7 rounds, before Prometheus's 4 scrapes).
        run = dc.deploy_run("--set", "rounds=200", "--set", "privacy.epsilon_budget=20",
                            "--set", "federation.round_min_seconds=1")  # fmt: skip
        base = f"http://127.0.0.1:{dc.env['FEDMETA_PROMETHEUS_PORT']}"
        wait_for(lambda: prom_query(base, f"count_over_time({SERIES}[5m]) >= 4"), 600,
                 interval=2, what=f"4 scrapes of {SERIES} from the ServerApp")  # fmt: skip
        assert run.poll() is None, run.communicate()[0]  # during the run
        drawn = _chromium(_graph(base, SERIES), tmp_path / "chromium", "--dump-dom")
        assert _LINE.search(drawn) and SERIES in drawn, drawn[-3000:]
        shot = tmp_path / "compose-prometheus-epsilon.png"
        _chromium(_graph(base, SERIES), tmp_path / "chromium", f"--screenshot={shot}")
        print(f"screenshot: {shot}; Prometheus image {image}")
        run.terminate()
    finally:
        dc.down()  # checked: a failed `down` once left the SuperLink running (issue 54)
