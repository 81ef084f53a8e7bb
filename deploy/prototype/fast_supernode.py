"""``flower-supernode`` with short polls while a run is active (prototype; Flower 1.41 only).

Flower 1.41's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps a fixed 3 s
after every empty pull from the SuperLink (line 263) and polls its own state every 0.5 s for the
ClientApp's reply (line 470). Between two rounds a node therefore picks up the next round's message
up to 3 s late, and the round waits for the slowest node. Neither interval is configurable.

This launcher replaces the module's ``time`` with a shim: within
``FEDMETA_SUPERNODE_ACTIVE_WINDOW_S`` (default 30 s) of the node's last reply the idle poll is
``FEDMETA_SUPERNODE_POLL_S`` (default 0.1 s), afterwards Flower's 3 s again, so an idle federation
costs the SuperLink no more than stock Flower. The reply poll becomes
``FEDMETA_SUPERNODE_REPLY_POLL_S`` (default 0.02 s; a local state read). Pulling a message's
objects from the SuperLink retries an object that is not there yet after 1 s, doubling
(``PULL_INITIAL_BACKOFF`` in ``flwr/supercore/constant.py``); the ServerApp stores a message before
uploading its objects, so a fast node often hits that. Here the first retry comes after
``FEDMETA_PULL_BACKOFF_S`` (default 0.05 s), capped at 1 s. Everything else, arguments included, is
``flower-supernode``.
"""

from __future__ import annotations

import functools
import os
import sys
import time as _time
from typing import Any

import flwr
import flwr.supernode.start_client_internal as _sci

if not flwr.__version__.startswith("1.41."):
    sys.exit(f"fast_supernode: written against flwr 1.41, found {flwr.__version__}")

POLL_S = float(os.environ.get("FEDMETA_SUPERNODE_POLL_S", "0.1"))
REPLY_POLL_S = float(os.environ.get("FEDMETA_SUPERNODE_REPLY_POLL_S", "0.02"))
ACTIVE_WINDOW_S = float(os.environ.get("FEDMETA_SUPERNODE_ACTIVE_WINDOW_S", "30"))
_last_reply = [-1e9]


class _TimeShim:
    """``time`` for start_client_internal: shorter sleeps, everything else untouched."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        if seconds >= 3:  # idle: no message pulled
            active = _time.monotonic() - _last_reply[0] < ACTIVE_WINDOW_S
            _time.sleep(POLL_S if active else seconds)
        else:  # 0.5 s: waiting for the ClientApp's reply or object contents in local state
            _time.sleep(min(seconds, REPLY_POLL_S))


_orig_push = _sci._push_messages


def _push_messages(*args: Any, **kwargs: Any) -> None:
    try:
        _orig_push(*args, **kwargs)
    finally:
        _last_reply[0] = _time.monotonic()


_sci.time = _TimeShim()  # type: ignore[assignment]
_sci.pull_objects = functools.partial(
    _sci.pull_objects,
    initial_backoff=float(os.environ.get("FEDMETA_PULL_BACKOFF_S", "0.05")),
    backoff_cap=1.0,
)
_sci._push_messages = _push_messages

if __name__ == "__main__":
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv[0] = "flower-supernode"
    flower_supernode()
