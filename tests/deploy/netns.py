"""Multi-host networks on one machine: Linux network namespaces joined by a bridge.

One *server* host and N *participant* hosts, each a network namespace with one veth link to a
bridge that itself lives in a separate *switch* namespace, so that no address, link or route is
added to the machine's own namespace: every address (``10.200.X.0/24`` by default) exists only
inside the namespaces this module creates. Optional ``tc tbf`` shaping on one participant's link
(both directions: its egress, and the switch side's egress towards it). The kernel here has no
``netem``; ``tbf`` shapes bandwidth only.

Processes run inside a host with :meth:`Host.popen` / :meth:`Host.run` (``nsenter --net=``,
which, unlike ``ip netns exec``, does not remount /sys). :meth:`Network.close` (also on ``with``
exit and at interpreter exit) ends every process this module started, by its process group id,
then deletes the namespaces: teardown always runs.

Usage::

    reason = netns_unavailable()          # None, or why this machine cannot do it
    with Network(participants=3, shaped={2: "8mbit"}) as net:
        net.server.popen(["flower-superlink", ...])
        net.participants[0].run(["python3", "-c", "..."])

Runs as root only (creating namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedmeta.cli.process_tree import end_pinned, pin

_LIVE: weakref.WeakSet[Network] = weakref.WeakSet()
#: Every namespace this process created, closed or not (``namespaces_left``).
_MADE_EVER: set[str] = set()


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can (probed, not guessed)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian: apt-get install iproute2 util-linux)"
    probe = f"fmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def tc_unavailable() -> str | None:
    """Why ``tc ... tbf`` shaping cannot be used here, or None."""
    if shutil.which("tc") is None:
        return "`tc` not found (Debian: apt-get install iproute2)"
    return None


def nginx_unavailable() -> str | None:
    """Why nginx cannot serve the Fleet-only proxy here, or None (probed by running it).

    Absent, or present but unable to run (``nginx -V`` fails) or built without TLS: only then may
    a test that needs the proxy skip. Anything else (a configuration it refuses, a port it cannot
    bind) is a failure of the test, reported by ``LocalFederation`` with nginx's own error.
    """
    nginx = shutil.which("nginx")
    if nginx is None:
        return "nginx not installed (Debian: apt-get install nginx-light)"
    try:
        res = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=30)
    except OSError as error:
        return f"nginx at {nginx} cannot run: {error}"
    if res.returncode != 0:
        return f"`{nginx} -V` exited {res.returncode}: {res.stderr.strip()[-300:]}"
    if "http_ssl_module" not in res.stderr + res.stdout:
        return f"{nginx} is built without http_ssl_module (Debian's nginx-light has it)"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")


@dataclass
class Host:
    """One network namespace with one address on the bridge."""

    name: str  # role: "server", "p0", "p1", ...
    netns: str  # the namespace's name under /run/netns
    address: str  # its IPv4 address on the bridge
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def nsenter(self) -> list[str]:
        """The command prefix that runs a program in this host's network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--"]

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in this host, in its own process group (ended by Network.close)."""
        kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen([*self.nsenter, *cmd], **kwargs)
        self.procs.append(proc)
        return proc

    def run(
        self, cmd: Sequence[str], *, timeout: float = 60, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in this host to completion (with a timeout) and return its result."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        res: subprocess.CompletedProcess[str] = subprocess.run(
            [*self.nsenter, *cmd], timeout=timeout, check=False, **kwargs
        )
        if check and res.returncode != 0:
            raise RuntimeError(
                f"{self.name}: {' '.join(cmd)} exited {res.returncode}: {res.stdout}{res.stderr}"
            )
        return res

    def kill(self, proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``proc``'s process group (the process and what it started)."""
        _signal_group(proc, sig)


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the pid
    except ProcessLookupError:
        pass


