"""Checkpoints of a federation run: written atomically, read without ever running code.

A checkpoint holds the meta-parameters, the optimizer state, the next round index, the rounds so
far (plain records), the configuration, the noise multiplier, and the run's binding to its budget
ledger (the ledger's identity, absolute path, position and last record hash), which a resume checks
before it spends anything. It never holds secret randomness: a private run's sampler and noise keys
are not stored.

* **Atomic.** A temporary file in the same directory, flushed and fsynced, then ``os.replace`` onto
  the final name, then the directory fsynced: a crash leaves the old or the new checkpoint.
* **Safe to load.** ``torch.load(..., weights_only=True)`` accepts tensors and plain Python data
  only, so a planted ``checkpoint.pt`` cannot execute code on ``--resume`` or ``fedmeta evaluate``.
  Anything else (a truncated or random file, another format) is a :class:`CheckpointError` with one
  line naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as one; the message names the file and the fix."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (tmp + fsync + rename + directory fsync)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        # write() and fsync() errors (a full disk) carry no file name: name the file meant.
        if error.filename is None:
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_checkpoint(out_dir: Path, state: dict[str, Any]) -> Path:
    """Serialise ``state`` (tensors and plain data only) to ``out_dir/checkpoint.pt`` atomically."""
    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, **state}, buf)
    path = Path(out_dir) / CHECKPOINT_NAME
    atomic_write_bytes(path, buf.getvalue())
    return path


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path`` (a file, or a run directory holding ``checkpoint.pt``)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint there; give a run directory or a .pt file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path}: refused: it holds objects other than tensors and plain data, which a "
            "fedmeta checkpoint never does (loading it could run code)"
        ) from None
    except Exception as error:  # noqa: BLE001 - random bytes fail in torch's or pickle's own ways
        # (BadZipFile, EOFError, RuntimeError, ValueError, KeyError, UnicodeDecodeError, ...): any
        # of them means the file is not a checkpoint this fedmeta wrote.
        raise CheckpointError(
            f"{path}: not a readable fedmeta checkpoint (truncated or corrupted: "
            f"{type(error).__name__})"
        ) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        found = state.get("format_version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path}: checkpoint format {found!r}, this fedmeta reads format {FORMAT_VERSION}; "
            "use the fedmeta version that wrote it"
        )
    return state


def load_checkpoint(out_dir: Path) -> dict[str, Any] | None:
    """The checkpoint in run directory ``out_dir``, or None when there is none."""
    path = Path(out_dir) / CHECKPOINT_NAME
    return read_checkpoint(path) if path.is_file() else None
