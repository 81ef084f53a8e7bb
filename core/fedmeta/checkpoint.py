"""Checkpoints of a federation run: one typed record, written atomically, read without running code.

A :class:`Checkpoint` holds the meta-parameters, the optimizer state, the next round index, the
rounds so far (plain records), the configuration, the noise multiplier, and the run's binding to its
budget ledger (the ledger's identity, absolute path, position and last record hash), which a resume
checks before it spends anything. It never holds secret randomness: a private run's sampler and
noise keys are not stored. This module is the format's one writer (:func:`save_checkpoint`) and one
reader (:func:`read_checkpoint`): no other module looks a checkpoint's keys up.

* **Atomic.** A temporary file in the same directory, flushed and fsynced, then ``os.replace`` onto
  the final name, then the directory fsynced: a crash leaves the old or the new checkpoint.
* **Safe to load.** ``torch.load(..., weights_only=True)`` accepts tensors and plain Python data
  only, so a planted ``checkpoint.pt`` cannot execute code on ``--resume`` or ``fedmeta evaluate``.
  Anything else (a truncated or random file, another format) is a :class:`CheckpointError` with one
  line naming the file and the fix.
* **Versioned.** On disk a checkpoint is a plain dict with ``format_version``. Format 3 (written
  now) holds every field of :class:`Checkpoint`, so a missing key is a damaged file. Format 2
  (written before) gained fields over its life (``clip``, ``witness``, ``released_coordinates``,
  ``selection``, ``starting_model``); they read as absent, as the readers of that time read them,
  and its earliest ledger binding lacks the federation id, which the checkpoint's own supplies.
  Both keep the same keys, so a format-2 run resumes and writes format 3 from then on.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedmeta.accounting import LedgerCheckpoint
from fedmeta.config import Config, ConfigError
from fedmeta.config_io import config_from_dict

CHECKPOINT_NAME = "checkpoint.pt"
#: The format this fedmeta writes; :data:`READABLE_VERSIONS` are those it reads.
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
#: A round record's status for a round spent in the ledger whose update a resume found lost
#: (server/fedmeta/server/report.py ``STATUS_LOST_ON_RESUME``, the same word).
LOST_ON_RESUME = "lost_on_resume"


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


@dataclass(frozen=True)
class KeptModel:
    """Model selection's kept model (server/fedmeta/server/selection.py): the best validated one."""

    rule: str
    round: int | None
    validation_metric: float | None
    start_validation_metric: float | None
    params: torch.Tensor


@dataclass(frozen=True)
class ReportedEpsilon:
    """The latest epsilon a run's round records carry: task level (enforced), participant level."""

    round: int
    epsilon_task: float
    epsilon_participant: float | None


@dataclass(frozen=True)
class Checkpoint:
    """One run's saved state: what a resume continues from and ``fedmeta evaluate`` scores.

    ``outcomes`` are the rounds so far as plain records (``RoundOutcome.to_dict``,
    server/fedmeta/server/report.py); ``starting_model`` is ``StartingModel.to_dict``
    (server/fedmeta/server/starting.py) and ``witness`` the ledger's anchor (issue 39), both
    ``None`` in checkpoints written before they existed. ``optimizer`` is torch's own state dict.
    """

    run_id: str
    federation_id: str
    params: torch.Tensor
    optimizer: Mapping[str, Any]
    next_round: int
    config: Config
    private: bool
    noise_multiplier: float | None = None  # None: a non-private run
    noise_calibrated: bool = False
    clip: float | None = None  # adaptive clipping's next bound (None: a fixed bound)
    outcomes: tuple[Mapping[str, Any], ...] = ()
    ledger: LedgerCheckpoint | None = None  # None: a non-private run
    witness: Mapping[str, Any] | None = None
    released_coordinates: int | None = None  # noisy values per round (the implemented guarantee)
    selection: KeptModel | None = None  # None: nothing kept (the rule "last")
    starting_model: Mapping[str, Any] | None = None

    def released_params(self) -> torch.Tensor:
        """The model the run released: its selected one, else its last."""
        return self.params if self.selection is None else self.selection.params

    def rounds_lost_on_resume(self) -> list[int]:
        """Rounds (1-based) an earlier resume found spent with their update lost."""
        return [int(o["round"]) for o in self.outcomes if o.get("status") == LOST_ON_RESUME]

    def last_epsilon(self) -> ReportedEpsilon | None:
        """The latest round record carrying epsilon (None: none does, or a non-private run)."""
        reported = [o for o in self.outcomes if o.get("epsilon_task") is not None]
        if not reported:
            return None
        last = reported[-1]
        participant = last.get("epsilon_participant")
        return ReportedEpsilon(int(last["round"]), float(last["epsilon_task"]),
                               None if participant is None else float(participant))  # fmt: skip

    def released_values(self) -> int | None:
        """Noisy values the run's spends released so far (None: not recorded, or non-private)."""
        if self.released_coordinates is None or self.ledger is None:
            return None
        return self.released_coordinates * self.ledger.position


