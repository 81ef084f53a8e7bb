"""The round loop against an in-process Grid (no Ray) and a fake ledger (no PLD)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, Message

from client.app import app as client_app
from fedmeta import protocol as P
from fedmeta.config import Config, load_config
from server import round as round_mod
from server.app import execute
from server.local_grid import InProcessGrid
from server.noise import NoiseSource
from server.report import RoundReport, RunFinished, RunStarted
from server.validation import Accepted

from .fakes import FakeLedger, install_fake_privacy

pytestmark = pytest.mark.unit

SMALL = [
    "federation.backend=inprocess",
    "federation.participants=6",
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
    "output.progress=false",
    "output.plots=false",
    "rounds=6",
]


def small(*extra: str) -> Config:
    return load_config(None, [*SMALL, *extra])


class Recorder:
    def __init__(self) -> None:
        self.started: list[RunStarted] = []
        self.rounds: list[RoundReport] = []
        self.finished: list[RunFinished] = []

    def run_started(self, e: RunStarted) -> None:
        self.started.append(e)

    def round_finished(self, r: RoundReport) -> None:
        self.rounds.append(r)

    def run_finished(self, e: RunFinished) -> None:
        self.finished.append(e)


def run(cfg: Config, out: Path, ledger: FakeLedger, mp: pytest.MonkeyPatch, handler: Any = None,
        resume: bool = False, observers: list[Any] | None = None) -> Any:  # fmt: skip
    install_fake_privacy(mp, ledger)
    grid = InProcessGrid(cfg.federation.participants, handler)
    return execute(cfg, grid, out_dir=out, resume=resume, observers=observers or [], echo=False)


def test_private_run_spends_once_per_round_before_noise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    seen: list[int] = []
    real = round_mod.noised_sum

    def spy(total: torch.Tensor, **kw: Any) -> Any:
        seen.append(ledger.position())  # the spend of this round is already durable
        return real(total, **kw)

    monkeypatch.setattr(round_mod, "noised_sum", spy)
    rec = Recorder()
    result = run(small(), tmp_path, ledger, monkeypatch, observers=[rec])
    assert seen == [1, 2, 3, 4, 5, 6]
    assert [(r.run_id, r.round_index) for r in ledger.records()] == [
        (result.summary["run_id"], i) for i in range(6)
    ]
    s = json.loads((tmp_path / "summary.json").read_text())
    for key in ("rounds_completed", "stopped_reason", "epsilon_spent", "epsilon_participant_level",
                "delta", "epsilon_budget", "final_metric", "final_metric_ci95"):  # fmt: skip
        assert key in s
    assert s["rounds_completed"] == 6 and s["stopped_reason"] == "planned_rounds"
    assert s["epsilon_spent"] == pytest.approx(0.6)
    assert len(rec.started) == 1 and len(rec.rounds) == 6 and len(rec.finished) == 1
    assert all(r.noise_std == pytest.approx(1.0) for r in rec.rounds)
    assert rec.rounds[0].clipped_fraction is None  # private diagnostics are off by default
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    assert len(rows) == 6 and rows[0]["mode"] == "private"
    assert (tmp_path / "checkpoint.pt").is_file()


def test_budget_exhaustion_stops_before_the_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FakeLedger(budget=0.45, eps_per_round=0.1)
    result = run(small("rounds=50"), tmp_path, ledger, monkeypatch)
    s = result.summary
    assert s["stopped_reason"] == "budget_exhausted"
    assert s["rounds_completed"] == 4 == ledger.position()
    assert ledger.spend_calls == 4  # the refused round never reached spend()
    assert s["epsilon_spent"] <= 0.45


def test_non_private_mode_is_labelled_and_leaves_the_ledger_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    rec = Recorder()
    result = run(small("privacy.enabled=false"), tmp_path, ledger, monkeypatch, observers=[rec])
    assert ledger.spend_calls == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["private"] is False and "NON-PRIVATE" in s["mode"]
    assert s["epsilon_spent"] is None
    assert rec.started[0].private is False
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    assert {r["mode"] for r in rows} == {"NON-PRIVATE"}
    assert result.summary["rounds_completed"] == 6


def test_misbehaving_participants_do_not_stop_the_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def handler(msg: Message, ctx: Context) -> Any:
        pid = int(ctx.node_config[P.NODE_PARTITION_ID])
        reply = client_app(msg, ctx)
        if msg.metadata.message_type != P.MSG_TRAIN:
            return reply
        if pid == 0:
            return None  # never answers: a timeout
        if pid == 1:
            raise RuntimeError("client crashed")  # an error reply
        if pid == 2:
            reply.content[P.REPLY][P.ROUND_ID] = 999  # stale round
        if pid == 3:
            return [reply, client_app(msg, ctx)]  # duplicate reply
        return reply

    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    rec = Recorder()
    cfg = small("rounds=8", "sampling.participants_per_round=6", "sampling.task_rate=0.5")
    result = run(cfg, tmp_path, ledger, monkeypatch, handler=handler, observers=[rec])
    assert result.summary["rounds_completed"] == 8 == ledger.position()
    reasons: dict[str, int] = {}
    for r in rec.rounds:
        for k, v in r.rejected_by_reason.items():
            reasons[k] = reasons.get(k, 0) + v
    assert {"timeout", "error_reply", "wrong_round", "duplicate_reply"} <= set(reasons)
    assert all(r.participants_replied >= 1 for r in rec.rounds)


def test_aggregate_divides_by_the_expected_count() -> None:
    from accounting import GaussianRound, TwoStagePoissonScheme

    event = GaussianRound(TwoStagePoissonScheme(10, 2, 0.5), 1e-9)
    acc = [Accepted("a", (0, 1), torch.ones(4, dtype=torch.float64) * 2)]
    src = NoiseSource.create(insecure_test_seed=1)
    update, received, std = round_mod.aggregate(
        acc, dim=4, private=True, clip=1.0, event=event, source=src, expected_tasks=8.0
    )
    assert received == 2
    assert torch.allclose(update, torch.full((4,), 0.25, dtype=torch.float64), atol=1e-6)
    update, _, std = round_mod.aggregate(
        acc, dim=4, private=False, clip=1.0, event=None, source=src, expected_tasks=8.0
    )
    assert std is None and torch.allclose(update, torch.ones(4, dtype=torch.float64))


class Crash(BaseException):
    pass


class CrashAt:
    """Kills the run right after round ``at`` was spent and applied (but maybe not checkpointed)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def run_started(self, e: RunStarted) -> None: ...

    def round_finished(self, r: RoundReport) -> None:
        if r.round_index == self.at:
            raise Crash()

    def run_finished(self, e: RunFinished) -> None: ...


