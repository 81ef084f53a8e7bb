"""deploy/tls/make-certs.sh and register-nodes.sh make what Flower 1.41 accepts: a SuperLink serves
TLS with the server certificate, a SuperNode with a registered key joins, one with an unregistered
key is refused. Loopback only (no namespaces needed); every process is ended by its pid."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmeta.cli.deploy_local import free_port

pytestmark = [pytest.mark.deploy, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MAKE_CERTS = ROOT / "deploy" / "tls" / "make-certs.sh"
REGISTER = ROOT / "deploy" / "tls" / "register-nodes.sh"


def _need(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` not found (Debian: apt-get install openssl openssh-client)")
    for exe in ("flower-superlink", "flower-supernode", "flwr"):
        if not (BIN / exe).is_file():
            pytest.skip(f"{exe} not beside {sys.executable}")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _make(out: Path, *args: str) -> str:
    res = subprocess.run(
        ["bash", str(MAKE_CERTS), "--out", str(out), *args],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return res.stdout


def test_group_read_makes_the_private_keys_readable_by_one_named_group_and_is_undone(
    tmp_path: Path,
) -> None:
    """Flower's images (uid 49999) and fedmeta's (10001) read the same keys: --owner UID:GID
    --group-read gives them mode 640; a run without it makes them 600 again; without a group it
    refuses in one line."""
    import os
    import stat

    _need("openssl", "ssh-keygen", "bash")
    out = tmp_path / "certs"
    keys = [out / "server.key", out / "superexec.secret", out / "nodes" / "participant-0.key"]
    owner = f"{os.getuid()}:{os.getgid()}"  # chown to oneself needs no root
    _make(out, "--nodes", "1", "--owner", owner, "--group-read")
    assert [stat.S_IMODE(k.stat().st_mode) for k in keys] == [0o640] * 3
    assert stat.S_IMODE((out / "ca.key").stat().st_mode) == 0o600  # the CA's key: never
    _make(out, "--nodes", "1", "--owner", owner)
    assert [stat.S_IMODE(k.stat().st_mode) for k in keys] == [0o600] * 3
    refused = subprocess.run(["bash", str(MAKE_CERTS), "--out", str(out), "--group-read"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2 and "--owner UID:GID" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_make_certs_is_idempotent_and_reissues_on_new_sans(tmp_path: Path) -> None:
    _need("openssl", "ssh-keygen", "bash")
    out = tmp_path / "certs"
    first = _make(out, "--nodes", "2")
    assert "made CA" in first and "made node key pair" in first
    for name in ("ca.crt", "ca.key", "server.crt", "server.key"):
        assert (out / name).is_file(), name
    for i in range(2):
        assert (out / "nodes" / f"participant-{i}.key").is_file()
        assert (
            (out / "nodes" / f"participant-{i}.key.pub")
            .read_text()
            .startswith("ecdsa-sha2-nistp384 ")
        )
    # Private keys are not world-readable.
    assert (out / "ca.key").stat().st_mode & 0o077 == 0
    assert (out / "nodes" / "participant-0.key").stat().st_mode & 0o077 == 0
    before = {p.name: _digest(p) for p in out.rglob("*") if p.is_file()}
    second = _make(out, "--nodes", "2")
    assert "made" not in second
    assert {p.name: _digest(p) for p in out.rglob("*") if p.is_file()} == before
    # A new SAN re-issues the server certificate with the same CA and keys.
    _make(out, "--nodes", "2", "--san", "fl.example.org", "--san", "10.200.0.1")
    assert _digest(out / "server.crt") != before["server.crt"]
    for name in ("ca.crt", "ca.key", "server.key", "participant-0.key"):
        assert _digest(next(out.rglob(name))) == before[name], name
    text = subprocess.run(
        ["openssl", "x509", "-in", str(out / "server.crt"), "-noout", "-ext", "subjectAltName"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    for san in ("DNS:superlink", "DNS:localhost", "IP Address:127.0.0.1", "DNS:fl.example.org",
                "IP Address:10.200.0.1"):  # fmt: skip
        assert san in text, san
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / "server.crt")],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip


class _Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


@pytest.fixture
def procs() -> Iterator[_Procs]:
    p = _Procs()
    try:
        yield p
    finally:
        p.close()


def _wait(pred: object, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_flower_accepts_certificates_and_registered_keys(tmp_path: Path, procs: _Procs) -> None:
    _need("openssl", "ssh-keygen", "bash")
    certs = tmp_path / "certs"
    _make(certs, "--nodes", "2")
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}:{os.environ.get('PATH', '')}",
               FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")  # fmt: skip
    procs.start(
        [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
         "--ssl-certfile", str(certs / "server.crt"), "--ssl-keyfile", str(certs / "server.key"),
         "--enable-supernode-auth", "--disable-runtime-dependency-installation",
         "--host", "127.0.0.1", "--port", str(port)],
        env, tmp_path / "superlink.log",
    )  # fmt: skip
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))  # verifies the name localhost

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(
                f"https://localhost:{port}/health", timeout=3, context=ctx
            ) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    _wait(healthy, 120, "the SuperLink's /health over TLS")

    reg = subprocess.run(
        ["bash", str(REGISTER), "--address", f"127.0.0.1:{port}", "--ca", str(certs / "ca.crt"),
         str(certs / "nodes" / "participant-0.key.pub")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reg.returncode == 0 and "registered participant-0" in reg.stdout, reg.stdout + reg.stderr
    again = subprocess.run(
        ["bash", str(REGISTER), "--address", f"127.0.0.1:{port}", "--ca", str(certs / "ca.crt"),
         str(certs / "nodes" / "participant-0.key.pub")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and "already" in again.stdout, again.stdout + again.stderr

    def node(i: int) -> subprocess.Popen[str]:
        return procs.start(
            [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{port}",
             "--root-certificates", str(certs / "ca.crt"),
             "--auth-supernode-private-key", str(certs / "nodes" / f"participant-{i}.key"),
             "--port", str(free_port()), "--node-config", f"participant-id={i}"],
            env, tmp_path / f"supernode{i}.log",
        )  # fmt: skip

    registered = node(0)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "t"\n\n[superlink.t]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{certs / "ca.crt"}"\n'
    )

    def online() -> bool:
        res = subprocess.run([str(BIN / "flwr"), "supernode", "list", "t", "--format", "json"],
                             env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        if res.returncode != 0:
            return False
        return any(n.get("status") == "online" for n in json.loads(res.stdout).get("nodes", []))

    # The SuperLink logs the activation (a file read every 0.5 s); only then is it asked
    # through `flwr`, a process of about 1.5 s of CPU, whether it lists the node online.
    activated = '"POST /v1/fleet/activate-node HTTP/1.1" 200'
    _wait(lambda: activated in (tmp_path / "superlink.log").read_text(), 120,
          "the SuperLink to log the registered SuperNode's activation")  # fmt: skip
    _wait(online, 120, "the registered SuperNode to be online")
    assert registered.poll() is None

    unregistered = node(1)
    code = unregistered.wait(timeout=120)
    log = (tmp_path / "supernode1.log").read_text()
    assert code != 0 and "2004" in log, log[-2000:]
