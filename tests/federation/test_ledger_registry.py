"""One registry of ledgers per account, or a shared one: the budget follows the data (issue 52).

Issue 52's findings on a tiny Omniglot-format job (4 participants, z = 1, budget 2 at delta
1e-6), each reproduced here on drawings the test makes: another state directory or ``HOME``
opened a fresh budget (item 1); a second ledger recording part of the data was accepted (item 4).
"""

from __future__ import annotations

import json
import os
import pwd
import threading
from pathlib import Path

import numpy as np
import pytest

from fedmeta.accounting import FlatPoissonScheme, GaussianRound
from fedmeta.client.gradients import registration
from fedmeta.client_config import client_config
from fedmeta.config import Config
from fedmeta.config_io import load_config
from fedmeta.protocol import RegisterRequest
from fedmeta.server import ledger_registry
from fedmeta.server.ledger_registry import REGISTRY_ENV, RegistryUnusable, registry_file
from fedmeta.server.ledger_witness import LedgerElsewhere
from fedmeta.server.startup import open_budget
from fedmeta.server.transport import Registered

from .test_content_budget import _drawings

PARTICIPANTS = 4
EVENT = GaussianRound(FlatPoissonScheme(0.05), 1.0)  # z = 1, as in the issue: 5 rounds fit


def _cfg(path: Path, db: Path | None = None) -> Config:
    """The issue's job: 4 participants, budget 2 at delta 1e-6 (the default ledger unless db)."""
    sets = ["dataset.name=omniglot", f"dataset.path={path}", "dataset.ways=3",
            "dataset.shots=1", "dataset.query=1", "dataset.tasks_per_participant=5",
            "dataset.partition=even", "dataset.split=background",
            f"federation.participants={PARTICIPANTS}", "sampling.participants_per_round=2",
            "privacy.epsilon_budget=2", "privacy.delta=1e-6"]  # fmt: skip
    return load_config(None, sets + ([f"privacy.ledger_path={db}"] if db else []))


def _npz(root: Path, background: np.ndarray) -> Path:
    """Omniglot's npz layout: these drawings the background set (what the runs train on)."""
    root.mkdir(parents=True)
    np.savez(root / "images_background.npz", images=background)
    np.savez(root / "images_evaluation.npz", images=_drawings(99, chars=4))
    return root


def _registered(cfg: Config) -> list[Registered]:
    """What the participants' own ClientApp code tells the server (their items included)."""
    request = RegisterRequest("run", client_config(cfg).model_dump_json())
    regs = [registration(request, str(i)) for i in range(PARTICIPANTS)]
    return [Registered(r.participant_id, 100 + i, r.task_count, r.data_fingerprint)
            for i, r in enumerate(regs)]  # fmt: skip


def _spend(cfg: Config, rounds: int) -> Path:
    with open_budget(cfg, _registered(cfg)) as ledger:
        for i in range(rounds):
            ledger.spend(EVENT, "first", i)
        return ledger.path


@pytest.mark.integration
@pytest.mark.parametrize("move", ["state_dir", "home"])
def test_another_state_dir_or_home_is_refused_naming_the_recorded_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, move: str
) -> None:
    """Item 1: ``FEDMETA_STATE_DIR=$HOME/state-a`` then ``state-b`` (or another ``HOME``, which
    moves the default state directory) on the same npz showed '0 spends'; now refused. The
    registry is the account's default one, found through the passwd database, not ``$HOME``."""
    account = tmp_path / "account-home"
    real = pwd.getpwuid(os.getuid())
    passwd = pwd.struct_passwd((*real[:5], str(account), real[6]))  # this uid's home elsewhere
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: passwd)
    monkeypatch.delenv(REGISTRY_ENV)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    cfg = _cfg(_npz(tmp_path / "npz", _drawings(11, chars=12)))
    if move == "state_dir":
        monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "home" / "state-a"))
    else:
        monkeypatch.delenv("FEDMETA_STATE_DIR")
        monkeypatch.setenv("HOME", str(tmp_path / "home-a"))
    first = _spend(cfg, 3)
    if move == "state_dir":
        monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "home" / "state-b"))
    else:
        monkeypatch.setenv("HOME", str(tmp_path / "home-b"))
    with pytest.raises(LedgerElsewhere) as refused:
        open_budget(cfg, _registered(cfg))
    message = str(refused.value)
    assert "\n" not in message and f"recorded in ledger {first}" in message
    assert registry_file() == account / ".local" / "state" / "fedmeta-registry" / "ledgers.json"
    assert registry_file().is_file() and not registry_file().is_relative_to(first.parent)


