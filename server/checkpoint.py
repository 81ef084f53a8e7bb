"""Atomic checkpoints of a federation run.

A checkpoint holds the meta-parameters, the Adam state, the next round index, the sampler's RNG
state (non-private and insecure-test-seed runs only: in a private run it is secret), the
configuration, the ledger position (number of ledger records when it was written) and the rows of
``rounds.csv`` so far. It is written atomically: a temporary file in the same directory,
flushed and fsynced, then ``os.replace`` onto the final name, then the directory fsynced. A crash
leaves either the old or the new checkpoint, never a torn one.

The resume rule (the ledger is the source of truth for spends) is implemented in ``server/round.py``
and documented in docs/federation.md.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (tmp + fsync + rename + directory fsync)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_checkpoint(out_dir: Path, state: dict[str, Any]) -> Path:
    """Serialise ``state`` (tensors and plain data) to ``out_dir/checkpoint.pt`` atomically."""
    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, **state}, buf)
    path = Path(out_dir) / CHECKPOINT_NAME
    atomic_write_bytes(path, buf.getvalue())
    return path


def load_checkpoint(out_dir: Path) -> dict[str, Any] | None:
    """The checkpoint in ``out_dir``, or None when there is none."""
    path = Path(out_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format {state.get('format_version')!r}")
    return state
