"""Membership: nodes that join late, leave, come back, fail repeatedly or claim another identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Context, Message

from fedmeta import protocol as P
from fedmeta.client.app import app as client_app
from fedmeta.server.app import execute
from fedmeta.server.report import RoundOutcome
from fedmeta.server.transport import RegistrationError, key_fingerprint
from fedmeta.simulation.local_grid import InProcessGrid

from .fakes import fake_ledger, opener
from .test_round import Recorder, small

pytestmark = pytest.mark.integration


def _key() -> bytes:
    private = ec.generate_private_key(ec.SECP384R1())
    return private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class Choreography(Recorder):
    """Changes which nodes are online after given rounds (an observer sees every round end)."""

    def __init__(self, grid: InProcessGrid, changes: dict[int, Any]) -> None:
        super().__init__()
        self.grid, self.changes = grid, changes

    def round_finished(self, r: RoundOutcome) -> None:
        super().round_finished(r)
        if r.round in self.changes:
            self.changes[r.round](self.grid)


def _run(cfg: Any, grid: InProcessGrid, tmp_path: Path, observers: list[Any]) -> tuple[Any, Any]:
    ledger = fake_ledger(100.0, 0.1)
    result = execute(cfg, grid, out_dir=tmp_path, observers=observers, echo=False,
                     open_ledger=opener(ledger))  # fmt: skip
    return result, ledger


def test_late_joiners_are_sampled_and_the_population_is_accounted_per_round(
    tmp_path: Path,
) -> None:
    grid = InProcessGrid(6)
    grid.online = set(grid.node_ids[:3])
    cfg = small("rounds=6", "federation.min_participants=3", "sampling.participants_per_round=3")
    late = Choreography(grid, {2: lambda g: g.online.update(g.node_ids)})
    result, ledger = _run(cfg, grid, tmp_path, [late])
    assert result.summary["rounds_completed"] == 6
    assert [r.participants_registered for r in late.rounds] == [3, 3, 6, 6, 6, 6]
    populations = [e.scheme.participants for e, _ in ledger.rounds()]
    assert sorted(populations) == [3, 6]  # two groups of identical rounds
    assert dict((e.scheme.participants, n) for e, n in ledger.rounds()) == {3: 2, 6: 4}


def test_a_run_waits_for_min_participants_then_refuses_with_one_line(tmp_path: Path) -> None:
    grid = InProcessGrid(6)
    grid.online = set(grid.node_ids[:2])
    cfg = small("federation.min_participants=3", "federation.register_timeout_s=0.5")
    with pytest.raises(RegistrationError, match=r"2 participants registered .* >= 3"):
        _run(cfg, grid, tmp_path, [])


def test_a_dead_node_is_counted_once_then_suspended_until_it_reconnects(tmp_path: Path) -> None:
    grid = InProcessGrid(4)
    dead = grid.node_ids[0]

    def handler(msg: Message, ctx: Context) -> Any:
        if msg.metadata.message_type == P.MSG_TRAIN and ctx.node_id == dead and not rec.back:
            return None  # the node's process died: requests time out
        return client_app(msg, ctx)

    class Back(Recorder):
        back = False

        def round_finished(self, r: RoundOutcome) -> None:
            super().round_finished(r)
            if r.round == 5:  # the node drops off the grid, then reconnects
                grid.online.discard(dead)
            if r.round == 6:
                grid.online.add(dead)
                self.back = True

    grid.handler = handler
    rec = Back()
    # Non-private: a timeout is released and suspends (a private run: the test below).
    cfg = small("federation.participants=4", "sampling.participants_per_round=4", "rounds=9",
                "federation.max_consecutive_failures=3", "privacy.enabled=false")  # fmt: skip
    _run(cfg, grid, tmp_path, [rec])
    failed = [r.failures.get("timeout", 0) for r in rec.rounds]
    assert failed[:3] == [1, 1, 1] and sum(failed) == 3  # counted once per round, then not asked
    assert [r.participants_suspended for r in rec.rounds[:5]] == [0, 0, 1, 1, 1]
    # Suspended in rounds 4-5, gone in round 6, registered again from round 7.
    assert [r.participants_sampled for r in rec.rounds] == [4, 4, 4, 3, 3, 3, 4, 4, 4]
    assert all(r.participants_failed == 0 for r in rec.rounds[3:])


def test_a_private_run_neither_releases_nor_suspends_on_timeouts(tmp_path: Path) -> None:
    """A timeout can follow the stage-2 count: private, and it never changes who is sampled."""
    grid = InProcessGrid(4)
    slow = grid.node_ids[0]

    def handler(msg: Message, ctx: Context) -> Any:
        if msg.metadata.message_type == P.MSG_TRAIN and ctx.node_id == slow:
            return None  # never answers in time
        return client_app(msg, ctx)

    grid.handler = handler
    rec = Recorder()
    cfg = small("federation.participants=4", "sampling.participants_per_round=4", "rounds=4",
                "federation.max_consecutive_failures=2", "federation.round_timeout_s=0.3",
                "metrics.private_diagnostics=true")  # fmt: skip
    _run(cfg, grid, tmp_path, [rec])
    assert [r.participants_suspended for r in rec.rounds] == [0] * 4
    assert [r.participants_sampled for r in rec.rounds] == [4] * 4
    assert all(dict(r.failures) == {} and r.participants_failed == 0 for r in rec.rounds)
    assert all(r.diagnostics and dict(r.diagnostics.failures) == {"timeout": 1} for r in rec.rounds)


def test_node_keys_bind_participant_ids(tmp_path: Path) -> None:
    grid = InProcessGrid(4)
    keys = {n: _key() for n in grid.node_ids}
    grid.public_keys = dict(keys)
    fingerprints = [key_fingerprint(keys[n]) for n in grid.node_ids]
    # Participants 0 and 1 are bound to their own keys, 2 is bound to node 3's key (node 2 holds
    # an unregistered key), and node 3 claims participant 3 with participant 2's key.
    bindings = {"0": fingerprints[0], "1": fingerprints[1], "2": fingerprints[3]}
    cfg = small("federation.participants=4", "sampling.participants_per_round=2", "rounds=3",
                *[f'federation.node_keys.{p}="{k}"' for p, k in bindings.items()])  # fmt: skip
    rec = Recorder()
    result, ledger = _run(cfg, grid, tmp_path, [rec])
    assert result.summary["participants_registered"] == 2
    assert dict(rec.rounds[0].nodes_refused) == {"unbound_node": 1, "wrong_key": 1}
    # Counted once: a node refused for the whole run is not asked again before every round.
    assert all(not r.nodes_refused for r in rec.rounds[1:]), [r.nodes_refused for r in rec.rounds]
    assert {e.scheme.participants for e, _ in ledger.rounds()} == {2}
    assert fingerprints[0].startswith("SHA256:") and len(fingerprints[0]) == 50


def test_a_node_without_an_authentication_key_has_no_fingerprint() -> None:
    """Flower's simulation engine gives each node 32 random bytes, not a PEM key."""
    import secrets

    assert key_fingerprint(secrets.token_bytes(32)) == "" and key_fingerprint(b"") == ""
    assert key_fingerprint(_key()).startswith("SHA256:")