@pytest.mark.integration
def test_a_second_ledger_recording_part_of_the_data_is_refused(tmp_path: Path) -> None:
    """Item 4: half the drawings had 5 rounds in another ledger, the other half were recorded in
    this one; the run was accepted (it reported the smaller epsilon). Now refused, naming it."""
    white = _drawings(12, chars=24)
    half_a, half_b = tmp_path / "a" / "ledger.sqlite", tmp_path / "b" / "ledger.sqlite"
    first = _spend(_cfg(_npz(tmp_path / "half-a", white[:12]), half_a), 5)
    _spend(_cfg(_npz(tmp_path / "half-b", white[12:]), half_b), 1)
    whole = _cfg(_npz(tmp_path / "whole", white), half_b)
    with pytest.raises(LedgerElsewhere) as refused:
        open_budget(whole, _registered(whole))
    message = str(refused.value)
    assert "\n" not in message and f"recorded in ledger {first}" in message
    assert "in part" in message
    again = _cfg(_npz(tmp_path / "again", white[12:]), half_b)
    open_budget(again, _registered(again)).close()  # the half only this ledger records: fine


@pytest.mark.unit
def test_the_account_registry_does_not_follow_home_or_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REGISTRY_ENV)
    seen = set()
    for home in ("h1", "h2"):
        monkeypatch.setenv("HOME", str(tmp_path / home))
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / home / "xdg"))
        monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / home / "state"))
        seen.add(registry_file())
    assert len(seen) == 1 and not next(iter(seen)).is_relative_to(tmp_path)
    monkeypatch.setenv(REGISTRY_ENV, "relative/ledgers.json")
    with pytest.raises(RegistryUnusable, match=f"{REGISTRY_ENV}=relative/ledgers.json"):
        registry_file()


