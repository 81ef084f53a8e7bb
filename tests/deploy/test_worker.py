"""The warm participant worker (client/fedmeta/client/worker.py) and the SuperNode launcher
(client/fedmeta/client/supernode.py) without a SuperNode: the Flower version pin, the app check,
the warm-up through the real ClientApp, and the bounded waits."""

from __future__ import annotations

import argparse
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from fedmeta.client import supernode, warm_up, worker

pytestmark = [pytest.mark.deploy, pytest.mark.unit]


def test_only_flower_1_41_is_accepted() -> None:
    worker.check_flower("1.41.0")
    worker.check_flower("1.41.7")
    for other in ("1.40.2", "1.42.0", "2.0.0"):
        with pytest.raises(SystemExit, match="flwr 1.41"):
            worker.check_flower(other)


def test_runs_of_another_app_or_version_are_refused() -> None:
    version = metadata.version("fedmeta")

    def run(fab_id: str, fab_version: str) -> Any:
        return argparse.Namespace(run_id=5, fab_id=fab_id, fab_version=fab_version)

    assert worker.app_refusal(run("fedmeta/fedmeta", version)) is None
    for fab_id, fab_version in (("fedmeta/fedmeta", version + ".post1"), ("evil/app", version)):
        reason = worker.app_refusal(run(fab_id, fab_version))
        assert reason is not None and f"fedmeta/fedmeta=={version}" in reason


def test_warm_up_runs_registration_and_a_gradient_through_the_client_app() -> None:
    calls: list[str] = []
    from fedmeta.client.app import app

    def spy(*, message: Any, context: Any) -> Any:
        calls.append(message.metadata.message_type)
        return app(message=message, context=context)

    seconds = warm_up.warm_up(spy, {"participant-id": "0"})
    assert calls == ["query", "train"] and seconds > 0


def test_options_name_the_flag_at_fault(tmp_path: Path) -> None:
    args = worker.parse_args(["--node-config", 'participant-id="4" data-path="/d"'])
    options = worker.options_from_args(args)
    assert options.node_config == {"participant-id": "4", "data-path": "/d"}
    assert options.root_certificates is None  # the node-local Runtime API
    with pytest.raises(SystemExit, match="--root-certificates"):
        worker.options_from_args(worker.parse_args(["--root-certificates", str(tmp_path / "x")]))
    with pytest.raises(SystemExit, match="--task-timeout must be > 0"):
        worker.options_from_args(worker.parse_args(["--task-timeout", "0"]))


def test_a_task_that_overruns_ends_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(worker.os, "_exit", exits.append)
    worker.Watchdog(0.05, "task 1")
    done = worker.Watchdog(0.05, "task 2")
    done.cancel()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert exits == [worker.EXIT_TASK_TIMEOUT]


def test_supernode_shim_shortens_polls_and_bounds_the_reply_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    exits: list[int] = []
    monkeypatch.setattr(supernode._time, "sleep", slept.append)
    monkeypatch.setattr(supernode.os, "_exit", exits.append)
    polls = supernode.Polls(poll_s=0.1, reply_poll_s=0.02, active_window_s=30, reply_timeout_s=5)
    shim = supernode.TimeShim(polls)
    shim.sleep(3)  # idle, no recent reply: Flower's 3 s
    polls.last_reply = supernode._time.monotonic()
    shim.sleep(3)  # idle within the active window: the short poll
    polls.waiting_since = supernode._time.monotonic()
    shim.sleep(0.5)  # waiting for the worker's reply: the short local poll
    assert slept == [3, 0.1, 0.02] and not exits
    polls.waiting_since = supernode._time.monotonic() - 6
    shim.sleep(0.5)
    assert exits == [supernode.EXIT_REPLY_TIMEOUT]
    assert shim.monotonic is supernode._time.monotonic  # everything else is the real time module


def test_supernode_arguments_split_from_flowers() -> None:
    args, rest = supernode.parse_args(["--poll", "0.2", "--", "--superlink", "h:1", "--insecure"])
    assert args.poll == 0.2 and rest == ["--superlink", "h:1", "--insecure"]
    with pytest.raises(SystemExit, match="--reply-timeout must be > 0"):
        supernode.parse_args(["--reply-timeout", "0"])


def test_a_worker_told_to_stop_while_its_supernode_is_gone_stops_at_once() -> None:
    """The SuperNode exited first (a revoked key, a SIGTERM to the node's group): the worker's
    task poll meets a closed port and retries for ``api_timeout_s``; told to stop meanwhile, it
    returns within one backoff instead of being killed by ``deploy participant``'s grace period.
    """
    import threading

    from fedmeta.cli.deploy_local import free_port

    options = worker.WorkerOptions(address=f"127.0.0.1:{free_port()}", api_timeout_s=60.0)
    w = worker.Worker(options, app=lambda **_: None)
    threading.Timer(0.5, w.stopping.set).start()
    started = time.monotonic()
    w.serve(w.stopping)  # returns: no SystemExit(EXIT_API_UNREACHABLE) after 60 s
    assert time.monotonic() - started < options.api_timeout_s / 2
