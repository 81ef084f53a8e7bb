"""A full or read-only output directory or checkpoint location: one line, the path and the fix.

Issue 21: the ENOSPC message lacked the path (``write()`` and ``fsync()`` errors carry no file
name). The file meant is now named, the line says what to free or change, the last checkpoint and
the ledger stay intact, and following the advice (free space, ``--resume``) continues the run.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmeta import checkpoint as checkpoint_mod
from fedmeta.checkpoint import atomic_write_bytes
from fedmeta.simulation import simulate

from .fakes import fake_ledger
from .test_round import run, small


def _no_space(*_args: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.unit
def test_a_full_disk_names_the_file_and_leaves_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"the last good checkpoint")
    monkeypatch.setattr(checkpoint_mod.os, "fsync", _no_space)
    with pytest.raises(OSError) as caught:
        atomic_write_bytes(target, b"new")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)
    assert target.read_bytes() == b"the last good checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left


@pytest.mark.unit
@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.ENOSPC, "free space on that file system"),
        (errno.EDQUOT, "free space on that file system"),
        (errno.EROFS, "make that directory writable, or give --out a writable directory"),
        (errno.EACCES, "make that directory writable, or give --out a writable directory"),
    ],
)
def test_each_resource_fault_is_one_line_with_path_and_fix(
    code: int, advice: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = OSError(code, os.strerror(code), "/runs/a/checkpoint.pt")
    assert simulate._report(error) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/runs/a/checkpoint.pt" in err and advice in err


@pytest.mark.integration
def test_a_full_disk_mid_run_keeps_ledger_and_checkpoint_and_resume_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = fake_ledger(100.0, 0.1)
    real_fsync = os.fsync
    written: list[int] = []

    def fsync(fd: int) -> None:  # the disk fills after the first two checkpoints
        written.append(fd)
        if len(written) > 4:  # two fsyncs (file, directory) per checkpoint
            _no_space()
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_mod.os, "fsync", fsync)
    cfg = small("rounds=6", "training.checkpoint_every=2")
    with pytest.raises(OSError) as caught:
        run(cfg, tmp_path, ledger)
    assert caught.value.filename == str(tmp_path / "checkpoint.pt")
    assert simulate._report(caught.value) == 2
    assert "free space" in capsys.readouterr().err
    kept = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    # The start and round 2 were checkpointed; rounds 3 and 4 were spent, their checkpoint failed.
    assert kept["next_round"] == 2 and ledger.position() == 4
    monkeypatch.setattr(checkpoint_mod.os, "fsync", real_fsync)  # space freed
    resumed = run(cfg, tmp_path, ledger, resume=True)
    assert resumed.summary["rounds_completed"] == 6 == ledger.position()
    assert resumed.summary["rounds_lost_on_resume"] == [3, 4]  # reported, not run again
