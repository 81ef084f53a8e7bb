"""What ``fedmeta deploy run`` remembers of each run it submits, and which runs were interrupted.

A ServerApp that dies mid-run (its container restarted, the process killed, the host rebooted)
leaves the run listed as ``running`` by the SuperLink until Flower notices that its task's
heartbeat lapsed, and the operator's ``fedmeta deploy run`` may have died with it (``docker
compose exec`` into the restarted container: exit 137, no summary). So ``deploy run`` records, as
soon as the SuperLink has accepted a run, the run's output directory and the command that resumes
it, in ``<runs dir>/.deploy-runs/RUN_ID.json`` (``--runs-dir``, default ``$FEDMETA_RUNS_DIR``),
and ``fedmeta deploy status`` reads it back:

* a run Flower lists as running whose output directory no process holds any more (its ServerApp
  held ``<out>/.fedmeta.lock`` since after the run started, and the kernel released it when that
  process ended: server/fedmeta/server/rundir.py) is *interrupted*;
* so is a run Flower lists as failed or stopped that left a checkpoint and no finished summary.

Each interrupted run is shown with the command that resumes it. Reads only, except the record.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

RECORDS = ".deploy-runs"
LOCK_NAME = ".fedmeta.lock"  # server/fedmeta/server/rundir.py (not imported: no server here)
INTERRUPTED = "interrupted"


def records_dir(runs_dir: str | Path) -> Path:
    """Where the records of the runs submitted from here live."""
    return Path(runs_dir) / RECORDS


def remember(runs_dir: str | Path, run_id: str, out: str, resume: str) -> Path | None:
    """Record a submitted run (its output directory and resume command); None if unwritable.

    A record that cannot be written costs only ``deploy status``'s resume hint: never the run.
    """
    path = records_dir(runs_dir) / f"{run_id}.json"
    record = {"run_id": run_id, "out": out, "resume": resume, "submitted": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError:
        return None
    return path


def recall(runs_dir: str | Path | None, run_id: str) -> dict[str, Any] | None:
    """The record of ``run_id``, if this host has one."""
    if runs_dir is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((records_dir(runs_dir) / f"{run_id}.json").read_text())
        if isinstance(record, dict) and isinstance(record.get("out"), str):
            return record
    return None


def _held(lock: Path) -> bool | None:
    """Whether a process holds ``lock`` (an flock); None if it cannot be told here.

    Tested with a shared, non-blocking lock taken and dropped at once: it fails only while a
    run holds the exclusive one. Works across containers that share the volume (one kernel).
    """
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _epoch(text: Any) -> float | None:
    """Flower's ``2026-11-27 21:30:00Z``-style time as Unix seconds; None if absent."""
    with contextlib.suppress(TypeError, ValueError):
        return datetime.fromisoformat(str(text).replace(" ", "T")).timestamp()
    return None


def _finished_summary(out: Path) -> bool:
    """``summary.json`` of a run that ended by itself (not stopped half-way)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        summary = json.loads((out / "summary.json").read_text())
        return bool(summary["stopped_reason"] != INTERRUPTED)
    return False


def interrupted_because(run: Mapping[str, Any], out: Path) -> str | None:
    """Why the run is interrupted (None: it is not, or this host cannot tell)."""
    status = str(run.get("status", ""))
    if not out.is_dir():
        return None
    if status == "running":
        lock = out / LOCK_NAME
        started = _epoch(run.get("running-at"))
        with contextlib.suppress(OSError, ValueError):
            # When the lock was taken: the file's modification time (its holder writes it then).
            # Its content names the day only, as it stays in a private run's outputs.
            taken = lock.stat().st_mtime
            # Its ServerApp took the lock after the run started, and no process holds it now.
            if _held(lock) is False and (started is None or taken >= started - 5):
                return f"no ServerApp holds {out} any more (Flower still says running)"
        return None
    if _held(out / LOCK_NAME):
        return None  # a resumed run continues it now
    resumable = (out / "checkpoint.pt").is_file() and not _finished_summary(out)
    if status.startswith("finished:") and status != "finished:completed" and resumable:
        return f"Flower: {status}; {out} holds a checkpoint"
    if status == "finished:completed" and resumable:
        return f"stopped before its end; {out} holds a checkpoint"
    return None


def annotate(runs: list[dict[str, Any]], runs_dir: str | Path | None) -> list[dict[str, Any]]:
    """``runs`` (``flwr ls``), each with ``fedmeta``: its record and, if interrupted, why."""
    out = []
    for run in runs:
        record = recall(runs_dir, str(run.get("run-id", "")))
        if record is None:
            out.append(run)
            continue
        why = interrupted_because(run, Path(record["out"]))
        state = INTERRUPTED if why else str(run.get("status", ""))
        ours = {"state": state, "why": why, "out": record["out"],
                "resume": record.get("resume") if why else None}  # fmt: skip
        out.append({**run, "fedmeta": ours})
    return out
