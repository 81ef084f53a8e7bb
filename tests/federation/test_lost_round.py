"""A SuperLink lost in the middle of a round's push (server/fedmeta/server/transport.py, issue 41).

Restarted under compose while a round's messages were being pushed, the SuperLink no longer held
the push session, and Flower's grid raised ``ObjectPushError`` before the SuperLink watch had seen
the restart: the ServerApp died with that error, without ``stopped: interrupted`` or its summary
(seen in tests/deploy/test_compose_faults.py). Now the exchange stops the run with the reason: the
round is abandoned before its spend, the run ends as the watch ends it, and ``watching`` raises
``SuperLinkLost`` with that reason (Flower: ``finished:failed``; ``deploy run``: exit 1 and the
resume command).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
from flwr.app import Message
from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

from fedmeta import protocol as P
from fedmeta.config_io import load_config
from fedmeta.server import superlink_watch as sw
from fedmeta.server.superlink_watch import OK, Probe, StopRequest, SuperLinkLost
from fedmeta.simulation.local_grid import InProcessGrid

pytestmark = pytest.mark.integration

SMALL = ["federation.participants=3", "dataset.tasks_per_participant=12", "rounds=6",
         "dataset.validation_tasks=4", "dataset.test_tasks=4", "dataset.probe_tasks=2",
         "sampling.participants_per_round=3", "privacy.noise_multiplier=1.0",
         "output.progress=false", "output.plots=false", "training.eval_every=100",
         "training.checkpoint_every=1"]  # fmt: skip


class SuperLinkRestartsAtRound(InProcessGrid):
    """Flower's grid after a SuperLink restart: the push of round ``at`` (0-based) fails."""

    def __init__(self, num_nodes: int, at: int) -> None:
        super().__init__(num_nodes)
        self.at, self.trains = at, 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        messages = list(messages)
        if messages and messages[0].metadata.message_type == P.MSG_TRAIN:
            self.trains += 1
            if self.trains == self.at + 1:
                raise ObjectPushError("26c7c214", 7, "ecfc2c8a")  # as seen under compose
        return super().push_messages(messages)


def test_a_push_lost_with_the_superlink_ends_the_run_before_the_rounds_spend(
    tmp_path: Path,
) -> None:
    from fedmeta.server.app import execute

    from .fakes import fake_ledger, opener

    cfg = load_config(None, SMALL)
    stop = StopRequest()
    ledger = fake_ledger(100.0, 0.1)
    result = execute(cfg, SuperLinkRestartsAtRound(3, at=2), out_dir=tmp_path / "run",
                     observers=[], echo=False, open_ledger=opener(ledger), stop=stop)  # fmt: skip
    summary = result.summary
    assert summary["stopped_reason"] == "interrupted", summary
    assert summary["rounds_completed"] == 2  # rounds 1 and 2; round 3 abandoned, not spent
    assert len(ledger.records()) == 2
    assert stop.is_set() and stop.reason is not None
    assert stop.reason.startswith("the SuperLink lost the round's messages (ObjectPushError")


def test_without_a_stop_event_the_grids_error_is_raised(tmp_path: Path) -> None:
    from fedmeta.server.transport import GridTransport

    transport = GridTransport(SuperLinkRestartsAtRound(1, at=0), register_timeout_s=1,
                              round_timeout_s=1)  # fmt: skip
    request = P.GradientRequest("run", 0, (0,), 1.0, None, "{}")  # never encoded: push fails first
    with pytest.raises(ObjectPushError):
        transport.exchange({"0": request}, {"0": 1000})


def test_watching_raises_superlink_lost_with_the_exchanges_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watch itself saw nothing (its probes answered): the reason is the exchange's."""
    monkeypatch.setattr(sw, "heartbeat_probe", lambda grid, timeout_s: lambda: Probe(OK))
    with pytest.raises(SuperLinkLost, match="lost the round's messages"):
        with sw.watching(object(), 30) as stop:
            assert isinstance(stop, StopRequest)
            stop.lost("the SuperLink lost the round's messages (ObjectPushError: x)")
            stop.lost("a later reason is not kept")
