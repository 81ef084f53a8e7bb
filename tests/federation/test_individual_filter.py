"""The individual filter (issue 52, item 6): a participant whose data is spent takes no part.

It is sampled and asked exactly as before, its replies never reach the sum, the run completes its
planned rounds and publishes the mechanism's own epsilon; who was excluded is the operator's alone
(``fedmeta ledger show --participants``, the operator log). docs/privacy.md, "Overlap and the
individual filter"; server/fedmeta/server/individual_filter.py.
"""

from __future__ import annotations

import csv
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message

from fedmeta import protocol as P
from fedmeta.accounting import (
    BudgetLedger,
    FlatPoissonScheme,
    GaussianRound,
    Hold,
    Participant,
    epsilon,
)
from fedmeta.accounting.levels import AnyRound
from fedmeta.checkpoint import load_checkpoint
from fedmeta.cli import main
from fedmeta.client.app import app as client_app
from fedmeta.server.app import execute
from fedmeta.server.budget_keys import budget_key, ledger_participants
from fedmeta.server.individual_filter import IndividualFilter
from fedmeta.server.operator_log import operator_log_path
from fedmeta.server.transport import Registered
from fedmeta.simulation.local_grid import InProcessGrid

from .fakes import LinearLedger, opener
from .item_budget import registered as _registered
from .test_overlap_release import BUDGET, DELTA, _cfg, _world
from .test_reliability import StopAfter
from .test_round import small

pytestmark = pytest.mark.integration


@dataclass
class SpentFor(LinearLedger):
    """The fake ledger, with participant ``spent``'s data unable to afford any round."""

    spent: str = "0"

    def affording(
        self, participants: Sequence[Participant], event: AnyRound, *, run_id: str, hold: Hold
    ) -> frozenset[str]:
        taking = super().affording(participants, event, run_id=run_id, hold=hold)
        return taking - {self.spent}


def _flipped(asked: list[int]) -> Any:
    """Participant 0 answers every request, with its gradients negated (a planted contribution)."""

    def handler(msg: Message, ctx: Context) -> Any:
        pid = int(ctx.node_config[P.NODE_PARTITION_ID])
        honest = client_app(msg, ctx)
        if msg.metadata.message_type != P.MSG_TRAIN or pid != 0:
            return honest
        asked.append(1)
        reply = P.decode_gradient_reply(honest.content, shared=True)
        grads = None if reply.grads is None else -reply.grads
        grad_sum = None if reply.grad_sum is None else -reply.grad_sum
        planted = replace(reply, grads=grads, grad_sum=grad_sum)
        return Message(P.encode_gradient_reply(planted), reply_to=msg)

    return handler


def _run(tmp: Path, ledger: LinearLedger, flip: bool) -> dict[str, Any]:
    cfg = small("federation.participants=3", "sampling.participants_per_round=3", "rounds=3",
                "privacy.insecure_test_seed=5", "training.checkpoint_every=1")  # fmt: skip
    asked: list[int] = []
    handler = _flipped(asked) if flip else None
    execute(cfg, InProcessGrid(3, handler), out_dir=tmp, echo=False, open_ledger=opener(ledger))
    rows = list(csv.DictReader((tmp / "rounds.csv").open()))
    summary = json.loads((tmp / "summary.json").read_text())
    ckpt = load_checkpoint(tmp)
    assert ckpt is not None
    return {"params": ckpt.params, "rows": rows, "summary": summary,
            "asked": len(asked)}  # fmt: skip


def test_an_excluded_participants_replies_never_reach_the_sum(tmp_path: Path) -> None:
    """Participant 0's planted gradients move nothing when its allowance is 0, and do otherwise."""
    honest = _run(tmp_path / "honest", SpentFor(100.0, eps_per_round=0.1), flip=False)
    planted = _run(tmp_path / "planted", SpentFor(100.0, eps_per_round=0.1), flip=True)
    assert planted["asked"] == 3  # sampled and asked every round, as before
    assert torch.equal(honest["params"], planted["params"])
    for run in (honest, planted):
        assert run["summary"]["rounds_completed"] == 3
        assert run["summary"]["stopped_reason"] == "planned_rounds"
        assert [r["participants_replied"] for r in run["rows"]] == ["3", "3", "3"]
    # The control: the same planted replies, participant 0 taking part, move the model.
    taking_part = _run(tmp_path / "control", LinearLedger(100.0, eps_per_round=0.1), flip=True)
    assert not torch.equal(honest["params"], taking_part["params"])


