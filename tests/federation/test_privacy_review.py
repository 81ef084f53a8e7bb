"""Regression tests from the privacy reviews: what is accounted, refused, printed and stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message

from fedmeta import protocol as P
from fedmeta.accounting import (
    PARTICIPANT_LEVEL_NOT_MEANINGFUL,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
)
from fedmeta.client.app import app as client_app
from fedmeta.config_io import load_config
from fedmeta.server.app import execute
from fedmeta.server.outputs import format_summary
from fedmeta.server.plan import build_plan
from fedmeta.server.transport import RegistrationError
from fedmeta.simulation.local_grid import InProcessGrid

from .fakes import fake_ledger, opener
from .test_round import small

pytestmark = pytest.mark.integration


def _short_participant(short: int, count: int) -> Any:
    """A handler whose participant ``short`` registers only ``count`` tasks."""

    def handler(msg: Message, ctx: Context) -> Any:
        reply = client_app(msg, ctx)
        if msg.metadata.message_type == P.MSG_REGISTER:
            if int(ctx.node_config[P.NODE_PARTITION_ID]) == short:
                reg = P.decode_registration(reply.content)
                reg = P.Registration(reg.participant_id, count, reg.data_fingerprint)
                return Message(P.encode_registration(reg), reply_to=msg)
        return reply

    return handler


@pytest.mark.unit
def test_add_remove_keeps_task_counts_private_and_replace_one_uses_them() -> None:
    counts = {"0": 25, "1": 40, "2": 60}
    fixed = ["sampling.stage2=fixed", "sampling.tasks_per_round=5", "sampling.min_tasks=20",
             "federation.participants=3", "sampling.participants_per_round=2",
             "privacy.noise_multiplier=1.0"]  # fmt: skip
    plan = build_plan(load_config(None, fixed), counts)
    assert isinstance(plan.scheme, TwoStageFixedScheme) and plan.scheme.min_tasks == 20
    assert plan.normaliser == 10.0 and plan.privacy is not None
    event = plan.privacy.event
    assert event.neighbouring == "add_remove" and event.participant_cap == 5
    replaced = build_plan(load_config(None, [*fixed, "privacy.neighbouring=replace_one"]), counts)
    assert replaced.scheme.min_tasks == 25  # type: ignore[union-attr]
    assert replaced.privacy is not None
    assert replaced.privacy.event.neighbouring == "replace_one"
    # Poisson stage 2: the normaliser comes from the configuration, never from the real counts.
    poisson = build_plan(load_config(None, ["dataset.tasks_per_participant=50",
                                            "sampling.participants_per_round=4",
                                            "sampling.task_rate=0.1",
                                            "privacy.noise_multiplier=1.0"]), counts)  # fmt: skip
    assert isinstance(poisson.scheme, TwoStagePoissonScheme)
    assert poisson.normaliser == pytest.approx(4 * 0.1 * 50)  # configured n1, not registered
    assert poisson.privacy is not None and poisson.privacy.event.participant_cap is None
    assert poisson.privacy.participant_level_note == PARTICIPANT_LEVEL_NOT_MEANINGFUL


def test_a_participant_below_the_public_min_tasks_is_refused_at_registration(
    tmp_path: Path,
) -> None:
    cfg = small("sampling.stage2=fixed", "sampling.tasks_per_round=3", "sampling.min_tasks=10",
                "rounds=2")  # fmt: skip
    ledger = fake_ledger(100.0, 0.1)
    grid = InProcessGrid(6, _short_participant(short=2, count=7))
    result = execute(
        cfg, grid, out_dir=tmp_path, observers=[], echo=False, open_ledger=opener(ledger)
    )
    assert result.summary["participants_registered"] == 5
    assert ledger.records()[0].event.scheme.participants == 5
    cfg = small(
        "sampling.stage2=fixed",
        "sampling.tasks_per_round=3",
        "sampling.min_tasks=30",
        "federation.register_timeout_s=1",
    )  # nobody can register: do not wait for them
    with pytest.raises(RegistrationError, match="0 participants registered"):
        execute(cfg, InProcessGrid(6), out_dir=tmp_path / "b", observers=[], echo=False,
                open_ledger=opener(ledger))  # fmt: skip


def test_the_relation_and_the_participant_level_note_are_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = fake_ledger(100.0, 0.1)
    cfg = small("rounds=1")
    result = execute(cfg, InProcessGrid(6), out_dir=tmp_path, observers=[], echo=True,
                     open_ledger=opener(ledger))  # fmt: skip
    printed = capsys.readouterr().out
    assert "add_remove neighbours" in printed and printed.count("not meaningful") == 2
    assert printed.count(PARTICIPANT_LEVEL_NOT_MEANINGFUL) == 1  # the whole sentence: once
    s = result.summary
    assert s["participant_level_note"] == PARTICIPANT_LEVEL_NOT_MEANINGFUL
    assert s["epsilon_participant_level"] is None and s["neighbouring"] == "add_remove"
    text = format_summary(s)
    assert "add_remove" in text and "not meaningful" in text and "participant_level_note" in text
    # Nothing in the summary is computed from a task count.
    assert "expected_tasks_per_round" not in s and s["normaliser"] == pytest.approx(3 * 0.3 * 20)


def test_a_private_checkpoint_holds_no_secret_randomness(tmp_path: Path) -> None:
    """checkpoint.pt is an output: a stored sampler or noise state would reveal past samples and
    noise. A resumed private run draws fresh secrets and still spends once per round."""
    ledger = fake_ledger(100.0, 0.1)
    execute(small("rounds=2"), InProcessGrid(6), out_dir=tmp_path, observers=[], echo=False,
            open_ledger=opener(ledger))  # fmt: skip
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    secret = {"sampler_state", "rng", "noise_state", "key", "bit_generator"}
    assert not secret & set(ckpt) and "bit_generator" not in repr(ckpt)
    execute(small("rounds=4"), InProcessGrid(6), out_dir=tmp_path, resume=True, observers=[],
            echo=False, open_ledger=opener(ledger))  # fmt: skip
    assert [r.round_index for r in ledger.records()] == [0, 1, 2, 3]


@pytest.mark.unit
@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_a_calibrated_plan_spends_its_budget_under_its_own_relation(relation: str) -> None:
    """The noise is calibrated for the configured neighbouring relation, not always add/remove
    (which under replace-one gave a z too small: the ledger stopped the run early)."""
    from fedmeta.accounting import epsilon

    cfg = load_config(None, ["sampling.participants_per_round=4", "sampling.task_rate=0.1",
                             "rounds=50", f"privacy.neighbouring={relation}"])  # fmt: skip
    private = build_plan(cfg, {str(i): 200 for i in range(20)}).privacy
    assert private is not None
    spent = epsilon([(private.event, 50)], cfg.privacy.delta)
    assert spent <= cfg.privacy.epsilon_budget and spent > 0.97 * cfg.privacy.epsilon_budget
