"""Will one round fit in memory? Refuse, before anything starts, a configuration whose round cannot.

A round holds, at once, what it sends and what comes back: every sampled participant's request
(the meta-parameters and its task ids) and every reply (one gradient per task with
``federation.reply_format = "per_task"``, one sum otherwise), plus the sampler's per-participant
draw (streamed in chunks: ``accounting/fedmeta/accounting/randomness.py``). Nothing else grows with
the number of
participants or tasks, so this estimate, from public configuration only, bounds a round's memory.
``fedmeta simulate --set federation.participants=100000 --set
dataset.tasks_per_participant=10000000 --set rounds=1`` once grew to 24 GB and was killed by the
kernel; it is now refused in one line with the number it would need.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from fedmeta.config import Config, ConfigError

#: Bytes a sampled task id costs the server: a Python int in a list (28 + 8) and its encoding (8).
TASK_ID_BYTES = 44
#: float32 parameters and gradients on the wire; float64 sums on the server.
WIRE_FLOAT_BYTES = 4
SUM_FLOAT_BYTES = 8
#: A margin for what a round allocates besides its messages (the model's work space, evaluation).
#: What the process already holds (interpreter, torch) is not counted: the available memory is
#: measured with it in use.
MARGIN_BYTES = 256 << 20


@dataclass(frozen=True)
class RoundMemory:
    """The expected size of one round, by part (bytes)."""

    expected_tasks: float
    requests: float
    task_ids: float
    replies: float
    sampler: float

    @property
    def total(self) -> float:
        """Everything a round holds at once, plus the margin."""
        return self.requests + self.task_ids + self.replies + self.sampler + MARGIN_BYTES


def round_memory(cfg: Config, dim: int) -> RoundMemory:
    """One round's expected memory for ``dim`` meta-parameters (public configuration only)."""
    n1 = cfg.n1
    per_participant = cfg.dataset.tasks_per_participant
    if cfg.sampling.stage2 == "fixed":
        tasks = float(n1 * (cfg.sampling.tasks_per_round or 0))
    else:
        tasks = n1 * per_participant * cfg.sampling.task_rate
    if cfg.federation.reply_format == "per_task":
        replies = tasks * dim * WIRE_FLOAT_BYTES + n1 * dim * SUM_FLOAT_BYTES
    else:
        replies = n1 * dim * (WIRE_FLOAT_BYTES + SUM_FLOAT_BYTES) + tasks * SUM_FLOAT_BYTES
    return RoundMemory(
        expected_tasks=tasks,
        requests=float(n1 * dim * WIRE_FLOAT_BYTES * 2),  # the array and its encoding
        task_ids=tasks * TASK_ID_BYTES,
        replies=float(replies),
        sampler=float(per_participant),  # one participant's inclusion flags at a time
    )


def available_bytes() -> float:
    """Memory this process may still use: free memory, and the address-space limit if one is set."""
    limits = [_meminfo_available()]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(float(soft) - _virtual_size())
    return max(0.0, min(limits))


def _proc_bytes(path: str, field: str) -> float | None:
    """A ``field:  N kB`` line of a /proc file, in bytes; None where it cannot be read."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _meminfo_available() -> float:
    found = _proc_bytes("/proc/meminfo", "MemAvailable")
    if found is not None:
        return found
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _virtual_size() -> float:
    return _proc_bytes("/proc/self/status", "VmSize") or 0.0


def _gb(value: float) -> str:
    return f"{value / 1e9:.3g} GB"


def check_round_fits(cfg: Config, dim: int, available: float | None = None) -> RoundMemory:
    """Raise ``ConfigError`` (one line, the number it would need) unless a round fits in memory."""
    need = round_memory(cfg, dim)
    have = available_bytes() if available is None else available
    if need.total > have:
        raise ConfigError(
            f"one round would need about {_gb(need.total)} of memory ({need.expected_tasks:.3g} "
            f"tasks expected from {cfg.n1} participants: task lists {_gb(need.task_ids)}, replies "
            f"{_gb(need.replies)}, requests {_gb(need.requests)}) but {_gb(have)} is available; "
            "lower sampling.participants_per_round, sampling.task_rate or "
            'dataset.tasks_per_participant (or use federation.reply_format = "sum_and_norms")'
        )
    return need
