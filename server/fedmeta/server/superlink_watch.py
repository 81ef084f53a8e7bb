"""Notice a SuperLink that restarted, forgot this run or stopped answering, and end the run.

Flower 1.41's ServerApp retries every Runtime API call without limit and keeps its task alive
across a SuperLink restart (the task and its token are in the SuperLink's ``--database``). Where
the ServerApp outlives its SuperLink (compose's ``serverapp`` container, ``flower-superexec`` as
its own process or systemd unit), a restarted SuperLink left the run listed as ``running`` with
nothing spent for minutes (issue 41): the round in flight and the SuperNodes' sessions did not
survive the restart, and nothing bounded the wait.

:class:`SuperLinkWatch` probes the SuperLink every second with the ServerApp's own task
heartbeat, sent once, without Flower's retries, and :func:`judge` reads the answers:

* *restarted*: the SuperLink refused connections (nothing was listening, or nothing accepted a
  connection within ``CONNECT_S``, or it dropped one without answering) and answers again;
* *forgot the run*: it answers that it holds no such task (the heartbeat is refused, or HTTP
  401/403/404: restarted without its database, or the run was stopped);
* *gone*: no answer at all for ``federation.superlink_timeout_s``.

Then it sets the run's stop event, the same one SIGTERM sets in ``fedmeta simulate``: a round not
yet spent is abandoned, one already spent is finished, a final checkpoint and ``summary.json``
are written (``stopped: interrupted``), and :func:`watching` raises :class:`SuperLinkLost`, so
that Flower records the run as ``finished:failed`` with the reason and ``fedmeta deploy run`` exits
1 with the command that resumes it. Nothing is spent twice: a resume continues one past the
ledger's last spend (server/fedmeta/server/run.py). Should the run be unable to end (its
SuperLink silent for the same bound again, or a Flower call that has not returned after
``max(600 s, 10 x bound)``), the watch raises SIGINT, Flower's own exit path, which pushes the
task's failure to the SuperLink.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("fedmeta.server")

OK = "ok"
REFUSED = "refused"  # nothing listening or accepting, or its name does not resolve: it is down
NO_ANSWER = "no_answer"  # connected, but no answer in time (or a 5xx): busy, or going away
FORGOTTEN = "forgotten"  # it answers, but holds no such task


#: Seconds a probe waits for the TCP connection (the rest of the answer: its own bound).
CONNECT_S = 2.0


class SuperLinkLost(RuntimeError):
    """The run was ended because its SuperLink restarted, forgot the run or stopped answering."""


class StopRequest(threading.Event):
    """The run's stop event, with why when the SuperLink's side set it (``reason``).

    Besides the watch, the round's exchange sets it when Flower's grid fails to move the round's
    messages (a restarted SuperLink no longer holds the push session: ``ObjectPushError``), which
    can come before any probe has seen the restart (server/fedmeta/server/transport.py).
    """

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    def lost(self, reason: str) -> None:
        """Stop the run because the SuperLink was lost (the first reason is kept)."""
        if self.reason is None:
            self.reason = reason
        self.set()


@dataclass(frozen=True)
class Probe:
    """One probe's result: its kind (OK, REFUSED, NO_ANSWER, FORGOTTEN) and what was seen."""

    kind: str
    detail: str = ""


@dataclass(frozen=True)
class Outage:
    """Since when (monotonic seconds) the SuperLink has not answered; whether it refused."""

    since: float
    refused: bool


def judge(
    outage: Outage | None, probe: Probe, now: float, timeout_s: float
) -> tuple[Outage | None, str | None]:
    """The outage after ``probe``, and why the run must end (None: it goes on)."""
    if probe.kind == FORGOTTEN:
        return outage, f"the SuperLink no longer knows this run ({probe.detail})"
    if probe.kind == OK:
        if outage is not None and outage.refused:
            down = now - outage.since
            return None, (f"the SuperLink restarted (it refused connections for {down:.0f} s "
                          "and answers again); the round in flight did not survive it")  # fmt: skip
        return None, None
    if outage is None:
        outage = Outage(now, probe.kind == REFUSED)
    elif probe.kind == REFUSED and not outage.refused:
        outage = Outage(outage.since, True)
    if now - outage.since >= timeout_s:
        return outage, (f"the SuperLink has not answered for {now - outage.since:.0f} s "
                        f"(federation.superlink_timeout_s = {timeout_s:g}; last: "
                        f"{probe.detail})")  # fmt: skip
    return outage, None