@pytest.mark.unit
def test_concurrent_registrations_lose_no_entry(tmp_path: Path) -> None:
    paths = [tmp_path / f"l{i}" / "ledger.sqlite" for i in range(24)]
    threads = [threading.Thread(target=ledger_registry.remember, args=(p, f"{i:032x}"))
               for i, p in enumerate(paths)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(ledger_registry.known_ledgers()) >= set(paths)
    data = json.loads(registry_file().read_text())
    assert data["version"] == 2 and len(data["ledgers"]) == len(paths)


@pytest.mark.unit
def test_an_unusable_registry_refuses_in_one_line_before_a_ledger_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(_npz(tmp_path / "npz", _drawings(13, chars=12)), tmp_path / "l.sqlite")
    registry_file().parent.mkdir(parents=True, exist_ok=True)
    registry_file().write_text("{not json")
    with pytest.raises(RegistryUnusable) as refused:
        open_budget(cfg, _registered(cfg))
    assert "\n" not in str(refused.value) and str(registry_file()) in str(refused.value)
    assert not (tmp_path / "l.sqlite").exists()
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        monkeypatch.setenv(REGISTRY_ENV, str(locked / "sub" / "ledgers.json"))
        with pytest.raises(RegistryUnusable, match="cannot be written"):
            open_budget(cfg, _registered(cfg))
        assert not (tmp_path / "l.sqlite").exists()


@pytest.mark.unit
def test_registry_entries_of_the_older_per_state_dir_place_are_still_read(tmp_path: Path) -> None:
    from fedmeta.paths import witness_dir

    witness_dir().mkdir(parents=True)
    old = tmp_path / "old" / "ledger.sqlite"
    (witness_dir() / "ledgers.json").write_text(json.dumps({"ledgers": [str(old)]}))
    assert old in ledger_registry.known_ledgers()


# ------------------------------------------------------------------ --dry-run as the run (item 5)


def _cli(path: Path, out: Path, *extra: str) -> list[str]:
    sets = ["dataset.name=omniglot", f"dataset.path={path}", "dataset.ways=3", "dataset.shots=1",
            "dataset.query=1", "dataset.tasks_per_participant=5", "dataset.partition=even",
            "dataset.split=background", f"federation.participants={PARTICIPANTS}",
            "sampling.participants_per_round=2", "privacy.epsilon_budget=2",
            "privacy.delta=1e-6", "privacy.noise_multiplier=0.9", "rounds=3",
            "federation.backend=inprocess", "output.plots=false",
            "output.progress=false",
            # Since the individual filter a run over spent data runs: scoring the configuration's
            # default thousands of test tasks was 100 s of a 2-minute test that checks no score.
            "dataset.test_tasks=10", "dataset.validation_tasks=4",
            "training.eval_every=10"]  # fmt: skip
    return ["simulate", *(a for s in sets for a in ("--set", s)), "--out", str(out), *extra]


def _status(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from fedmeta.cli import main

    capsys.readouterr()
    status = main(args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err.strip()


@pytest.mark.integration
def test_the_dry_run_forecasts_the_datas_recorded_budget_and_exits_as_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 5: on image data ``--dry-run`` forecast a fresh budget ('0 spends', exit 0) where
    the run exited 3; it reads the same identity (the items) as the run now. Since item 6 neither
    refuses for what the data spent before: both forecast the run's own rounds, and exit 0."""
    path = _npz(tmp_path / "npz", _drawings(14, chars=12))
    _spend(_cfg(path), 5)  # 1.86 of 2: no round at z = 0.9 fits (a fresh budget affords 2)
    dry, out, err = _status(_cli(path, tmp_path / "dry", "--dry-run"), capsys)
    assert dry == 0 and "a fresh budget" not in out and "as recorded in" in out, (out, err)
    assert "ledger before this run: 5 spends" in out and "rounds affordable: 2 " in out, out
    run, run_out, _ = _status(_cli(path, tmp_path / "run"), capsys)
    assert run == dry == 0 and "rounds affordable: 2 " in run_out
    other = _npz(tmp_path / "other", _drawings(15, chars=12))  # data sharing nothing: fresh
    fresh, out, _ = _status(_cli(other, tmp_path / "fresh", "--dry-run"), capsys)
    assert fresh == 0 and "rounds affordable: 2 " in out, out  # the same: nothing depends on it


@pytest.mark.integration
@pytest.mark.parametrize("case", ["restored_state_dir", "restored_ledger_file", "second_ledger"])
def test_the_dry_run_refuses_what_the_runs_ledger_open_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], isolated_state_dir: Path,
    monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:
    """Item 5: a rolled-back state directory (caught by the witness), a ledger file restored alone
    (its anchor) and a second ledger for recorded data are refused by the dry run as by the run:
    one line, exit 2, nothing written."""
    import shutil

    path = _npz(tmp_path / "npz", _drawings(16, chars=12))
    cfg = _cfg(path)
    _spend(cfg, 1)
    if case == "restored_state_dir":
        backup = tmp_path / "state-backup"
        shutil.copytree(isolated_state_dir, backup)
        _spend(cfg, 2)
        shutil.rmtree(isolated_state_dir)
        shutil.copytree(backup, isolated_state_dir)
        expected = "behind its witness"
    elif case == "restored_ledger_file":  # the file alone: its anchor beside it catches it
        db = isolated_state_dir / "ledger.sqlite"
        shutil.copy2(db, tmp_path / "ledger-backup.sqlite")
        _spend(cfg, 2)
        shutil.copy2(tmp_path / "ledger-backup.sqlite", db)
        expected = "behind its anchor"
    else:
        monkeypatch.setenv("FEDMETA_STATE_DIR", str(tmp_path / "state-b"))
        expected = "recorded in ledger"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    dry, _, err = _status(_cli(path, tmp_path / "dry", "--dry-run"), capsys)
    assert dry == 2 and expected in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "the dry run wrote something"
    run, _, run_err = _status(_cli(path, tmp_path / "run"), capsys)
    assert run == dry and expected in run_err


# ------------------------------------------------------------ a target the noise misses (item 9)


@pytest.mark.integration
@pytest.mark.parametrize("dry", [True, False])
def test_a_target_a_fixed_noise_multiplier_misses_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dry: bool
) -> None:
    """Item 9: ``--set privacy.target_epsilon=0.2`` with a fixed ``noise_multiplier`` printed
    'internal error: ValueError' (exit 1); it is one configuration line (exit 2) naming both."""
    path = _npz(tmp_path / "npz", _drawings(17, chars=12))
    args = _cli(path, tmp_path / "out", "--set", "privacy.target_epsilon=0.2",
                *(["--dry-run"] if dry else []))  # fmt: skip
    status, _, err = _status(args, capsys)
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "internal error" not in err
    assert "privacy.noise_multiplier=0.9" in err and "privacy.target_epsilon=0.2" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
