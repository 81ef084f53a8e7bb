"""The SuperLink's Control API from this process, with Flower 1.41's own client.

``fedmeta deploy run`` asks for its run's status every ``--poll`` seconds until the run ends. Asked
through the ``flwr ls`` CLI, each question was a new Python process importing Flower: about 1.3
CPU-seconds, so a run polled every 2 s kept a third of a core busy for its whole length, and on a
2-core machine that slowed the federation it was watching (issue 41: most of the deploy suite's
time was such runs). Here Flower is imported once and one client asks every time; a failed
question closes the client, and the next one opens a new one (a restarted SuperLink is a new
server).

The client is the one ``flwr`` itself builds (``read_superlink_connection`` and
``init_http_client_from_connection`` from a ``FLWR_HOME`` whose ``config.toml`` names the
connection: ``fedmeta.cli.deploy_flwr.flwr_home``), so TLS and the CA are handled as the CLI handles
them. The names used are listed in tests/test_flower_internals.py.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` for the block (Flower's helpers read FLWR_HOME there)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def open_client(env: Mapping[str, str], connection: str) -> Any:
    """Flower's ``ControlHttpClient`` for ``connection`` of ``env``'s FLWR_HOME."""
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.utils import init_http_client_from_connection

    # Flower's helper prints "Using SuperLink: ..." to stdout: not the command's output (--json).
    with environment(env), contextlib.redirect_stdout(io.StringIO()):
        return init_http_client_from_connection(read_superlink_connection(connection))


class RunStatus:
    """``(status, details)`` of one run, as ``flwr ls --run-id ID --format json`` gives them.

    ``status`` is ``pending``, ``starting``, ``running`` or ``finished:<sub-status>``; ``details``
    is Flower's status details ("" for none). ``("", "")`` when the SuperLink did not answer.
    """

    def __init__(self, env: Mapping[str, str], connection: str) -> None:
        """Questions go to ``connection`` of ``env``'s FLWR_HOME; nothing is opened yet."""
        self.env, self.connection = dict(env), connection
        self._client: Any = None

    def __call__(self, run_id: str) -> tuple[str, str]:
        """Ask once."""
        from flwr.proto.control_pb2 import ListRunsRequest

        try:
            if self._client is None:
                self._client = open_client(self.env, self.connection)
            res = self._client.ListRuns(ListRunsRequest(run_id=int(run_id)))
        except Exception:  # noqa: BLE001 - any failed question is "no answer this time"
            self.close()
            return "", ""
        runs = list(res.run_dict.values())
        if not runs:
            return "", ""
        status = runs[0].status
        text = f"{status.status}:{status.sub_status}" if status.sub_status else status.status
        return text, status.details or ""

    def close(self) -> None:
        """Close the client, if one is open."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
