"""The warm participant worker: runs every task of one SuperNode in one long-lived process.

Flower 1.41 starts a new ``flwr-clientapp`` process for every message (``SubprocessExecutor``):
each imports flwr and torch and rebuilds the workload, about 8 CPU-seconds per message. Under
``flower-supernode --isolation process`` the SuperNode starts nothing itself; whoever calls its
Runtime API's ``AcquireTask`` gets the next task with a one-task token. This worker is that caller.
It imports torch and fedmeta's ClientApp once, warms both up, and then for each task makes the same
calls as ``flwr/supernode/runtime/run_clientapp.py``::

    AcquireTask -> PullTaskInput, PullMessages, PullObject... (task token) -> client.app.app(...)
    -> PushMessages, PushObject... (the reply) -> PushTaskOutput (completed or failed)

without the process exit, so the workload cache stays warm across messages.

**What it relies on in Flower 1.41** (checked at start: another Flower version is refused): the
Runtime API's HTTP client and its interceptors, ``run_clientapp``'s push functions, the object
pulls, the task heartbeat (the SuperNode fails a claimed task after 60 s without one) and
``TaskIdentity``. Each is reached only through ``client/fedmeta/client/flower_internals.py``, the
adapter that names every internal and the Flower version it was checked against; this module
imports nothing of Flower's. Flower's own HTTP retry policy is not used: it retries forever and
sends SIGINT to its own process on HTTP 401, which would end this worker. The warm-up is
``client/fedmeta/client/warm_up.py``.

**Safety.** It runs only the fedmeta installed on this node, never code shipped in the run's FAB:
a run whose app is not ``fedmeta/fedmeta`` at this node's fedmeta version gets an error reply
(the server counts it as ``error_reply``). Every wait is bounded: each HTTP call by
``--api-timeout`` (retries included), each task by ``--task-timeout`` (a watchdog ends the process
with exit status 75 so that its supervisor restarts the SuperNode and the worker together).

    python -m fedmeta.client.worker --runtime-api-address 127.0.0.1:9094 \
        --node-config 'participant-id=3'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from fedmeta.client import flower_internals as fi
from fedmeta.client.warm_up import warm_up

FLOWER_SERIES = fi.FLOWER_SERIES
APP_ID = "fedmeta/fedmeta"
EXIT_FLOWER_VERSION = fi.EXIT_FLOWER_VERSION  # EX_CONFIG: not this Flower
EXIT_TASK_TIMEOUT = 75  # EX_TEMPFAIL: a task overran; restart the node and the worker
EXIT_API_UNREACHABLE = 69  # EX_UNAVAILABLE: the SuperNode's Runtime API stopped answering

log = logging.getLogger("fedmeta.worker")
#: This module's import name, also when run as ``python -m`` (``__name__`` is then ``__main__``).
MODULE = __spec__.name if __spec__ is not None else __name__


def check_flower(version: str | None = None) -> None:
    """Refuse any Flower but the pinned series: the worker calls internals that change."""
    fi.check_flower("worker", version)


def expected_app() -> tuple[str, str]:
    """(fab_id, fab_version) of the runs this node accepts: this node's fedmeta."""
    return APP_ID, metadata.version("fedmeta")


@dataclass(frozen=True)
class WorkerOptions:
    """How the worker reaches its SuperNode and how long it waits for anything."""

    address: str = "127.0.0.1:9094"
    root_certificates: bytes | None = None  # None: plain HTTP (the node-local Runtime API)
    secret: bytes | None = None  # the SuperNode's --superexec-auth-secret-file
    node_config: dict[str, Any] | None = None  # for the warm-up only; tasks carry their own
    poll_s: float = 0.05  # AcquireTask poll while tasks keep coming
    idle_poll_s: float = 0.5  # ... and after idle_after_s without a task
    idle_after_s: float = 30.0
    api_timeout_s: float = 60.0  # one Runtime API call, retries included
    task_timeout_s: float = 3600.0  # one task, from acquiring it to its output
    pull_backoff_s: float = 0.05  # first retry of an object the SuperNode has not stored yet
    check_app: bool = True
    warm_config: Path | None = None  # a fedmeta config whose workload to build at start
    alive_file: Path | None = None  # touched every few seconds (container healthcheck)
    timings: Path | None = None  # one JSON line per task


# ------------------------------------------------------------------------------------ one task


def app_refusal(run: Any) -> str | None:
    """Why this node refuses to run ``run``'s app, or None when it is this node's fedmeta."""
    fab_id, version = expected_app()
    if (run.fab_id, run.fab_version) == (fab_id, version):
        return None
    return (
        f"run {run.run_id} is app {run.fab_id}=={run.fab_version}; this node runs only "
        f"{fab_id}=={version} (install the server's fedmeta version on the node)"
    )