def test_resume_never_respends_and_never_loses_a_spend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    cfg = small("rounds=8", "training.checkpoint_every=4")
    with pytest.raises(Crash):
        run(cfg, tmp_path, ledger, monkeypatch, observers=[CrashAt(6)])
    assert ledger.position() == 6  # rounds 0..5 spent; checkpoint holds rounds 0..3 only
    result = run(cfg, tmp_path, ledger, monkeypatch, resume=True)
    idx = [r.round_index for r in ledger.records()]
    assert idx == list(range(8))  # exactly one spend per round index, none re-spent
    assert len({r.run_id for r in ledger.records()}) == 1
    s = result.summary
    assert s["rounds_completed"] == 8
    assert s["rounds_lost_on_resume"] == [4, 5]


def test_resume_in_sync_continues_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    cfg = small("rounds=8", "training.checkpoint_every=1")
    with pytest.raises(Crash):
        run(cfg, tmp_path, ledger, monkeypatch, observers=[CrashAt(3)])
    result = run(cfg, tmp_path, ledger, monkeypatch, resume=True)
    assert [r.round_index for r in ledger.records()] == list(range(8))
    assert result.summary["rounds_lost_on_resume"] == [] or result.summary[
        "rounds_lost_on_resume"
    ] == [2]


def test_reproducible_with_the_insecure_test_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = small("privacy.insecure_test_seed=5", "rounds=3")
    a = run(cfg, tmp_path / "a", FakeLedger(100.0, 0.1), monkeypatch)
    b = run(cfg, tmp_path / "b", FakeLedger(100.0, 0.1), monkeypatch)
    assert a.summary["final_metric"] == b.summary["final_metric"]
    assert a.summary["noise_secure"] is False
    c = run(small("rounds=3"), tmp_path / "c", FakeLedger(100.0, 0.1), monkeypatch)
    assert c.summary["noise_secure"] is True
    assert np.isfinite(c.summary["final_metric"])


