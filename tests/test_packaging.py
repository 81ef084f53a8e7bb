"""The wheel works on its own: built from the sources, installed into a clean venv outside the
checkout, it installs nothing at the top level but ``fedmeta`` and runs the main job and the
deployment commands from a directory that is not the checkout.

The clean venv gets fedmeta from the wheel alone (``--no-deps``); its dependencies come from this
test run's site-packages through a ``.pth`` line. A ``.pth`` line only adds a directory to
``sys.path``: the checkout's editable install (itself a ``.pth`` file in that directory, listing the
source roots) is not read, so nothing of the checkout can leak in, which the test checks
(``fedmeta.__path__``: ``fedmeta`` is a namespace package, one folder in the wheel).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
#: What a build needs is the sources; these are a checkout's local state, not sources.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", ".ci-venv*", "__pycache__", "*.egg-info", "build", "dist", "runs", "data",
    ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "wheelhouse", "*.sqlite*", "*.pt",
)  # fmt: skip
#: Package data the code finds through fedmeta.deploy.data_file (cli/deploy_local.py).
PACKAGE_DATA = (
    "fedmeta/deploy/tls/make-certs.sh",
    "fedmeta/deploy/tls/register-nodes.sh",
    "fedmeta/deploy/proxy/fleet-only.conf.template",
    "fedmeta/py.typed",
    "fedmeta/metalearning/public_items/omniglot.bin",  # the public release's digests (issue 39)
)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}: {res.returncode}\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(the wheel, the clean venv, the environment to run it in)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: a build writes build/ and *.egg-info beside the sources
    shutil.copytree(REPO, source, ignore=NOT_SOURCES, symlinks=True)
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(wheels), str(source)], cwd=root, env=dict(os.environ))  # fmt: skip
    (wheel,) = wheels.glob("fedmeta-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root, env=dict(os.environ))
    python = venv / "bin" / "python"
    # Installed before the .pth line exists, so pip sees no other fedmeta (the editable one).
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=root, env=dict(os.environ))  # fmt: skip
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=root, env={}).strip())  # fmt: skip
    (site / "test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env |= {"PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "FEDMETA_STATE_DIR": str(root / "state"),
            "FEDMETA_LEDGER_REGISTRY": str(root / "registry" / "ledgers.json"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    (root / "elsewhere").mkdir()
    return wheel, venv, env


def test_the_wheel_installs_only_fedmeta_with_its_package_data(installed: tuple) -> None:
    wheel, venv, _ = installed
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    info = next(n for n in names if n.endswith(".dist-info/RECORD"))
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"fedmeta", info.split("/", 1)[0]}, tops
    # A namespace package: an __init__.py would hide the other source roots in a checkout.
    assert "fedmeta/__init__.py" not in names
    assert {"fedmeta/config.py", "fedmeta/server/round.py", "fedmeta/cli/__init__.py"} <= set(names)
    for data in PACKAGE_DATA:
        assert data in names, data
    (record,) = venv.glob("lib/python*/site-packages/fedmeta-*.dist-info/RECORD")
    installed_tops = {line.split("/", 1)[0] for line in record.read_text().splitlines()}
    assert {t for t in installed_tops if not t.startswith("..")} == tops, installed_tops


def test_the_installed_commands_run_outside_the_checkout(installed: tuple, tmp_path: Path) -> None:
    _, venv, env = installed
    python, fedmeta, cwd = str(venv / "bin" / "python"), str(venv / "bin" / "fedmeta"), tmp_path
    where = json.loads(_run([python, "-c", (
        "import json, fedmeta.config as c, fedmeta.server.round as r\n"
        "from fedmeta.cli.deploy_local import MAKE_CERTS, PROXY_TEMPLATE, deploy_file\n"
        "files = [deploy_file(MAKE_CERTS), deploy_file(PROXY_TEMPLATE)]\n"
        "print(json.dumps([c.__file__, r.__file__, *map(str, files), "
        "all(f.is_file() for f in files)]))")], cwd, env))  # fmt: skip
    assert where.pop() is True, where
    for path in where:  # the wheel's files, nothing of the checkout
        assert Path(path).is_relative_to(venv) and not Path(path).is_relative_to(REPO), where
    assert "simulate" in _run([fedmeta, "--help"], cwd, env)
    assert "--participants" in _run([fedmeta, "deploy", "local", "--help"], cwd, env)
    assert "--runtime-api-address" in _run([python, "-m", "fedmeta.client.worker", "--help"],
                                           cwd, env)  # fmt: skip
    out = tmp_path / "run"
    sets = ["federation.backend=inprocess", "rounds=3", "federation.participants=6",
            "sampling.participants_per_round=3", "sampling.task_rate=0.3",
            "dataset.tasks_per_participant=20", "dataset.validation_tasks=16",
            "dataset.test_tasks=32", "dataset.probe_tasks=0", "output.plots=false"]  # fmt: skip
    _run([fedmeta, "simulate", "--out", str(out), *(a for s in sets for a in ("--set", s))],
         cwd, env, timeout=600)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 3 and summary["stopped_reason"] == "planned_rounds"
    assert Path(summary["ledger"]["path"]).is_relative_to(Path(env["FEDMETA_STATE_DIR"]))


def test_the_checkouts_fab_runs_the_installed_fedmeta(installed: tuple, tmp_path: Path) -> None:
    """`flwr run .` from a checkout against a deployment (docs/deploy.md, compose): the FAB holds
    no code (`fab-include`), so where fedmeta is installed from the wheel, Flower's loader (which
    puts the unpacked FAB first on sys.path) finds the installed apps. A FAB with the checkout's
    ``fedmeta/`` folder shadows the installed package: ``No module named 'fedmeta.server'``."""
    _, venv, env = installed
    python = str(venv / "bin" / "python")
    flwr = Path(sys.executable).parent / "flwr"
    if not flwr.is_file():
        pytest.skip("the flwr CLI is not beside this interpreter")
    _run([str(flwr), "build", "--app", str(REPO)], tmp_path, env)
    (fab,) = tmp_path.glob("*.fab")
    with zipfile.ZipFile(fab) as zf:
        names = zf.namelist()
        assert not [n for n in names if n.endswith(".py")], names
        zf.extractall(tmp_path / "app")
    loaded = _run([python, "-c", (
        "import sys\n"
        "from flwr.supercore.object_ref import load_app\n"
        "for ref in ('fedmeta.server.app:app', 'fedmeta.client.app:app'):\n"
        "    load_app(ref, RuntimeError, sys.argv[1])\n"
        "import fedmeta.config\nprint(fedmeta.config.__file__)"), str(tmp_path / "app")],
        tmp_path, env)
    assert Path(loaded.strip()).is_relative_to(venv), loaded


def test_the_wheel_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    """``pip wheel`` of the sources prints no build-backend warning and no deprecation (issue 40).

    Verbose, so that pip shows what the build backend printed; offline, with the installed
    hatchling (``--no-build-isolation``), as CI's install is.
    """
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES, symlinks=True)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "wheels"), str(source)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    printed = res.stdout + res.stderr
    assert res.returncode == 0, printed[-3000:]
    assert list((tmp_path / "wheels").glob("fedmeta-*.whl")), printed[-3000:]
    assert "BuildBackendWarning" not in printed, printed[-3000:]
    assert not [line for line in printed.splitlines() if "deprecat" in line.lower()], printed
