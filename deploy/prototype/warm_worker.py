"""A long-lived per-node ClientApp executor for ``flower-supernode --isolation process``.

A prototype.

Flower 1.41 runs every message in a new ``flwr-clientapp`` process (``SubprocessExecutor.launch``,
``flwr/supercore/superexec/executor/subprocess_executor.py``), which imports flwr, torch and the app
and rebuilds the workload each time. Under ``--isolation process`` the SuperNode starts no executor:
whoever calls its Runtime API's ``AcquireTask`` receives each task with a one-task token. This
worker is that caller. It imports torch and fedmeta's ClientApp once, then loops:

    AcquireTask -> PullTaskInput/PullMessages (with the task token) -> ClientApp(message, context)
    -> PushMessages/PushObject (the reply) -> PushTaskOutput (completed or failed)

the same calls, in the same order, as ``flwr/supernode/runtime/run_clientapp.py``, without the
process exit. fedmeta's workload cache (``client.workload._workload``, an ``lru_cache``) then stays
warm across messages.

It runs the ClientApp *installed on this node* and never code shipped in the run's FAB: a run whose
FAB id or version differs from the installed fedmeta gets an error reply instead.

    python deploy/prototype/warm_worker.py --runtime-api-address 127.0.0.1:9094 [--insecure |
        --root-certificates CA] [--superexec-auth-secret-file F] [--timings FILE]

``--insecure`` here concerns only the node-local Runtime API (loopback or a pod-local socket), not
the link to the SuperLink. ``--timings FILE`` appends one JSON line per task.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from importlib import metadata
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

import flwr

if not flwr.__version__.startswith("1.41."):
    sys.exit(f"warm_worker: written against flwr 1.41, found {flwr.__version__}")

import flwr.supernode.runtime.run_clientapp as _rc  # noqa: E402
from flwr.app import Error, Message  # noqa: E402
from flwr.common.constant import ErrorCode, SubStatus  # noqa: E402
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # noqa: E402  # pylint: disable=E0611
from flwr.supercore import log  # noqa: E402
from flwr.supercore.constant import TaskType  # noqa: E402
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http  # noqa: E402
from flwr.supercore.interceptors import (  # noqa: E402
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker  # noqa: E402
from flwr.supercore.runtime import RuntimeHttpClient  # noqa: E402
from flwr.supernode.runtime.run_clientapp import (  # noqa: E402
    pull_task_input,
    push_message,
    push_task_output,
)

# The SuperNode creates the task before it has pulled the message's objects from the SuperLink, so
# the first pull of an object often finds it missing; Flower then waits 1 s, doubling. Retry sooner.
_rc.pull_and_inflate_object_from_tree = functools.partial(
    _rc.pull_and_inflate_object_from_tree,
    initial_backoff=float(os.environ.get("FEDMETA_PULL_BACKOFF_S", "0.05")),
    backoff_cap=1.0,
)


def _expected_app() -> tuple[str, str]:
    """(fab_id, version) of the installed fedmeta app, as ``flwr run`` names its FAB."""
    return "fedmeta/fedmeta", metadata.version("fedmeta")


class Worker:
    """Acquire tasks from one SuperNode's Runtime API and run them in this process."""

    def __init__(
        self,
        address: str,
        *,
        insecure: bool,
        root_certificates: bytes | None,
        secret: bytes | None,
        poll_s: float,
        timings: Path | None,
        check_app: bool,
        alive_file: Path | None = None,
    ) -> None:
        interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if secret:
            interceptors.append(
                SuperExecAuthHttpInterceptor(
                    master_secret=secret,
                    protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"}),
                )
            )
        self.address = address
        self.insecure = insecure
        self.root_certificates = root_certificates
        self.poll_s = poll_s
        self.timings = timings
        self.check_app = check_app
        self.alive_file = alive_file
        self._alive_at = 0.0
        self.control = RuntimeHttpClient.from_server_address(
            server_address=address,
            insecure=insecure,
            root_certificates=root_certificates,
            interceptors=interceptors,
            retry_invoker=make_simple_http_retry_invoker(),
        )
        t0 = time.perf_counter()
        import torch  # noqa: F401  (warm: imported once)

        from client.app import app as client_app

        self.app = client_app
        self.import_s = time.perf_counter() - t0
        self.tasks = 0

    def serve_forever(self) -> None:
        """Poll ``AcquireTask`` every ``poll_s`` within 30 s of the last task, else every 1 s."""
        log(INFO, "warm worker ready (imports %.2f s); Runtime API %s", self.import_s, self.address)
        last = -1e9
        while True:
            self._alive()
            res = self.control.AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
            )
            if res.HasField("task") and res.token:
                self.run_task(res.token, acquired=time.perf_counter())
                last = time.monotonic()
            else:
                time.sleep(self.poll_s if time.monotonic() - last < 30 else 1.0)

    def _alive(self) -> None:
        """Touch the liveness file (for the container healthcheck) at most every 5 s."""
        now = time.monotonic()
        if self.alive_file is not None and now - self._alive_at > 5:
            self.alive_file.touch()
            self._alive_at = now

    def run_task(self, token: str, *, acquired: float) -> None:
        """One message, as ``run_clientapp`` does it, minus the process start and exit."""
        client = RuntimeHttpClient.from_server_address(
            server_address=self.address,
            insecure=self.insecure,
            root_certificates=self.root_certificates,
            interceptors=[
                RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                RuntimeTokenHttpInterceptor(token),
            ],
            retry_invoker=make_simple_http_retry_invoker(),
        )
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message = context = reply = None
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        t: dict[str, float] = {"acquired": acquired}
        try:
            message, context, run, _fab = pull_task_input(client)
            t["input"] = time.perf_counter()
            if self.check_app and (run.fab_id, run.fab_version) != _expected_app():
                raise RuntimeError(
                    f"run {run.run_id} is app {run.fab_id}=={run.fab_version}; this node runs "
                    f"{'=='.join(_expected_app())} only"
                )
            reply = self.app(message=message, context=context)
            t["app"] = time.perf_counter()
            sub_status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # noqa: BLE001  (reported to the server as an error reply)
            log(ERROR, "ClientApp raised an exception", exc_info=ex)
            details = f"{type(ex).__name__}: {ex}"
            if message is not None:
                reply = Message(
                    Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, details), reply_to=message
                )
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
                t["pushed"] = time.perf_counter()
            finally:
                push_task_output(client, context, sub_status, details)
                heartbeat.stop()
                client.close()
        self.tasks += 1
        if self.timings is not None:
            with self.timings.open("a") as fh:
                rel = {k: round(v - acquired, 4) for k, v in t.items()}
                fh.write(json.dumps({"wall": time.time(), "status": sub_status, **rel}) + "\n")


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api-address", default="127.0.0.1:9094")
    tls = parser.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the node-local API")
    tls.add_argument("--root-certificates", help="CA of the SuperNode's Runtime API certificate")
    parser.add_argument("--superexec-auth-secret-file")
    parser.add_argument(
        "--poll", type=float, default=float(os.environ.get("FEDMETA_WORKER_POLL_S", "0.05"))
    )
    parser.add_argument("--timings", type=Path)
    parser.add_argument("--alive-file", type=Path, help="touched while the worker loop runs")
    parser.add_argument("--no-app-check", action="store_true", help="run any FAB's messages")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Worker(
        args.runtime_api_address,
        insecure=args.insecure,
        root_certificates=Path(args.root_certificates).read_bytes()
        if args.root_certificates
        else None,
        secret=Path(args.superexec_auth_secret_file).read_bytes()
        if args.superexec_auth_secret_file
        else None,
        poll_s=args.poll,
        timings=args.timings,
        check_app=not args.no_app_check,
        alive_file=args.alive_file,
    ).serve_forever()


if __name__ == "__main__":
    main()