def test_sum_and_norms_reply_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = FakeLedger(budget=100.0, eps_per_round=0.1)
    rec = Recorder()
    cfg = small("federation.reply_format=sum_and_norms", "rounds=3")
    result = run(cfg, tmp_path, ledger, monkeypatch, observers=[rec])
    assert result.summary["rounds_completed"] == 3
    # A private run does not publish realised task counts (they are not accounted) ...
    assert all(r.tasks_requested is None and r.tasks_received is None for r in rec.rounds)
    assert all(not r.rejected_by_reason for r in rec.rounds)
    # ... except on the private-diagnostics opt-in, where every requested task must arrive.
    rec = Recorder()
    cfg = small(
        "federation.reply_format=sum_and_norms", "rounds=3", "metrics.private_diagnostics=true"
    )
    result = run(cfg, tmp_path / "diag", FakeLedger(100.0, 0.1), monkeypatch, observers=[rec])
    assert result.summary["rounds_completed"] == 3
    assert sum(r.tasks_received or 0 for r in rec.rounds) == sum(
        r.tasks_requested or 0 for r in rec.rounds
    )
    assert sum(r.tasks_requested or 0 for r in rec.rounds) > 0


def test_private_run_publishes_no_realised_task_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Poisson stage 2 the realised task count depends on the private data set (and the note
    forbids even normalising by it): it must not reach rounds.csv or the observers by default."""
    rec = Recorder()
    result = run(small("rounds=2"), tmp_path, FakeLedger(100.0, 0.1), monkeypatch, observers=[rec])
    assert result.summary["rounds_completed"] == 2
    assert all(r.tasks_requested is None and r.tasks_received is None for r in rec.rounds)
    csv_text = (tmp_path / "rounds.csv").read_text()
    header, *rows = csv_text.strip().splitlines()
    cols = header.split(",")
    for row in rows:
        cells = dict(zip(cols, row.split(","), strict=False))
        assert cells["tasks_requested"] == "" and cells["tasks_received"] == ""


def test_private_diagnostics_are_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    cfg = small("metrics.private_diagnostics=true", "rounds=2")
    run(cfg, tmp_path, FakeLedger(100.0, 0.1), monkeypatch, observers=[rec])
    assert rec.rounds[0].clipped_fraction is not None
    assert rec.rounds[0].pre_clip_norm_quantiles is not None


def test_spend_refused_by_a_concurrent_run_stops_without_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class RacyLedger(FakeLedger):
        def would_exceed(self, event: Any) -> bool:
            return False  # the dry run passed, but another process spends the rest before us

    ledger = RacyLedger(budget=0.25, eps_per_round=0.1)
    released: list[int] = []
    real = round_mod.noised_sum
    monkeypatch.setattr(
        round_mod, "noised_sum", lambda total, **kw: released.append(1) or real(total, **kw)
    )
    result = run(small("rounds=10"), tmp_path, ledger, monkeypatch)
    assert result.summary["stopped_reason"] == "budget_exhausted"
    assert ledger.position() == 2 and len(released) == 2


def test_a_fresh_run_never_overwrites_a_recorded_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second run without --resume in the same directory is refused before anything is written:
    the first run's checkpoint (its trained model) and summary stay byte for byte."""
    from server.round import FederationError

    run(small("rounds=2"), tmp_path, FakeLedger(100.0, 0.1), monkeypatch)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert "checkpoint.pt" in before
    with pytest.raises(FederationError, match="--resume"):
        run(small("rounds=2"), tmp_path, FakeLedger(100.0, 0.1), monkeypatch)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before
