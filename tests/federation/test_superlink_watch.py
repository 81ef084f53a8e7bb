"""The ServerApp's watch on its SuperLink (server/fedmeta/server/superlink_watch.py, issue 41).

:func:`judge` as a table of probe sequences; the watch thread setting the run's stop event and
taking Flower's exit path when the run does not end; the probe itself, Flower's own Runtime API
client built from a real ``HttpGrid``, against a closed port and a small HTTP server that answers
as a SuperLink would (the task's heartbeat accepted, refused, or HTTP 401).
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from fedmeta.server import superlink_watch as sw
from fedmeta.server.superlink_watch import FORGOTTEN, NO_ANSWER, OK, REFUSED, Probe, judge

pytestmark = pytest.mark.unit


def _run(kinds: list[str], timeout_s: float = 30.0, every_s: float = 1.0) -> tuple[int, str] | None:
    """Feed probes of ``kinds`` one ``every_s`` apart; (index, reason) of the first verdict."""
    outage = None
    for i, kind in enumerate(kinds):
        outage, reason = judge(outage, Probe(kind, "seen"), i * every_s, timeout_s)
        if reason is not None:
            return i, reason
    return None


def test_a_superlink_that_answers_is_left_alone() -> None:
    assert _run([OK] * 100) is None


def test_a_restart_ends_the_run_at_the_first_answer_after_refusals() -> None:
    found = _run([OK, OK, REFUSED, REFUSED, REFUSED, OK, OK])
    assert found is not None
    index, reason = found
    assert index == 5 and "restarted" in reason and "for 3 s" in reason


def test_a_slow_answer_is_not_a_restart() -> None:
    # Timeouts (busy, not down) followed by an answer: the run goes on.
    assert _run([OK, NO_ANSWER, NO_ANSWER, OK, OK]) is None
    # A refusal inside a slow spell still marks it as a restart.
    found = _run([NO_ANSWER, REFUSED, NO_ANSWER, OK])
    assert found is not None and found[0] == 3 and "restarted" in found[1]


def test_a_forgotten_run_ends_at_once() -> None:
    found = _run([OK, FORGOTTEN])
    assert found is not None and found[0] == 1 and "no longer knows this run" in found[1]


@pytest.mark.parametrize("kind", [REFUSED, NO_ANSWER])
def test_no_answer_for_the_bound_ends_the_run(kind: str) -> None:
    found = _run([OK, *[kind] * 20], timeout_s=10.0)
    assert found is not None
    index, reason = found
    assert index == 11 and "has not answered for 10 s" in reason  # 10 s after the first failure


def test_the_watch_leaves_through_flower_when_the_superlink_is_silent_again() -> None:
    # Restarted, then gone again while the run cannot finish its calls: Flower's exit path.
    probes = iter([Probe(OK), Probe(REFUSED), Probe(OK)])
    stop, stuck = threading.Event(), threading.Event()
    watch = sw.SuperLinkWatch(lambda: next(probes, Probe(REFUSED)), timeout_s=0.4, stop=stop,
                              every_s=0.01, on_stuck=stuck.set)  # fmt: skip
    watch.start()
    assert stop.wait(5) and "restarted" in (watch.reason or "")
    assert stuck.wait(5)
    watch.close()


def test_a_run_finishing_slowly_beside_an_answering_superlink_is_left_to_end() -> None:
    probes = iter([Probe(OK), Probe(REFUSED), Probe(OK)])
    stop, stuck = threading.Event(), threading.Event()
    watch = sw.SuperLinkWatch(lambda: next(probes, Probe(OK)), timeout_s=0.2, stop=stop,
                              every_s=0.01, on_stuck=stuck.set)  # fmt: skip
    watch.stuck_after_s = 1.0
    watch.start()
    assert stop.wait(5)
    assert not stuck.wait(0.6)  # its last checkpoint and evaluation may take longer than 0.2 s
    assert stuck.wait(5)  # but not for ever (stuck_after_s)
    watch.close()


def test_a_run_that_ends_in_time_is_not_signalled() -> None:
    stop, stuck = threading.Event(), threading.Event()
    watch = sw.SuperLinkWatch(lambda: Probe(FORGOTTEN, "x"), timeout_s=30, stop=stop,
                              every_s=0.01, on_stuck=stuck.set)  # fmt: skip
    watch.start()
    assert stop.wait(5)
    watch.close()  # the run ended: the watch returns without signalling
    assert not stuck.is_set()


# ------------------------------------------------------------------------------ the probe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _grid(port: int) -> object:
    from flwr.superlink.grid import HttpGrid

    return HttpGrid(runtime_api_address=f"127.0.0.1:{port}", insecure=True, token="t0ken")


def _probe(port: int, timeout_s: float = 5) -> Callable[[], Probe]:
    """The heartbeat probe of an ``HttpGrid`` whose SuperLink is at loopback ``port``."""
    probe = sw.heartbeat_probe(_grid(port), timeout_s=timeout_s)
    assert probe is not None
    return probe


@pytest.fixture
def superlink() -> Iterator[tuple[int, dict[str, object]]]:
    """An HTTP server answering the heartbeat path as told by the yielded dict."""
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse

    answer: dict[str, object] = {"status": 200, "success": True, "seen": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen = answer["seen"]
            assert isinstance(seen, list)
            seen.append((self.path, " ".join(self.headers.values())))
            body = SendTaskHeartbeatResponse(success=bool(answer["success"])).SerializeToString()
            self.send_response(int(str(answer["status"])))
            self.send_header("content-type", "application/protobuf")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1]), answer
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
def test_the_probe_reads_a_superlinks_answers(superlink: tuple[int, dict[str, object]]) -> None:
    port, answer = superlink
    probe = _probe(port)
    assert probe().kind == OK
    seen = answer["seen"]
    assert isinstance(seen, list) and seen[0][0] == "/v1/runtime/send-task-heartbeat"
    assert "t0ken" in seen[0][1]  # the ServerApp's own task token
    answer["success"] = False
    assert probe().kind == FORGOTTEN
    answer["status"], answer["success"] = 401, True
    assert probe().kind == FORGOTTEN
    answer["status"] = 503
    assert probe().kind == NO_ANSWER


@pytest.mark.integration
def test_the_probe_sees_a_closed_port_as_refused() -> None:
    probe = _probe(_free_port())
    result = probe()
    assert result.kind == REFUSED, result


@pytest.mark.integration
def test_a_connection_nothing_accepts_is_refused_not_a_slow_answer() -> None:
    """A full accept queue (the kernel completes no handshake): a connect timeout, which is what
    a SuperLink container that is gone for a restart looks like, not a busy SuperLink."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    pending = []
    try:
        for _ in range(4):  # fill the queue; later connections wait for a handshake
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", port))
            pending.append(client)
        probe = _probe(port, timeout_s=1)
        result = probe()
        assert result.kind == REFUSED and "no connection within" in result.detail, result
    finally:
        for client in pending:
            client.close()
        listener.close()


def test_no_watch_outside_a_deployment() -> None:
    with sw.watching(object(), 30) as stop:
        assert stop is None


@pytest.mark.integration
def test_a_connection_dropped_without_an_answer_is_refused() -> None:
    """A SuperLink going down under a probe: the connection accepted, then closed with no answer.
    Seen as a slow answer, a restart inside one probe went unnoticed (issue 41, under compose)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = int(listener.getsockname()[1])

    def drop_one() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    thread = threading.Thread(target=drop_one, daemon=True)
    thread.start()
    try:
        probe = _probe(port)
        result = probe()
        assert result.kind == REFUSED and "dropped without an answer" in result.detail, result
    finally:
        thread.join(timeout=10)
        listener.close()


@pytest.mark.integration
def test_every_probe_is_a_new_connection(superlink: tuple[int, dict[str, object]]) -> None:
    """Kept-alive connections could go stale and read as dropped: each probe asks for close."""
    port, answer = superlink
    probe = _probe(port)
    assert probe().kind == OK and probe().kind == OK
    seen = answer["seen"]
    assert isinstance(seen, list) and all("close" in headers.lower() for _, headers in seen)