def save_checkpoint(out_dir: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` to ``out_dir/checkpoint.pt`` atomically, in format 3."""
    buf = io.BytesIO()
    torch.save(_to_plain(checkpoint), buf)
    path = Path(out_dir) / CHECKPOINT_NAME
    atomic_write_bytes(path, buf.getvalue())
    return path


def _to_plain(c: Checkpoint) -> dict[str, Any]:
    """The on-disk form: tensors and plain data only (what ``weights_only`` loading accepts)."""
    kept = c.selection
    return {
        "format_version": FORMAT_VERSION,
        "run_id": c.run_id,
        "federation_id": c.federation_id,
        "params": c.params,
        "optimizer": dict(c.optimizer),
        "next_round": c.next_round,
        "config": c.config.to_dict(),
        "private": c.private,
        "noise_multiplier": c.noise_multiplier,
        "noise_calibrated": c.noise_calibrated,
        "clip": c.clip,
        "outcomes": [dict(o) for o in c.outcomes],
        "ledger": None if c.ledger is None else c.ledger.to_dict(),
        "witness": None if c.witness is None else dict(c.witness),
        "released_coordinates": c.released_coordinates,
        "selection": None if kept is None else {
            "rule": kept.rule, "round": kept.round, "validation_metric": kept.validation_metric,
            "start_validation_metric": kept.start_validation_metric, "params": kept.params},
        "starting_model": None if c.starting_model is None else dict(c.starting_model),
    }  # fmt: skip


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` (a file, or a run directory holding ``checkpoint.pt``)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint there; give a run directory or a .pt file")
    state = _load_plain(path)
    found = state.get("format_version") if isinstance(state, dict) else type(state).__name__
    if not isinstance(state, dict) or found not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: checkpoint format {found!r}, this fedmeta reads formats "
            f"{', '.join(map(str, READABLE_VERSIONS))}; use the fedmeta version that wrote it"
        )
    try:
        return _from_plain(state, strict=found == FORMAT_VERSION)
    except ConfigError as error:
        raise CheckpointError(
            f"{path}: its recorded configuration does not validate in this fedmeta ({error}); "
            "use the fedmeta version that wrote it"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        what = f"missing {error}" if isinstance(error, KeyError) else str(error)
        raise CheckpointError(
            f"{path}: damaged format-{found} checkpoint ({what}); resume from a backup of the "
            "run directory, or start a new run with --out"
        ) from None


def _load_plain(path: Path) -> Any:
    """The file's plain data, loaded without running code (``weights_only``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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


def _from_plain(state: dict[str, Any], *, strict: bool) -> Checkpoint:
    """The record from its on-disk dict; ``strict`` (format 3): every key must be there.

    Format 2's later fields read as absent, as format 2's readers read them.
    """
    optional = state.__getitem__ if strict else state.get
    ledger, witness, start = optional("ledger"), optional("witness"), optional("starting_model")
    return Checkpoint(
        run_id=_text(state["run_id"], "run_id"),
        federation_id=_text(state["federation_id"], "federation_id"),
        params=_tensor(state["params"], "params"),
        optimizer=_mapping(state["optimizer"], "optimizer"),
        next_round=_count(state["next_round"], "next_round"),
        config=config_from_dict(_mapping(state["config"], "config")),
        private=bool(state["private"]),
        noise_multiplier=_number(state["noise_multiplier"]),
        noise_calibrated=bool(state["noise_calibrated"]),
        clip=_number(optional("clip")),
        outcomes=tuple(_mapping(o, "outcomes") for o in state["outcomes"]),
        ledger=None if ledger is None else _ledger_binding(ledger, state["federation_id"]),
        witness=None if witness is None else _mapping(witness, "witness"),
        released_coordinates=_optional_count(optional("released_coordinates")),
        selection=_kept(optional("selection")),
        starting_model=None if not start else _mapping(start, "starting_model"),
    )


def _ledger_binding(saved: Any, federation_id: str) -> LedgerCheckpoint:
    """The run's ledger binding; format 2's first form (path, position) lacks the federation id."""
    return LedgerCheckpoint.from_dict({"federation_id": federation_id,
                                       **_mapping(saved, "ledger")})  # fmt: skip


def _kept(saved: Any) -> KeptModel | None:
    """Model selection's kept model; format 2 recorded no starting metric at first."""
    if saved is None:
        return None
    kept = _mapping(saved, "selection")
    start = kept.get("start_validation_metric")
    return KeptModel(str(kept["rule"]), _optional_count(kept["round"]),
                     _number(kept["validation_metric"]), _number(start),
                     _tensor(kept["params"], "selection.params"))  # fmt: skip


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} is {type(value).__name__}, not text")
    return value


def _tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} is {type(value).__name__}, not a tensor")
    return value


def _mapping(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} is {type(value).__name__}, not a record")
    return value


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} is {value!r}, not a count")
    return value


def _optional_count(value: Any) -> int | None:
    return None if value is None else _count(value, "count")


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def load_checkpoint(out_dir: Path) -> Checkpoint | None:
    """The checkpoint in run directory ``out_dir``, or None when there is none."""
    path = Path(out_dir) / CHECKPOINT_NAME
    return read_checkpoint(path) if path.is_file() else None
