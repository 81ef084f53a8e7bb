"""Runs over the in-process Grid (no Ray) with a linear fake ledger (no PLD): the round pipeline."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Error, Message

from fedmeta import protocol as P
from fedmeta.accounting import BudgetExhausted, LedgerError
from fedmeta.client.app import app as client_app
from fedmeta.config import Config
from fedmeta.config_io import load_config
from fedmeta.server import release_strategy as release_mod
from fedmeta.server import round as round_mod
from fedmeta.server.app import execute
from fedmeta.server.report import RoundOutcome, RunFinished, RunStarted
from fedmeta.server.startup import FederationError
from fedmeta.simulation.local_grid import InProcessGrid

from .fakes import LinearLedger, fake_ledger, opener

pytestmark = pytest.mark.integration

SMALL = [
    "federation.backend=inprocess",
    "federation.participants=6",
    "federation.round_timeout_s=2",  # in-process replies are immediate: only timeouts wait
    "sampling.participants_per_round=3",
    "sampling.task_rate=0.3",
    "dataset.tasks_per_participant=20",
    "dataset.validation_tasks=8",
    "dataset.test_tasks=16",
    "dataset.probe_tasks=4",
    "training.eval_every=3",
    "training.checkpoint_every=2",
    "training.meta_lr=0.01",
    "privacy.noise_multiplier=1.0",
    # The fixed-clip path (noised_sum); the adaptive path has its own tests
    # (test_adaptive_clipping.py) and runs in the end-to-end tests, where it is the default.
    "privacy.adaptive_clipping.enabled=false",
    "output.progress=false",
    "output.plots=false",
    "rounds=6",
]


def small(*extra: str) -> Config:
    return load_config(None, [*SMALL, *extra])


class Recorder:
    def __init__(self) -> None:
        self.started: list[RunStarted] = []
        self.rounds: list[RoundOutcome] = []
        self.finished: list[RunFinished] = []

    def run_started(self, e: RunStarted) -> None:
        self.started.append(e)

    def round_finished(self, r: RoundOutcome) -> None:
        self.rounds.append(r)

    def run_finished(self, e: RunFinished) -> None:
        self.finished.append(e)


def run(cfg: Config, out: Path, ledger: LinearLedger, handler: Any = None, resume: bool = False,
        observers: list[Any] | None = None) -> Any:  # fmt: skip
    grid = InProcessGrid(cfg.federation.participants, handler)
    return execute(cfg, grid, out_dir=out, resume=resume, observers=observers or [], echo=False,
                   open_ledger=opener(ledger))  # fmt: skip


def test_private_run_spends_once_per_round_before_noise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = fake_ledger(100.0, 0.1)
    seen: list[int] = []
    real = release_mod.noised_sum

    def spy(total: torch.Tensor, **kw: Any) -> Any:
        seen.append(ledger.position())  # the spend of this round is already durable
        return real(total, **kw)

    monkeypatch.setattr(release_mod, "noised_sum", spy)
    rec = Recorder()
    result = run(small(), tmp_path, ledger, observers=[rec])
    assert seen == [1, 2, 3, 4, 5, 6]
    assert [(r.run_id, r.round_index) for r in ledger.records()] == [
        (result.summary["run_id"], i) for i in range(6)
    ]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["rounds_completed"] == 6 and s["stopped_reason"] == "planned_rounds"
    assert s["epsilon_spent"] == pytest.approx(0.6) and s["neighbouring"] == "add_remove"
    assert len(rec.started) == 1 and len(rec.rounds) == 6 and len(rec.finished) == 1
    assert [r.noise_std for r in rec.rounds] == [1.0] * 6
    assert [r.ledger_position for r in rec.rounds] == [1, 2, 3, 4, 5, 6]
    assert all(r.diagnostics is None for r in rec.rounds)  # private diagnostics are off
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    assert len(rows) == 6 and {r["mode"] for r in rows} == {"private"}
    assert (tmp_path / "checkpoint.pt").is_file()


def test_budget_exhaustion_stops_before_the_round(tmp_path: Path) -> None:
    ledger = fake_ledger(0.45, 0.1)
    s = run(small("rounds=50"), tmp_path, ledger).summary
    assert s["stopped_reason"] == "budget_exhausted"
    assert s["rounds_completed"] == 4 == ledger.position()
    assert ledger.spend_calls == 4  # the refused round never reached spend()
    assert s["plan"]["rounds_affordable"] == 4 and s["plan"]["rounds_to_run"] == 4


def test_non_private_mode_is_labelled_and_leaves_the_ledger_alone(tmp_path: Path) -> None:
    ledger = fake_ledger(100.0, 0.1)
    rec = Recorder()
    result = run(small("privacy.enabled=false"), tmp_path, ledger, observers=[rec])
    assert ledger.spend_calls == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["private"] is False and "NON-PRIVATE" in s["mode"] and s["epsilon_spent"] is None
    assert rec.started[0].private is False and all(r.noise_std is None for r in rec.rounds)
    assert all(r.diagnostics is not None for r in rec.rounds)  # nothing to protect
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    assert {r["mode"] for r in rows} == {"NON-PRIVATE"} and "tasks_requested" in rows[0]
    assert result.summary["rounds_completed"] == 6


def _reply(msg: Message, ctx: Context, **change: Any) -> Message:
    honest = client_app(msg, ctx)
    reply = replace(P.decode_gradient_reply(honest.content, shared=True), **change)  # in-process
    return Message(P.encode_gradient_reply(reply), reply_to=msg)


def test_each_failure_is_counted_once_with_its_true_reason(tmp_path: Path) -> None:
    """Every participant is sampled every round, each misbehaving in its own way."""

    def handler(msg: Message, ctx: Context) -> Any:
        pid = int(ctx.node_config[P.NODE_PARTITION_ID])
        if msg.metadata.message_type != P.MSG_TRAIN or pid == 6:
            return client_app(msg, ctx)
        if pid == 0:
            return None  # never answers: a timeout
        if pid == 1:  # what the SuperLink sends for a dead node (from its own node id)
            return Message(Error(code=5, reason="node unavailable"), reply_to=msg)
        if pid == 2:
            raise RuntimeError("client crashed")  # an error reply
        if pid == 3:
            return _reply(msg, ctx, round_id=999)  # a stale round
        if pid == 4:
            reply = client_app(msg, ctx)
            reply.content.config_records[P.REPLY_RECORD]["version"] = P.PROTOCOL_VERSION - 1
            return reply
        return [client_app(msg, ctx), client_app(msg, ctx)]  # pid 5: a duplicate

    every = {"timeout": 1, "node_unavailable": 1, "error_reply": 1, "wrong_round": 1,
             "protocol_version": 1}  # fmt: skip
    rec = Recorder()
    cfg = small("federation.participants=7", "sampling.participants_per_round=7", "rounds=3",
                "privacy.enabled=false")  # fmt: skip
    result = run(cfg, tmp_path / "n", fake_ledger(100.0, 0.1), handler=handler, observers=[rec])
    assert result.summary["rounds_completed"] == 3
    for r in rec.rounds:
        assert dict(r.failures) == every
        assert dict(r.stray_replies) == {"duplicate_reply": 1}
        assert (r.participants_sampled, r.participants_replied, r.participants_failed) == (7, 2, 5)
    # A private run releases only what follows availability (server/fedmeta/server/releases.py); the
    # rest is a
    # private diagnostic, here because the run opted in.
    rec = Recorder()
    cfg = small("federation.participants=7", "sampling.participants_per_round=7", "rounds=3",
                "metrics.private_diagnostics=true")  # fmt: skip
    run(cfg, tmp_path / "p", fake_ledger(100.0, 0.1), handler=handler, observers=[rec])
    for r in rec.rounds:
        assert dict(r.failures) == {"node_unavailable": 1} and dict(r.stray_replies) == {}
        assert (r.participants_sampled, r.participants_replied, r.participants_failed) == (7, 6, 1)
        assert r.diagnostics is not None and dict(r.diagnostics.failures) == every
        assert dict(r.diagnostics.stray_replies) == {"duplicate_reply": 1}
        assert r.diagnostics.replies_accepted == 2


def test_private_round_pads_then_spends_then_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spend's time follows the public minimum (not the round's work), and precedes noise."""
    ledger = fake_ledger(100.0, 0.1)
    events: list[str] = []
    real_pad, real_spend, real_noise = round_mod._pad, ledger.spend, release_mod.noised_sum

    def pad(started: float, minimum: float) -> None:
        events.append(f"pad {minimum:g}")
        real_pad(started, minimum)

    def spend(*args: Any, **kw: Any) -> Any:
        events.append("spend")
        return real_spend(*args, **kw)

    def noise(total: torch.Tensor, **kw: Any) -> Any:
        events.append("noise")
        return real_noise(total, **kw)

    monkeypatch.setattr(round_mod, "_pad", pad)
    monkeypatch.setattr(ledger, "spend", spend)
    monkeypatch.setattr(release_mod, "noised_sum", noise)
    run(small("rounds=2", "federation.round_min_seconds=0.2"), tmp_path, ledger)
    assert events == ["pad 0.2", "spend", "noise"] * 2


