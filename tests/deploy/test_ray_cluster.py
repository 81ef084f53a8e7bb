"""`fedmeta simulate` on an existing two-node Ray cluster (`federation.ray_address`).

Two Ray nodes on this machine, started as an operator would (`ray start --head`, then `ray start
--address` with its own temp directory and ports), each offering 1 CPU. Checked:

* a private run with `federation.ray_address` set finishes as a job *of that cluster* (the
  cluster's job table grows by one);
* Flower sizes the participants' actor pool from the cluster's resources and
  `federation.client_num_cpus`: asking 1.5 CPUs per participant, more than either node offers,
  places no actor and the run fails with a non-zero exit, where a private instance would use the
  machine's own CPUs.

Every Ray process is ended by its process id (`ray stop` would stop other users' clusters).
`slow`: two Ray nodes and two runs take a minute or two on 2 shared cores.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmeta.cli.deploy_local import free_port

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.e2e]

BIN = Path(sys.executable).parent
RUN = ["federation.participants=2", "sampling.participants_per_round=2", "sampling.task_rate=0.3",
       "dataset.tasks_per_participant=20", "dataset.validation_tasks=8", "dataset.test_tasks=16",
       "dataset.probe_tasks=0", "training.eval_every=1000", "privacy.report_every=1000",
       "privacy.epsilon_budget=2", "privacy.noise_multiplier=1.5", "rounds=4",
       "output.plots=false", "output.progress=false", "federation.client_num_cpus=1"]  # fmt: skip


def _env(tmp: Path) -> dict[str, str]:
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", FLWR_TELEMETRY_ENABLED="0",
                FLWR_DISABLE_UPDATE_CHECK="1", FEDMETA_STATE_DIR=str(tmp / "state"),
                PATH=f"{BIN}:{os.environ.get('PATH', '')}")  # fmt: skip


def _ray_pids(temp_dir: Path) -> set[int]:
    """Every process whose command line names this cluster's temp directory or session."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(temp_dir) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.add(int(entry.name))
    return pids


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    """A head and a worker node (1 CPU each); their address. Stopped by process id."""
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip(f"no ray CLI beside {sys.executable}")
    env = _env(tmp_path)
    port = free_port()
    head_tmp = Path("/tmp") / f"rh{port}"  # short: Ray's AF_UNIX socket paths live under it
    common = ["--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats"]
    try:
        subprocess.run([str(BIN / "ray"), "start", "--head", "--port", str(port),
                        "--temp-dir", str(head_tmp), *common, "--node-manager-port",
                        str(free_port()), "--object-manager-port", str(free_port())],
                       env=env, check=True, capture_output=True, timeout=240)  # fmt: skip
        address = f"127.0.0.1:{port}"
        # A worker node takes its temp directory (and so its processes' command lines) from the
        # head, and has no dashboard option.
        subprocess.run([str(BIN / "ray"), "start", "--address", address, "--num-cpus", "1",
                        "--disable-usage-stats", "--node-manager-port", str(free_port()),
                        "--object-manager-port", str(free_port())],
                       env=env, check=True, capture_output=True, timeout=240)  # fmt: skip
        yield address
    finally:
        for temp in (head_tmp,):
            for pid in _ray_pids(temp):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        time.sleep(3)
        for temp in (head_tmp,):
            for pid in _ray_pids(temp):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(temp, ignore_errors=True)


def _simulate(tmp: Path, out: str, *sets: str) -> subprocess.CompletedProcess[str]:
    args = [a for s in (*RUN, *sets) for a in ("--set", s)]
    return subprocess.run([str(BIN / "fedmeta"), "simulate", "--out", str(tmp / out), *args],
                          env=_env(tmp), capture_output=True, text=True, timeout=900,
                          check=False, cwd=tmp)  # fmt: skip


def _jobs(address: str, tmp: Path) -> int:
    """How many drivers (jobs) the cluster has seen before this look, from its GCS."""
    code = (
        f"import ray; ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False); "
        "from ray._private.state import jobs; print(len(jobs()) - 1)"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_env(tmp), capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return int(res.stdout.strip().splitlines()[-1])


def test_simulation_attaches_to_a_two_node_cluster(cluster: str, tmp_path: Path) -> None:
    before = _jobs(cluster, tmp_path)
    res = _simulate(tmp_path, "on-cluster", f"federation.ray_address={cluster!r}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "stopped:" in res.stdout, res.stdout[-3000:]
    # The run was a job of this cluster (the other new one is the first look).
    assert _jobs(cluster, tmp_path) == before + 2

    # 1.5 CPUs per participant: neither 1-CPU node can host one, whatever this machine has.
    res = _simulate(
        tmp_path, "too-big", f"federation.ray_address={cluster!r}",
        "federation.client_num_cpus=1.5", "federation.register_timeout_s=30",
    )  # fmt: skip
    assert res.returncode != 0, res.stdout[-3000:]