@dataclass
class TaskResult:
    """What happened to one task (with ``--timings``, written as one JSON line).

    ``times``: seconds since the task was acquired at wall-clock ``started``; ``kind`` and
    ``group``: the message's type and group (the round, for gradient requests).
    """

    status: str
    details: str
    times: dict[str, float]
    started: float = 0.0
    kind: str = ""
    group: str = ""


class Watchdog:
    """Ends the process if a task is not done in time: the only bound on the ClientApp's compute."""

    def __init__(self, seconds: float, what: str) -> None:
        """Arm for ``seconds``; :meth:`cancel` disarms."""
        self._timer = threading.Timer(seconds, self._fire, args=(seconds, what))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _fire(seconds: float, what: str) -> None:
        log.error("%s not done after %.0f s: exiting so the node restarts", what, seconds)
        logging.shutdown()
        os._exit(EXIT_TASK_TIMEOUT)

    def cancel(self) -> None:
        """Disarm."""
        self._timer.cancel()


class Worker:
    """Acquires the tasks of one SuperNode and runs them in this process."""

    def __init__(self, options: WorkerOptions, app: Any = None) -> None:
        """``app``: the ClientApp to run (default: fedmeta's, imported here, once)."""
        self.options = options
        if app is None:
            from fedmeta.client.app import app as client_app

            app = client_app
        self.app = app
        #: Set on SIGTERM/SIGINT (``main``): ends ``serve`` and any retry of the task poll.
        self.stopping = threading.Event()
        self.control = self._client(fi.control_interceptors(options.secret), self.stopping)
        self.tasks = 0
        self._alive_at = 0.0

    def _client(self, interceptors: list[Any], stop: threading.Event | None = None) -> Any:
        """A Runtime API client whose every call ends within ``api_timeout_s``."""
        o = self.options
        return fi.runtime_client(o.address, o.root_certificates, o.api_timeout_s, *interceptors,
                                 stop=stop)  # fmt: skip

    def serve(self, stop: threading.Event) -> None:
        """Acquire and run tasks until ``stop`` is set; poll fast while tasks keep coming."""
        import httpx

        last_task = -1e9  # idle until the first task
        while not stop.is_set():
            self._touch_alive()
            try:
                token = fi.acquire_task(self.control)
            except httpx.HTTPError as error:  # retried for api_timeout_s already
                if stop.is_set():  # told to stop while its SuperNode was unreachable
                    return
                log.error("the SuperNode's Runtime API at %s is unreachable: %s",
                          self.options.address, error)  # fmt: skip
                raise SystemExit(EXIT_API_UNREACHABLE) from None
            if token is not None:
                self.run_task(token)
                last_task = time.monotonic()
                continue
            idle = time.monotonic() - last_task > self.options.idle_after_s
            stop.wait(self.options.idle_poll_s if idle else self.options.poll_s)

    def _touch_alive(self) -> None:  # also called from the task heartbeat's thread
        """Touch the liveness file at most every 5 s (the container healthcheck reads its age)."""
        path, now = self.options.alive_file, time.monotonic()
        if path is not None and now - self._alive_at > 5:
            path.touch()
            self._alive_at = now

    def run_task(self, token: str) -> TaskResult:
        """One task, as ``run_clientapp`` runs it, minus the process start and exit."""
        t0, started = time.perf_counter(), time.time()
        client = self._client(fi.task_interceptors(token))
        refused = threading.Event()
        heartbeat = fi.heartbeat(client, refused, self._touch_alive)
        watchdog = Watchdog(self.options.task_timeout_s, f"task {self.tasks + 1}")
        context = reply = None
        result = TaskResult(fi.FAILED, "ClientApp task failed", {})
        # Object pulls are Runtime API calls: bounded like every other. The task's own bound would
        # keep the worker for an hour on a message whose run failed meanwhile (a killed ServerApp:
        # the SuperNode never stores its objects), and no later run's task would be served.
        pull_s = min(self.options.api_timeout_s, self.options.task_timeout_s)
        try:
            message, context, run = fi.pull_task_input(client, pull_s, self.options.pull_backoff_s)
            result.times["input"] = time.perf_counter() - t0
            reply, result = self._call_app(message, context, run, result)
            result.kind, result.group = message.metadata.message_type, message.metadata.group_id
            result.times["app"] = time.perf_counter() - t0
            if reply is not None:
                fi.push_reply(client, reply, context)
            result.times["pushed"] = time.perf_counter() - t0
        except Exception as error:  # noqa: BLE001 - the task fails; the worker lives on
            log.exception("task failed before its reply was sent")
            result = TaskResult(fi.FAILED, f"{type(error).__name__}: {error}", result.times)
        finally:
            fi.push_output(client, context, result.status, result.details)
            watchdog.cancel()
            heartbeat.stop()
            client.close()
        if refused.is_set():
            log.warning("the SuperNode dropped task %d while it ran", self.tasks + 1)
        self.tasks += 1
        result.started = started
        self._record(result)
        return result

    def _call_app(self, message: Any, context: Any, run: Any, result: TaskResult) -> Any:
        """The ClientApp's reply, or an error reply naming why there is none."""
        refusal = app_refusal(run) if self.options.check_app else None
        if refusal is not None:
            log.warning("%s", refusal)
            return fi.error_reply(message, refusal), TaskResult(fi.FAILED, refusal, {})
        try:
            reply = self.app(message=message, context=context)
        except Exception as error:  # noqa: BLE001 - reported to the server as an error reply
            log.exception("the ClientApp raised")
            reason = f"{type(error).__name__}: {error}"
            return fi.error_reply(message, reason), TaskResult(fi.FAILED, reason, {})
        return reply, TaskResult(fi.COMPLETED, "", result.times)

    def _record(self, result: TaskResult) -> None:
        if self.options.timings is None:
            return
        times = {k: round(v, 4) for k, v in result.times.items()}
        line = {"started": round(result.started, 4), "status": result.status, "kind": result.kind,
                "group": result.group, **times}  # fmt: skip
        with self.options.timings.open("a") as fh:
            fh.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------------------------ command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The worker's command line (``python -m fedmeta.client.worker --help``)."""
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.split("\n")[0]
    )
    p.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                   help="the SuperNode's Runtime API (its --port), node-local")  # fmt: skip
    p.add_argument("--root-certificates", type=Path,
                   help="CA of the Runtime API's certificate; without it plain HTTP, which is "
                   "only for a Runtime API bound to the node's loopback")  # fmt: skip
    p.add_argument("--superexec-auth-secret-file", type=Path)
    p.add_argument("--node-config", default="",
                   help="the SuperNode's --node-config (used by the warm-up only)")  # fmt: skip
    p.add_argument("--warm-config", type=Path, help="fedmeta config whose workload to build first")
    p.add_argument("--no-warm-up", action="store_true")
    p.add_argument("--poll", type=float, default=0.05, help="seconds between polls while active")
    p.add_argument("--idle-poll", type=float, default=0.5, help="seconds between polls when idle")
    p.add_argument("--api-timeout", type=float, default=60.0)
    p.add_argument("--task-timeout", type=float, default=3600.0)
    p.add_argument("--alive-file", type=Path)
    p.add_argument("--timings", type=Path, help="append one JSON line per task")
    p.add_argument("--no-app-check", action="store_true", help="TESTS ONLY: run any app's tasks")
    return p.parse_args(argv)


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    """Validated options (a missing file is one line naming the flag)."""
    def read(flag: str, path: Path | None) -> bytes | None:
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as error:
            raise SystemExit(f"fedmeta worker: {flag} {path}: {error.strerror}") from None

    for flag, value in (
        ("--poll", args.poll),
        ("--idle-poll", args.idle_poll),
        ("--api-timeout", args.api_timeout),
        ("--task-timeout", args.task_timeout),
    ):
        if not value > 0:
            raise SystemExit(f"fedmeta worker: {flag} must be > 0 seconds; got {value}")
    return WorkerOptions(
        address=args.runtime_api_address,
        root_certificates=read("--root-certificates", args.root_certificates),
        secret=read("--superexec-auth-secret-file", args.superexec_auth_secret_file),
        node_config=fi.parse_node_config(args.node_config) if args.node_config else {},
        poll_s=args.poll, idle_poll_s=args.idle_poll, api_timeout_s=args.api_timeout,
        task_timeout_s=args.task_timeout, check_app=not args.no_app_check,
        warm_config=args.warm_config, alive_file=args.alive_file, timings=args.timings,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Check Flower, import and warm up, then serve until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    args = parse_args(argv)
    check_flower()
    options = options_from_args(args)
    for key, value in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1")):
        os.environ.setdefault(key, value)
    t0 = time.perf_counter()
    worker = Worker(options)
    log.info("imports %.2f s; Runtime API %s", time.perf_counter() - t0, options.address)
    if not args.no_warm_up:
        try:
            seconds = warm_up(worker.app, options.node_config or {}, options.warm_config)
            log.info("warm-up %.2f s", seconds)
        except Exception as error:  # noqa: BLE001 - a cold first task is slower, not wrong
            log.warning("warm-up failed (the first task will be slower): %s: %s",
                        type(error).__name__, error)  # fmt: skip
    stop = worker.stopping
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("warm worker ready")
    worker.serve(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