def test_every_stage_one_participant_is_contacted_even_without_tasks(tmp_path: Path) -> None:
    """With a tiny stage-2 rate most sampled participants draw no task; all are still asked, so
    who is contacted (and who replies) says nothing about stage 2."""
    asked: list[tuple[int, int]] = []

    def handler(msg: Message, ctx: Context) -> Any:
        if msg.metadata.message_type == P.MSG_TRAIN:
            request = P.decode_gradient_request(msg.content)
            asked.append((request.round_id, len(request.task_ids)))
        return client_app(msg, ctx)

    rec = Recorder()
    run(small("sampling.task_rate=0.02", "rounds=8"), tmp_path, fake_ledger(100.0, 0.1),
        handler=handler, observers=[rec])  # fmt: skip
    per_round = [sum(1 for r, _ in asked if r == i) for i in range(8)]
    assert per_round == [3] * 8
    assert sum(1 for _, n in asked if n == 0) > 0  # empty requests happened and were sent
    assert [(r.participants_sampled, r.participants_replied) for r in rec.rounds] == [(3, 3)] * 8


def test_the_noisy_sum_is_divided_by_the_public_normaliser(tmp_path: Path) -> None:
    """Through the real pipeline: the update is (sum + noise) / normaliser, never over the count."""
    rec = Recorder()
    cfg = small("privacy.normaliser=8", "rounds=1", "sampling.task_rate=1.0")
    updates: list[torch.Tensor] = []
    real_step = round_mod.TrainingState.step

    def step(self: round_mod.TrainingState, update: torch.Tensor, index: int) -> None:
        updates.append(update.clone())
        real_step(self, update, index)

    released: list[torch.Tensor] = []
    real = release_mod.noised_sum

    def spy(total: torch.Tensor, **kw: Any) -> Any:
        out = real(total, **kw)
        released.append(out.value.clone())
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(round_mod.TrainingState, "step", step)
        mp.setattr(release_mod, "noised_sum", spy)
        run(cfg, tmp_path, fake_ledger(100.0, 0.1), observers=[rec])
    assert len(updates) == 1 and torch.equal(updates[0], released[0] / 8)
    assert rec.rounds[0].noise_std == 1.0


