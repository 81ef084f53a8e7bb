"""The checkpoint is one typed, versioned record (core/fedmeta/checkpoint.py, issue 54).

Format 3 round-trips every field; a damaged file, a file of an unknown format and a file whose
configuration no longer validates are each one line naming the file and the fix (exit 2 from the
commands); a format-2 file, as fedmeta wrote it before format 3 (in its earliest and latest form),
still reads and resumes, so nothing already recorded is lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmeta.accounting import LedgerCheckpoint
from fedmeta.checkpoint import (
    CHECKPOINT_NAME,
    FORMAT_VERSION,
    LOST_ON_RESUME,
    Checkpoint,
    CheckpointError,
    KeptModel,
    read_checkpoint,
    save_checkpoint,
)
from fedmeta.config import Config
from fedmeta.server.report import STATUS_LOST_ON_RESUME

from .test_round import small

BINDING = LedgerCheckpoint("lid", "/state/ledger.sqlite", "fed", 3, "h" * 64)


def _full(**changes: Any) -> Checkpoint:
    """A private best-validation run's checkpoint with every field set."""
    values: dict[str, Any] = {
        "run_id": "run-1", "federation_id": "fed", "params": torch.arange(4.0),
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "next_round": 3, "config": Config(), "private": True, "noise_multiplier": 1.5,
        "noise_calibrated": True, "clip": 0.7,
        "outcomes": ({"round": 1, "status": LOST_ON_RESUME, "epsilon_task": None},
                     {"round": 2, "status": "completed", "epsilon_task": 0.5,
                      "epsilon_participant": 0.25},
                     {"round": 3, "status": "completed", "epsilon_task": None}),
        "ledger": BINDING, "witness": {"ledger_id": "lid", "records": 3},
        "released_coordinates": 10,
        "selection": KeptModel("best_validation", 2, 0.6, 0.4, torch.ones(4)),
        "starting_model": {"source": "untrained", "validation_metric": 0.4},
    }  # fmt: skip
    return Checkpoint(**{**values, **changes})


def _same(a: Checkpoint, b: Checkpoint) -> bool:
    kept = (a.selection is None) == (b.selection is None) and (
        a.selection is None or b.selection is None
        or (torch.equal(a.selection.params, b.selection.params)
            and a.selection.round == b.selection.round
            and a.selection.validation_metric == b.selection.validation_metric))  # fmt: skip
    plain = [f for f in Checkpoint.__dataclass_fields__ if f not in ("params", "selection")]
    return torch.equal(a.params, b.params) and kept and all(
        getattr(a, f) == getattr(b, f) for f in plain
    )


@pytest.mark.unit
def test_every_field_round_trips(tmp_path: Path) -> None:
    saved = _full()
    save_checkpoint(tmp_path, saved)
    back = read_checkpoint(tmp_path)
    assert _same(back, saved)
    assert torch.equal(back.released_params(), torch.ones(4))  # the selected model
    assert back.rounds_lost_on_resume() == [1]
    last = back.last_epsilon()
    assert last is not None and (last.round, last.epsilon_task, last.epsilon_participant) == (
        2, 0.5, 0.25)  # fmt: skip
    assert back.released_values() == 30  # 10 values a round, 3 spends
    raw = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    assert raw["format_version"] == FORMAT_VERSION == 3


@pytest.mark.unit
@settings(max_examples=25, deadline=None)
@given(
    next_round=st.integers(0, 10_000),
    z=st.none() | st.floats(0.1, 100.0),
    clip=st.none() | st.floats(1e-3, 10.0),
    kept=st.booleans(),
    private=st.booleans(),
)
def test_the_optional_fields_round_trip(
    tmp_path_factory: pytest.TempPathFactory, next_round: int, z: float | None,
    clip: float | None, kept: bool, private: bool,
) -> None:  # fmt: skip
    saved = _full(next_round=next_round, noise_multiplier=z, clip=clip, private=private,
                  ledger=BINDING if private else None, witness=None, starting_model=None,
                  selection=KeptModel("best_validation", None, None, None, torch.zeros(4))
                  if kept else None)  # fmt: skip
    out = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(out, saved)
    back = read_checkpoint(out)
    assert _same(back, saved)
    assert torch.equal(back.released_params(), torch.zeros(4) if kept else torch.arange(4.0))


@pytest.mark.unit
def test_the_lost_round_status_is_the_servers_word() -> None:
    assert LOST_ON_RESUME == STATUS_LOST_ON_RESUME


def _plain(tmp_path: Path) -> dict[str, Any]:
    save_checkpoint(tmp_path, _full())
    state: dict[str, Any] = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    return state


def _refusal(tmp_path: Path, state: dict[str, Any]) -> str:
    torch.save(state, tmp_path / CHECKPOINT_NAME)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / CHECKPOINT_NAME) in message
    return message


@pytest.mark.unit
@pytest.mark.parametrize("key", ["params", "next_round", "config", "ledger", "selection", "clip"])
def test_a_format_3_file_missing_a_field_is_damaged(tmp_path: Path, key: str) -> None:
    state = _plain(tmp_path)
    del state[key]
    message = _refusal(tmp_path, state)
    assert f"damaged format-3 checkpoint (missing '{key}')" in message
    assert "resume from a backup of the run directory, or start a new run with --out" in message


@pytest.mark.unit
@pytest.mark.parametrize(("key", "value", "says"), [
    ("params", [1.0, 2.0], "params is list, not a tensor"),
    ("next_round", -1, "next_round is -1, not a count"),
    ("next_round", "3", "next_round is '3', not a count"),
    ("run_id", 7, "run_id is int, not text"),
    ("outcomes", ["x"], "outcomes is str, not a record"),
    ("ledger", {"path": "/l", "federation_id": "fed", "position": 2, "head": None},
     "head must be None exactly at position 0"),
])  # fmt: skip
def test_a_field_of_the_wrong_kind_is_damaged(
    tmp_path: Path, key: str, value: Any, says: str
) -> None:
    state = _plain(tmp_path)
    state[key] = value
    assert says in _refusal(tmp_path, state)


