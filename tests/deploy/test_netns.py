"""The network-namespace harness itself: hosts reach each other only inside the namespaces, the
shaped link is shaped, and teardown removes namespaces and processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.deploy.netns import Network
from tests.deploy.procs import running

pytestmark = [pytest.mark.deploy, pytest.mark.integration]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_hosts_reach_each_other_only_inside(network3: Network) -> None:
    net = network3
    # A TCP listener on the server host; every participant connects to it (no ping on this machine).
    listener = net.server.popen(
        [sys.executable, "-c", "import socket, time\n"
         "s = socket.create_server(('0.0.0.0', 7000))\n"
         "while True:\n    c, _ = s.accept(); c.sendall(b'ok'); c.close()"]
    )  # fmt: skip
    probe = (
        "import socket, sys, time\n"
        "end = time.monotonic() + 10\n"
        "while True:\n"
        "    try:\n"
        f"        c = socket.create_connection(('{net.server.address}', 7000), 2)\n"
        "        print(c.recv(2).decode())\n"
        "        break\n"
        "    except OSError:\n"
        "        if time.monotonic() > end: raise\n"
        "        time.sleep(0.1)"
    )
    for host in net.participants:
        assert host.run([sys.executable, "-c", probe], timeout=30).stdout.strip() == "ok"
    assert listener.poll() is None
    # Nothing of the network exists in the machine's own namespace: no address, no route, no link.
    # (A connection attempt from there is no test: a sandbox may intercept any outgoing TCP.)
    for what in (["addr"], ["route"], ["link"]):
        own = subprocess.run(["ip", "-o", *what], capture_output=True, text=True, check=True).stdout
        assert net.subnet + "." not in own and net.prefix not in own, what
    # The shaped participant has a tbf qdisc on its link; the others do not.
    shaped = net.participants[2].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    plain = net.participants[0].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in shaped and "rate 8Mbit" in shaped
    assert "tbf" not in plain


def test_teardown_ends_processes_and_namespaces(netns_ok: None) -> None:
    net = Network(participants=2)
    names = {h.netns for h in net.hosts} | {net.switch}
    assert names <= _namespaces()
    proc = net.participants[1].popen(["sleep", "300"])
    time.sleep(0.2)
    net.close()
    assert proc.poll() is not None
    assert not (names & _namespaces())


def test_teardown_ends_a_process_that_left_its_group(netns_ok: None, tmp_path: Path) -> None:
    """A grandchild in a session of its own (as the SuperLink starts its ServerApp) is ended too."""
    net = Network(participants=1)
    pidfile = tmp_path / "escaped.pid"
    # setsid: the grandchild leaves the process group that close() signals first.
    net.server.popen(["sh", "-c", f"setsid sleep 300 & echo $! > {pidfile}; wait"])
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    escaped, group = int(pidfile.read_text()), os.getpgid(net.server.procs[0].pid)
    while os.getpgid(escaped) == group and time.monotonic() < deadline:  # setsid() is under way
        time.sleep(0.05)
    assert os.getpgid(escaped) != group
    net.close()
    deadline = time.monotonic() + 10
    while running(escaped) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(escaped), "a process in a deleted namespace outlived close()"