class SuperLinkWatch:
    """A daemon thread that probes the SuperLink and sets ``stop`` when :func:`judge` says so."""

    def __init__(
        self, probe: Callable[[], Probe], timeout_s: float, stop: threading.Event,
        *, every_s: float | None = None, on_stuck: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        """``on_stuck``: called when the run cannot end by itself after ``stop`` (see _end)."""
        self.probe, self.timeout_s, self.stop = probe, timeout_s, stop
        # Every second: a restarted SuperLink is closed for seconds at least (its imports).
        self.every_s = every_s if every_s is not None else min(1.0, timeout_s / 4)
        self.on_stuck = on_stuck or (lambda: signal.raise_signal(signal.SIGINT))
        self.stuck_after_s = max(600.0, 10 * timeout_s)
        self.reason: str | None = None
        self.noticed_after_s: float | None = None  # from the first failed probe
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="superlink-watch", daemon=True)

    def start(self) -> None:
        """Start probing."""
        self._thread.start()

    def close(self) -> None:
        """The run has ended: stop probing."""
        self._done.set()
        self._thread.join(timeout=self.timeout_s + 30)

    def _loop(self) -> None:
        outage: Outage | None = None
        while not self._done.wait(self.every_s):
            seen = self.probe()
            now = time.monotonic()
            since = outage.since if outage else now
            before = outage
            outage, reason = judge(outage, seen, now, self.timeout_s)
            if (before is None) != (outage is None):  # an outage began or ended: operator's log
                log.info("SuperLink probe: %s %s", seen.kind, seen.detail)
            if reason is not None:
                self._end(reason, now - since)
                return

    def _end(self, reason: str, noticed_after_s: float) -> None:
        """Stop the run; leave through Flower's exit path only if it cannot end by itself.

        It can while the SuperLink answers (the run's calls return; its last checkpoint and
        evaluation may take a while): only a SuperLink silent for ``timeout_s`` more, or a run
        not ended after ``stuck_after_s``, calls ``on_stuck``.
        """
        self.reason, self.noticed_after_s = reason, noticed_after_s
        log.warning("ending the run: %s", reason)
        self.stop.set()
        deadline = time.monotonic() + self.stuck_after_s
        silent_since: float | None = None
        while not self._done.wait(self.every_s):
            answered = self.probe().kind in (OK, FORGOTTEN)
            now = time.monotonic()
            silent_since = None if answered else (silent_since or now)
            if now >= deadline or (silent_since and now - silent_since >= self.timeout_s):
                log.warning("the run has not ended: leaving through Flower's exit path (SIGINT)")
                self.on_stuck()
                return


def heartbeat_probe(grid: Any, timeout_s: float) -> Callable[[], Probe] | None:
    """A probe sending the ServerApp's task heartbeat once; None off Flower's Runtime API grid.

    No probe for the simulation's or the in-process grid. Built as Flower's ``HttpGrid`` builds
    its own client (address, TLS, token), without its retry invoker: one request, answered or
    not within ``timeout_s``.
    """
    from flwr.superlink.grid import HttpGrid

    if not isinstance(grid, HttpGrid):
        return None
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.runtime import RuntimeHttpClient

    client = RuntimeHttpClient.from_server_address(
        server_address=grid._addr, insecure=grid._insecure, root_certificates=grid._cert,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-serverapp"),
                      RuntimeTokenHttpInterceptor(token=grid._token)],
        retry_invoker=None,
    )  # fmt: skip
    # A connection is given CONNECT_S at most: a SuperLink host or container that is gone
    # (restarting under podman, its address unanswered) shows as a connect timeout, and a short
    # one leaves time for the probes after it to see the restart's refusals.
    client._client.timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_S))
    # A new connection for every probe: a connection closed without an answer then means that the
    # process that accepted it went away (a restart), never that a kept-alive one had gone stale.
    client._client.headers["Connection"] = "close"

    def probe() -> Probe:
        return _answer_of(lambda: client.SendTaskHeartbeat(SendTaskHeartbeatRequest()))

    return probe


def _answer_of(send: Callable[[], Any]) -> Probe:
    """What one heartbeat ``send()`` says of the SuperLink (httpx's errors read as probe kinds)."""
    import httpx

    try:
        res = send()
    except httpx.ConnectTimeout as error:
        # No TCP handshake at all: nothing is there to accept the connection, which a busy
        # SuperLink's kernel still does (that is a read timeout, NO_ANSWER). A restart under
        # podman showed only these, so that it went unnoticed (issue 41).
        return Probe(REFUSED, f"no connection within {CONNECT_S:g} s ({_one_line(error)})")
    except httpx.ConnectError as error:
        return Probe(REFUSED, _one_line(error))
    except (httpx.RemoteProtocolError, httpx.ReadError) as error:
        # Accepted, then closed or reset with no answer: the SuperLink went down under this
        # probe. A restart whose whole downtime fell inside one such probe was otherwise seen
        # as a slow answer followed by answers, and went unnoticed under compose (the run
        # stalled for minutes, then went on).
        return Probe(REFUSED, f"the connection was dropped without an answer "
                              f"({_one_line(error) or type(error).__name__})")  # fmt: skip
    except httpx.TransportError as error:
        return Probe(NO_ANSWER, _one_line(error) or type(error).__name__)
    except httpx.HTTPStatusError as error:
        code = error.response.status_code
        kind = NO_ANSWER if code >= 500 else FORGOTTEN
        return Probe(kind, f"HTTP {code} to the task's heartbeat")
    except ValueError as error:  # an answer that is not the Runtime API's (a proxy's page)
        return Probe(NO_ANSWER, _one_line(error))
    if not res.success:
        return Probe(FORGOTTEN, "it refused the task's heartbeat: the task is not active")
    return Probe(OK)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


@contextlib.contextmanager
def watching(grid: Any, timeout_s: float) -> Iterator[threading.Event | None]:
    """The run's stop event, set when the SuperLink is lost (None outside a deployment).

    Raises :class:`SuperLinkLost` after a run that it ended.
    """
    probe = heartbeat_probe(grid, timeout_s=max(1.0, min(10.0, timeout_s / 3)))
    if probe is None:
        yield None
        return
    stop = StopRequest()
    watch = SuperLinkWatch(probe, timeout_s, stop)
    watch.start()
    try:
        yield stop
    finally:
        watch.close()
    reason = watch.reason or stop.reason
    if reason is not None:
        raise SuperLinkLost(reason)
