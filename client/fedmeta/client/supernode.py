"""``flower-supernode`` with short polls while a run is active and a bound on its reply wait.

Flower 1.41's SuperNode loop (``flwr/supernode/start_client_internal.py``) has three fixed waits,
none configurable:

* after every pull from the SuperLink that brought no message it sleeps **3 s**, so a node picks up
  the next round's message up to 3 s late and every round waits for the slowest node;
* waiting for the ClientApp's reply in its own state it sleeps **0.5 s** between looks, and it
  waits **forever**: a worker that dies in the middle of a task leaves the node stuck;
* an object of a message that is not at the SuperLink yet is pulled again after **1 s**, doubling
  (``pull_objects``' ``initial_backoff``).

This launcher replaces the module's ``time`` with a shim and wraps two of its functions. Within
``--active-window`` seconds of the node's last reply the idle poll is ``--poll`` (afterwards
Flower's 3 s again, so an idle federation costs the SuperLink what stock Flower costs); the reply
wait polls every ``--reply-poll`` seconds and ends the process (exit status 75) after
``--reply-timeout`` seconds, so that its supervisor restarts the node and its worker together; the
object pulls retry after ``--pull-backoff``. Every other argument is ``flower-supernode``'s.

**What it relies on in Flower 1.41** (another version is refused;
``client/fedmeta/client/flower_internals.py``
lists these and a unit test checks them): the module-level names
``time``, ``pull_objects`` and ``_push_messages`` of ``flwr.supernode.start_client_internal``, the
3 s idle sleep being the only sleep of 3 s or more there, and ``flower_supernode()`` reading
``sys.argv``.

    python -m fedmeta.client.supernode [--poll 0.1 ...] -- --superlink HOST:9092 \
        --isolation process ...
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedmeta.client import flower_internals

EXIT_REPLY_TIMEOUT = 75  # EX_TEMPFAIL: restart the node and its worker

log = logging.getLogger("fedmeta.supernode")
#: This module's import name, also when run as ``python -m`` (``__name__`` is then ``__main__``).
MODULE = __spec__.name if __spec__ is not None else __name__


@dataclass
class Polls:
    """The shim's settings and state (one SuperNode per process)."""

    poll_s: float = 0.1
    reply_poll_s: float = 0.02
    active_window_s: float = 30.0
    reply_timeout_s: float = 3660.0
    last_reply: float = -1e9
    waiting_since: float | None = None


class TimeShim:
    """``time`` as ``start_client_internal`` sees it: shorter sleeps, a bounded reply wait."""

    def __init__(self, polls: Polls) -> None:
        """Shim for ``polls``; every other attribute is the real ``time``'s."""
        self.polls = polls

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)

    def sleep(self, seconds: float) -> None:
        """Flower's 3 s idle sleep, or its 0.5 s local waits, shortened."""
        polls = self.polls
        if seconds >= 3:  # idle: the last pull brought no message
            active = _time.monotonic() - polls.last_reply < polls.active_window_s
            _time.sleep(polls.poll_s if active else seconds)
            return
        since = polls.waiting_since
        if since is not None and _time.monotonic() - since > polls.reply_timeout_s:
            log.error("no reply from the worker after %.0f s: exiting so that the node and "
                      "its worker restart", polls.reply_timeout_s)  # fmt: skip
            logging.shutdown()
            os._exit(EXIT_REPLY_TIMEOUT)
        _time.sleep(min(seconds, polls.reply_poll_s))


def install(polls: Polls, pull_backoff_s: float) -> None:
    """Patch ``flwr.supernode.start_client_internal`` (Flower 1.41 only)."""
    import flwr.supernode.start_client_internal as sci

    flower_internals.check_flower("supernode")
    push = sci._push_messages

    @functools.wraps(push)
    def push_messages(*args: Any, **kwargs: Any) -> None:
        polls.waiting_since = _time.monotonic()
        try:
            push(*args, **kwargs)
        finally:
            polls.waiting_since = None
            polls.last_reply = _time.monotonic()

    pull = functools.partial(sci.pull_objects, initial_backoff=pull_backoff_s, backoff_cap=1.0)  # type: ignore[attr-defined]
    for name, value in (("time", TimeShim(polls)), ("pull_objects", pull),
                        ("_push_messages", push_messages)):  # fmt: skip
        setattr(sci, name, value)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This launcher's options, and the rest for ``flower-supernode``."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", add_help=False)
    p.add_argument("--poll", type=float, default=0.1, help="idle poll while a run is active (s)")
    p.add_argument("--reply-poll", type=float, default=0.02)
    p.add_argument("--active-window", type=float, default=30.0)
    p.add_argument("--reply-timeout", type=float, default=3660.0)
    p.add_argument("--pull-backoff", type=float, default=0.05)
    args, rest = p.parse_known_args(argv)
    for flag in ("poll", "reply_poll", "active_window", "reply_timeout", "pull_backoff"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"fedmeta supernode: --{flag.replace('_', '-')} must be > 0")
    return args, [a for a in rest if a != "--"]


def main(argv: Sequence[str] | None = None) -> None:
    """Install the shim and run ``flower-supernode`` with the remaining arguments."""
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    polls = Polls(args.poll, args.reply_poll, args.active_window, args.reply_timeout)
    install(polls, args.pull_backoff)
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