@pytest.mark.unit
def test_a_configuration_that_no_longer_validates_names_the_field(tmp_path: Path) -> None:
    state = _plain(tmp_path)
    state["config"]["training"]["no_such_key"] = 1
    message = _refusal(tmp_path, state)
    assert "its recorded configuration does not validate" in message and "no_such_key" in message


@pytest.mark.unit
@pytest.mark.parametrize("version", [1, 4, None, "3"])
def test_an_unknown_format_says_which_it_reads(tmp_path: Path, version: Any) -> None:
    state = _plain(tmp_path)
    state["format_version"] = version
    message = _refusal(tmp_path, state)
    assert f"checkpoint format {version!r}, this fedmeta reads formats 2, 3" in message
    assert "use the fedmeta version that wrote it" in message


def _format_2(state: dict[str, Any], *, earliest: bool) -> dict[str, Any]:
    """``state`` as format 2 wrote it: its latest form, or its earliest (without the fields
    added during format 2, and a ledger binding of path and position only)."""
    old = {**state, "format_version": 2}
    if earliest:
        for key in ("clip", "witness", "released_coordinates", "selection", "starting_model"):
            old.pop(key)
        if old["ledger"] is not None:
            old["ledger"] = {"path": old["ledger"]["path"], "position": 0}
    return old


@pytest.mark.unit
@pytest.mark.parametrize("earliest", [False, True], ids=["latest", "earliest"])
def test_a_format_2_file_reads(tmp_path: Path, earliest: bool) -> None:
    state = _format_2(_plain(tmp_path), earliest=earliest)
    torch.save(state, tmp_path / CHECKPOINT_NAME)
    back = read_checkpoint(tmp_path)
    assert back.run_id == "run-1" and back.next_round == 3 and back.private
    assert torch.equal(back.params, torch.arange(4.0)) and back.config == Config()
    assert back.rounds_lost_on_resume() == [1] and back.noise_multiplier == 1.5
    assert back.ledger is not None and back.ledger.path == BINDING.path
    if earliest:
        assert (back.clip, back.selection, back.released_coordinates) == (None, None, None)
        assert back.ledger.federation_id == "fed" and back.ledger.position == 0
        assert back.released_values() is None
    else:
        assert back.clip == 0.7 and back.selection is not None and back.released_values() == 30


@pytest.mark.integration
@pytest.mark.parametrize("earliest", [False, True], ids=["latest", "earliest"])
def test_a_run_checkpointed_in_format_2_resumes_and_writes_format_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earliest: bool
) -> None:
    """A real private run's checkpoint, rewritten as format 2 wrote it, resumes where it stopped."""
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "run"

    def run(rounds: int, resume: bool) -> Any:
        cfg = small(f"rounds={rounds}", "privacy.epsilon_budget=1000",
                    f"privacy.ledger_path={tmp_path / 'ledger.sqlite'}")  # fmt: skip
        return execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=out,
                       resume=resume, echo=False)  # fmt: skip

    run(2, False)
    state = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    torch.save(_format_2(state, earliest=earliest), out / CHECKPOINT_NAME)
    result = run(3, True)
    assert result.rounds_run == 1 and result.summary["rounds_completed"] == 3
    back = read_checkpoint(out)
    assert back.run_id == state["run_id"] and back.next_round == 3 and back.private
    assert back.ledger is not None and back.ledger.position == 3
    assert torch.load(out / CHECKPOINT_NAME, weights_only=True)["format_version"] == 3


@pytest.mark.integration
def test_the_commands_turn_a_damaged_checkpoint_into_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedmeta.cli import main as cli_main

    state = _plain(tmp_path)
    del state["outcomes"]
    torch.save(state, tmp_path / CHECKPOINT_NAME)
    for command in (["evaluate", "--checkpoint", str(tmp_path)],
                    ["simulate", "--resume", "--out", str(tmp_path)]):  # fmt: skip
        assert cli_main(command) == 2, command
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "damaged format-3 checkpoint (missing 'outcomes')" in err
        assert str(tmp_path / CHECKPOINT_NAME) in err


@pytest.mark.integration
def test_deploy_status_counts_from_the_typed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fedmeta deploy status`` of an unfinished run: spent from the ledger the checkpoint binds,
    applied from the checkpoint's next round (cli/fedmeta/cli/deploy_status.py)."""
    from fedmeta.cli.deploy_status import run_progress
    from fedmeta.server.app import execute
    from fedmeta.simulation.local_grid import InProcessGrid

    monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "run"
    cfg = small("rounds=3", "privacy.epsilon_budget=1000",
                f"privacy.ledger_path={tmp_path / 'ledger.sqlite'}")  # fmt: skip
    execute(cfg, InProcessGrid(cfg.federation.participants), out_dir=out, echo=False)
    (out / "summary.json").unlink()  # as if the run had not finished
    progress = run_progress(str(out), None)
    assert (progress.spent, progress.applied, progress.lost) == (3, 3, [])
    assert progress.source == f"ledger {tmp_path / 'ledger.sqlite'} and checkpoint.pt"
    # The update of rounds 2 and 3 lost (the checkpoint from after round 1), and format 2.
    state = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    torch.save(_format_2({**state, "next_round": 1}, earliest=False), out / CHECKPOINT_NAME)
    progress = run_progress(str(out), None)
    assert (progress.spent, progress.applied, progress.lost) == (3, 1, [2, 3])
