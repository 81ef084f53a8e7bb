"""``fedmeta deploy run``'s status polls in-process (cli/fedmeta/cli/control_api.py): the answer
reads as ``flwr ls --run-id ID --format json`` gives it, a SuperLink that does not answer is
("", "") and a new client next time. The polls against a live SuperLink are every deploy test's
``deploy run`` (tests/deploy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flwr.proto.control_pb2 import ListRunsRequest, ListRunsResponse
from flwr.proto.run_pb2 import Run, RunStatus

from fedmeta.cli import control_api
from fedmeta.cli.deploy_flwr import CONNECTION, flwr_home
from fedmeta.cli.deploy_local import free_port

pytestmark = pytest.mark.unit


class FakeClient:
    """Answers ListRuns with one run in ``status``; counts calls and closes."""

    def __init__(self, status: RunStatus | None, fail: bool = False) -> None:
        self.status, self.fail, self.asked, self.closed = status, fail, [], False

    def ListRuns(self, request: ListRunsRequest) -> ListRunsResponse:  # noqa: N802 - Flower's name
        self.asked.append(request.run_id)
        if self.fail:
            raise ConnectionError("the SuperLink went away")
        res = ListRunsResponse()
        if self.status is not None:
            res.run_dict[request.run_id].CopyFrom(Run(run_id=request.run_id, status=self.status))
        return res

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (RunStatus(status="running"), ("running", "")),
        (RunStatus(status="finished", sub_status="completed"), ("finished:completed", "")),
        (RunStatus(status="finished", sub_status="failed", details="ServerApp failed: boom"),
         ("finished:failed", "ServerApp failed: boom")),
        (None, ("", "")),  # the SuperLink does not know the run
    ],
)
def test_the_answer_reads_as_flwr_ls_gives_it(
    monkeypatch: pytest.MonkeyPatch, status: RunStatus | None, expected: tuple[str, str]
) -> None:
    client = FakeClient(status)
    monkeypatch.setattr(control_api, "open_client", lambda env, connection: client)
    ask = control_api.RunStatus({"FLWR_HOME": "/nowhere"}, CONNECTION)
    assert ask("42") == expected and ask("42") == expected
    assert client.asked == [42, 42]  # one client for every question
    ask.close()
    assert client.closed


def test_a_failed_question_is_no_answer_and_the_next_opens_a_new_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clients = [FakeClient(None, fail=True), FakeClient(RunStatus(status="running"))]
    handed: list[FakeClient] = []

    def open_client(env: Any, connection: str) -> FakeClient:
        handed.append(clients.pop(0))
        return handed[-1]

    monkeypatch.setattr(control_api, "open_client", open_client)
    ask = control_api.RunStatus({"FLWR_HOME": "/nowhere"}, CONNECTION)
    assert ask("7") == ("", "")
    assert handed[0].closed  # the failed client is closed, not asked again
    assert ask("7") == ("running", "")
    assert len(handed) == 2


def test_no_superlink_at_the_address_is_no_answer(tmp_path: Path) -> None:
    """Flower's own client, built from a FLWR_HOME as ``deploy run`` writes it, on a port where
    nothing listens."""
    with flwr_home(f"127.0.0.1:{free_port()}", None) as env:
        ask = control_api.RunStatus(env, CONNECTION)
        assert ask("1") == ("", "")
        ask.close()