class Network:
    """A bridge in its own namespace, a server host and ``participants`` participant hosts.

    ``shaped`` maps a participant index to a ``tc tbf`` rate (e.g. ``"8mbit"``) applied in both
    directions of its link. ``subnet`` is the first three octets; the server is ``.1``, participant
    ``i`` is ``.(10 + i)``.
    """

    def __init__(
        self,
        participants: int,
        *,
        subnet: str = "10.200.0",
        shaped: Mapping[int, str] | None = None,
        prefix: str | None = None,
    ) -> None:
        if participants < 1 or participants > 200:
            raise ValueError(f"participants must be in [1, 200]; got {participants}")
        self.prefix = prefix or f"fm{uuid.uuid4().hex[:6]}"
        self.subnet = subnet
        self.switch = f"{self.prefix}-sw"
        self.server = Host("server", f"{self.prefix}-srv", f"{subnet}.1")
        self.participants = [
            Host(f"p{i}", f"{self.prefix}-p{i}", f"{subnet}.{10 + i}") for i in range(participants)
        ]
        self.shaped = dict(shaped or {})
        self._made: list[str] = []
        self._closed = False
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> list[Host]:
        """The server first, then the participants."""
        return [self.server, *self.participants]

    def _build(self) -> None:
        for ns in (self.switch, *(h.netns for h in self.hosts)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _MADE_EVER.add(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for idx, host in enumerate(self.hosts):
            # Make the pair in the switch namespace (names are per namespace), then move one end.
            _ip("link", "add", f"v{idx}", "type", "veth", "peer", "name", "eth0", ns=self.switch)
            _ip("link", "set", "eth0", "netns", host.netns, ns=self.switch)
            _ip("link", "set", f"v{idx}", "master", "br0", ns=self.switch)
            _ip("link", "set", f"v{idx}", "up", ns=self.switch)
            _ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.netns)
            _ip("link", "set", "eth0", "up", ns=host.netns)
        for index, rate in self.shaped.items():
            self.shape(index, rate)

    def shape(
        self, index: int, rate: str, *, burst: str = "32kbit", latency: str = "400ms"
    ) -> None:
        """Limit participant ``index``'s link to ``rate`` in both directions with ``tc tbf``."""
        host = self.participants[index]
        switch_side = f"v{1 + index}"
        for ns, dev in ((host.netns, "eth0"), (self.switch, switch_side)):
            args = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate]
            res = subprocess.run(
                ["ip", "netns", "exec", ns, *args, "burst", burst, "latency", latency],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if res.returncode != 0:
                raise RuntimeError(f"tc tbf on {ns}/{dev} failed: {res.stderr.strip()}")
        self.shaped[index] = rate

    def close(self) -> None:
        """End every process started in the hosts (SIGTERM, then SIGKILL), delete the namespaces."""
        if self._closed:
            return
        self._closed = True
        procs = [p for h in self.hosts for p in h.procs]
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        _end_stragglers(self._made)
        for ns in reversed(self._made):
            # Deleting a namespace destroys its veth ends (and so their peers) and its bridge.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def namespaces_left() -> list[str]:
    """The namespaces this process created that still exist (none, once every Network closed)."""
    if not _MADE_EVER:
        return []
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    existing = {line.split()[0] for line in res.stdout.splitlines() if line.strip()}
    return sorted(existing & _MADE_EVER)


def _namespace_pids(namespaces: Sequence[str]) -> list[int]:
    pids: list[int] = []
    for ns in namespaces:
        cmd = ["ip", "netns", "pids", ns]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        pids += [int(x) for x in res.stdout.split() if x.isdigit()]
    return pids


def _end_stragglers(namespaces: Sequence[str]) -> None:
    """End what still runs inside the namespaces this network made, after their process groups.

    A program started here can start another in a session of its own (the SuperLink starts its
    ServerApp executor so), which the process-group signal misses; every process in these
    namespaces descends from one this test started, as nothing else enters them. Each is pinned
    (a pidfd) before its namespace is checked, so a pid reused meanwhile is never signalled.
    """
    inodes = {os.stat(f"/run/netns/{ns}").st_ino for ns in namespaces}
    for _ in range(3):  # what ends may have started more
        pinned = pin(_namespace_pids(namespaces))
        if not pinned:
            return
        inside = []
        for pid, fd in pinned.items():
            with contextlib.suppress(FileNotFoundError):  # ended since it was listed
                if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                    inside.append(fd)
        for fd in set(pinned.values()) - set(inside):
            os.close(fd)
        end_pinned(inside, grace_s=5.0)


@atexit.register
def _close_all() -> None:
    for net in list(_LIVE):
        net.close()