def test_spent_data_takes_no_part_and_only_the_operator_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real ledger: participant 0 holds a drawing 2 of 4 rounds' worth were spent on.

    The run completes its 4 planned rounds and publishes its own epsilon (4 rounds of its event);
    participant 0 takes part in 2, the ledger charges it no further, and says so to the operator.
    """
    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FEDMETA_CACHE_DIR", str(tmp_path / "cache"))
    data, db = _world(tmp_path, "recorded")
    cfg = _cfg(data, db)
    result = execute(cfg, InProcessGrid(2), out_dir=tmp_path / "out", observers=[], echo=False)
    summary, run_id = result.summary, result.summary["run_id"]
    assert summary["rounds_completed"] == 4 and summary["stopped_reason"] == "planned_rounds"
    with BudgetLedger.open_readonly(db, summary["federation_id"]) as ledger:
        ((event, spends),) = ledger.run_rounds(run_id)
        assert isinstance(event, GaussianRound) and spends == 4 and ledger.position() == 2 + 4
        assert summary["epsilon_spent"] == pytest.approx(epsilon([(event, 4)], DELTA, "task"))
        rows = ledger.participants()
        assert all(p.epsilon <= BUDGET * (1 + 1e-9) for p in rows)  # nobody over the budget
        assert ledger.reservations() == []  # the run ended: its reservation with it
        charged = {name: sorted(p.rounds for p in rows if p.name == name) for name in ("0", "1")}
        # Participant 0: its recorded drawing's record 2 + 2, its new items 2 of the run's 4.
        assert charged == {"0": [2, 4], "1": [2, 4]}
        # Neither participant's data affords a fifth round of the event: the 4-round records.
        members = {r.participant_id: r for r in _registered(cfg)}
        who = ledger_participants(budget_key(cfg.dataset.name, cfg.seed), members, members)
        assert ledger.affording(who, event, run_id=run_id, hold=Hold(2)) == frozenset()
    log = operator_log_path(run_id).read_text()
    assert "round 3 participant 0: allowance spent" in log and "participant 1" not in log
    assert log.count("participant 0") == 1  # named once, when its part ends
    capsys.readouterr()
    assert main(["ledger", "show", "--db", str(db), "--participants"]) == 0
    shown = capsys.readouterr().out
    assert "4 participant(s)" in shown and f"(took part in run {run_id}: 2 of 4)" in shown
    released = [tmp_path / "out" / "summary.json", tmp_path / "out" / "rounds.csv"]
    assert not any("allowance" in path.read_text() for path in released)


def test_a_participant_first_seen_mid_run_is_decided_as_from_a_start_then() -> None:
    """Those registered at the start read the ledger as it was then, never another run's later
    spends; a participant first seen mid-run renews the reservation and reads the ledger as it
    is when it is first seen (the other run's spends included), as a run starting then would; a
    run starting later counts the first run's reserved rounds not yet spent. The operator log
    names whoever stops taking part, once."""
    ledger = LinearLedger(epsilon_budget=1.0, eps_per_round=0.125)  # 8 rounds fit, for everyone
    cfg = small("federation.participants=2", "sampling.participants_per_round=2", "rounds=6")
    members = {str(i): Registered(str(i), 100 + i, 20, "") for i in range(2)}
    event = GaussianRound(FlatPoissonScheme(0.1), 1.0)
    for i in range(3):
        ledger.spend(event, "earlier", i)

    def filtered(run_id: str) -> IndividualFilter:
        reserve = lambda pids: ledger.reserve([], event, 6, run_id=run_id)  # noqa: E731
        return IndividualFilter(run_id, reserve, {})

    run, key = filtered("run"), budget_key(cfg.dataset.name, cfg.seed)
    for i in range(3):
        assert run.apply(ledger, key, members, ["0"], event) == frozenset()  # 3 + i + 1 <= 8
        ledger.spend(event, "run", i)
    for i in range(2):  # another run's, after the start
        ledger.spend(event, "concurrent", i)
    # "0": 3 + 3 + 1 <= 8 (the concurrent spends not read); "1", first seen now: 8 + 1 > 8.
    assert run.apply(ledger, key, members, ["0", "1"], event) == {"1"}
    assert "round 4 participant 1: allowance spent" in operator_log_path("run").read_text()
    later = filtered("later")  # 8 recorded, and "run"'s 6 reserved less its 3 spent since
    assert later.apply(ledger, key, members, ["0", "1"], event) == {"0", "1"}
    assert ledger.affording([], event, run_id="later", hold=Hold(8)) == frozenset()  # 8 + 1
    log = operator_log_path("run").read_text()
    assert log.count("participant 1") == 1 and "participant 0" not in log


def test_a_resumed_run_decides_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """A resume reads the ledger as it finds it, its own spends in it, counted once.

    An earlier run spent 2 of the 4 rounds the budget affords: every participant may take part in
    2 of this run's 4. Stopped after round 1 and resumed, they still take part in round 2 (had
    the resume counted its own spend twice, as found and as its own, they would have stopped
    after 1); rounds 3-4 are charged to nobody.
    """
    ledger, stop = LinearLedger(1.0, eps_per_round=0.25), threading.Event()
    event = GaussianRound(FlatPoissonScheme(0.1), 1.0)
    ledger.spend(event, "earlier", 0)
    ledger.spend(event, "earlier", 1)
    cfg = small("rounds=4")
    stopped = execute(cfg, InProcessGrid(6), out_dir=tmp_path, observers=[StopAfter(1, stop)],
                      echo=False, open_ledger=opener(ledger), stop=stop)  # fmt: skip
    assert stopped.summary["stopped_reason"] == "interrupted" and ledger.position() == 3
    run_id = stopped.summary["run_id"]
    assert [r.rounds for r in ledger._reservations.values()] == [4]  # kept for the resume
    resumed = execute(cfg, InProcessGrid(6), out_dir=tmp_path, resume=True, echo=False,
                      open_ledger=opener(ledger))  # fmt: skip
    assert resumed.summary["rounds_completed"] == 4
    assert resumed.summary["stopped_reason"] == "planned_rounds"
    assert ledger.epsilon() == 1.0  # the earlier run's 2 and this run's first 2: charged
    assert ledger.run_epsilon(resumed.summary["run_id"]) == 1.0  # its own 4, as published
    assert resumed.summary["run_id"] == run_id and ledger._reservations == {}  # ended


def test_the_operator_ends_a_crashed_runs_reservation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fedmeta ledger show` lists a run's reservation; `ledger end-reservation` ends it, once."""
    db = tmp_path / "ledger.sqlite"
    event = GaussianRound(FlatPoissonScheme(0.1), 1.0)
    with BudgetLedger.open(db, "fed", 2.0, DELTA) as ledger:
        ledger.reserve([Participant("data-a", "a")], event, 7, run_id="crashed")
    capsys.readouterr()
    assert main(["ledger", "show", "--db", str(db)]) == 0
    assert "run crashed in progress: up to 7 round(s) reserved" in capsys.readouterr().out
    end = ["ledger", "end-reservation", "--db", str(db), "--federation", "fed", "--run", "crashed"]
    assert main(end) == 0
    assert "ended the reservation of run crashed" in capsys.readouterr().out
    assert main(end) == 0
    assert "holds no reservation" in capsys.readouterr().out
    with BudgetLedger.open_readonly(db, "fed") as ledger:
        assert ledger.reservations() == []
        assert ledger.reserve([], event, 1, run_id="next").others == ()