class Crash(BaseException):
    pass


class CrashAt(Recorder):
    """Kills the run right after round ``at`` was spent and applied (maybe not checkpointed)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def round_finished(self, r: RoundOutcome) -> None:
        if r.round == self.at:
            raise Crash()


def test_resume_never_respends_and_never_loses_a_spend(tmp_path: Path) -> None:
    ledger = fake_ledger(100.0, 0.1)
    cfg = small("rounds=8", "training.checkpoint_every=4")
    with pytest.raises(Crash):
        run(cfg, tmp_path, ledger, observers=[CrashAt(6)])
    assert ledger.position() == 6  # rounds 1..6 spent; the checkpoint holds rounds 1..4 only
    result = run(cfg, tmp_path, ledger, resume=True)
    assert [r.round_index for r in ledger.records()] == list(range(8))
    assert len({r.run_id for r in ledger.records()}) == 1
    assert result.summary["rounds_completed"] == 8
    assert result.summary["rounds_lost_on_resume"] == [5, 6]


def test_resume_after_a_crash_between_spend_and_checkpoint(tmp_path: Path) -> None:
    """Round 3 is spent and its observers run before its checkpoint: exactly round 3 is lost."""
    ledger = fake_ledger(100.0, 0.1)
    cfg = small("rounds=8", "training.checkpoint_every=1")
    with pytest.raises(Crash):
        run(cfg, tmp_path, ledger, observers=[CrashAt(3)])
    result = run(cfg, tmp_path, ledger, resume=True)
    assert [r.round_index for r in ledger.records()] == list(range(8))
    assert result.summary["rounds_lost_on_resume"] == [3]


def test_resume_refuses_another_or_an_emptier_ledger(tmp_path: Path) -> None:
    """A resume must never spend from a ledger other than the run's, nor one that lost records
    (a relative path resolved elsewhere, a restored old backup, a copy without its journal)."""
    cfg = small("rounds=8", "training.checkpoint_every=2")
    spent = fake_ledger(100.0, 0.1)
    with pytest.raises(Crash):
        run(cfg, tmp_path, spent, observers=[CrashAt(5)])
    with pytest.raises(LedgerError, match="a different ledger"):
        run(cfg, tmp_path, fake_ledger(100.0, 0.1), resume=True)
    emptier = fake_ledger(100.0, 0.1, ledger_id=spent.ledger_id)
    with pytest.raises(LedgerError, match="behind"):
        run(cfg, tmp_path, emptier, resume=True)
    assert emptier.spend_calls == 0 and spent.position() == 5


def test_reproducible_with_the_insecure_test_seed_and_labelled(tmp_path: Path) -> None:
    cfg = small("privacy.insecure_test_seed=5", "rounds=3")
    a = run(cfg, tmp_path / "a", fake_ledger(100.0, 0.1))
    b = run(cfg, tmp_path / "b", fake_ledger(100.0, 0.1))
    pa = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["params"]
    pb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["params"]
    assert torch.equal(pa, pb) and a.summary["final_metric"] == b.summary["final_metric"]
    assert a.summary["noise_secure"] is False
    c = run(small("rounds=3"), tmp_path / "c", fake_ledger(100.0, 0.1))
    pc = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=True)["params"]
    assert c.summary["noise_secure"] is True and not torch.equal(pa, pc)


def test_sum_and_norms_reply_format(tmp_path: Path) -> None:
    rec = Recorder()
    cfg = small("federation.reply_format=sum_and_norms", "rounds=3",
                "metrics.private_diagnostics=true")  # fmt: skip
    result = run(cfg, tmp_path, fake_ledger(100.0, 0.1), observers=[rec])
    assert result.summary["rounds_completed"] == 3
    assert all(not r.failures for r in rec.rounds)
    diag = [r.diagnostics for r in rec.rounds]
    assert all(d is not None and d.tasks_received == d.tasks_requested for d in diag)
    assert sum(d.tasks_requested for d in diag if d is not None) > 0


def test_private_runs_publish_no_stage_two_facts_unless_opted_in(tmp_path: Path) -> None:
    rec = Recorder()
    run(small("rounds=2"), tmp_path / "p", fake_ledger(100.0, 0.1), observers=[rec])
    assert all(r.diagnostics is None for r in rec.rounds) and rec.started[0].diagnostics is False
    header = (tmp_path / "p" / "rounds.csv").read_text().splitlines()[0].split(",")
    assert not {"tasks_requested", "tasks_received", "round_seconds"} & set(header)
    rec = Recorder()
    run(small("rounds=2", "metrics.private_diagnostics=true"), tmp_path / "d",
        fake_ledger(100.0, 0.1), observers=[rec])  # fmt: skip
    d = rec.rounds[0].diagnostics
    assert d is not None and d.clipped_fraction is not None and d.norm_quantiles is not None
    header = (tmp_path / "d" / "rounds.csv").read_text().splitlines()[0].split(",")
    assert {"tasks_requested", "tasks_received", "round_seconds"} <= set(header)


def test_spend_refused_by_a_concurrent_run_stops_without_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class RacyLedger(LinearLedger):
        """The dry run passes, but another process spends the rest before this run's spend."""

        def would_exceed(self, event: Any) -> bool:
            return False

        def spend(self, event: Any, run_id: str, round_index: int) -> Any:
            if LinearLedger.would_exceed(self, event):
                self.spend_calls += 1
                raise BudgetExhausted("spent meanwhile", epsilon_after=1.0, epsilon_budget=0.25)
            return super().spend(event, run_id, round_index)

    ledger = RacyLedger(epsilon_budget=0.25, eps_per_round=0.1, delta=1e-5)
    released: list[int] = []
    real = release_mod.noised_sum
    monkeypatch.setattr(release_mod, "noised_sum",
                        lambda total, **kw: released.append(1) or real(total, **kw))  # fmt: skip
    result = run(small("rounds=10"), tmp_path, ledger)
    assert result.summary["stopped_reason"] == "budget_exhausted"
    assert ledger.position() == 2 and len(released) == 2


def test_a_fresh_run_never_overwrites_and_a_resume_needs_a_run(tmp_path: Path) -> None:
    run(small("rounds=2"), tmp_path, fake_ledger(100.0, 0.1))

    def recorded() -> dict[str, bytes]:  # the run's files; the lock names its latest holder
        return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != ".fedmeta.lock"}

    before = recorded()
    assert "checkpoint.pt" in before
    with pytest.raises(FederationError, match="--resume"):
        run(small("rounds=2"), tmp_path, fake_ledger(100.0, 0.1))
    assert recorded() == before
    with pytest.raises(FederationError, match="no checkpoint"):
        run(small("rounds=2"), tmp_path / "empty", fake_ledger(100.0, 0.1), resume=True)
