"""Validation of participants' replies before anything is aggregated.

Two kinds of problems, treated differently on purpose:

* **Structural** problems - an error reply, a missing record, the wrong run or round, the wrong
  participant, a task id that was not requested, a duplicate task id, a duplicate reply, the wrong
  shape or dtype. They do not depend on private data values, so the whole reply is dropped, with a
  logged reason (a ``Rejected`` with one of the ``REASON_*`` codes).
* **Value** problems in per-task replies - a non-finite row, a row over the clip bound. Dropping the
  whole reply here would let one task's *values* decide whether its siblings are counted (a
  sensitivity above C). Instead the offending row is neutralised: a non-finite row contributes zero,
  an over-norm row is re-clipped to C; both are counted as violations. Every accepted row has L2
  norm <= C, which is what the accountant assumes.

In the ``sum_and_norms`` reply format the server cannot re-clip individual tasks. It checks that the
reported post-clip norms are <= C (within tolerance), that there is one per task, and that
``||sum|| <= sum(norms)``; anything else drops the reply (so the per-task bound then also relies on
the participant's own clipping: prefer ``per_task`` unless bandwidth matters; see
docs/federation.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Message
from torch import Tensor

from fedmeta import protocol as P

REASON_ERROR_REPLY = "error_reply"
REASON_MISSING_RECORD = "missing_record"
REASON_WRONG_RUN = "wrong_run"
REASON_WRONG_ROUND = "wrong_round"
REASON_WRONG_PARTICIPANT = "wrong_participant"
REASON_UNEXPECTED_SENDER = "unexpected_sender"
REASON_DUPLICATE_REPLY = "duplicate_reply"
REASON_UNREQUESTED_TASK = "unrequested_task"
REASON_DUPLICATE_TASK = "duplicate_task"
REASON_BAD_SHAPE = "bad_shape"
REASON_BAD_DTYPE = "bad_dtype"
REASON_NONFINITE = "nonfinite"
REASON_NORM_BOUND = "norm_bound"
REASON_TIMEOUT = "timeout"

ALL_REASONS = (
    REASON_ERROR_REPLY, REASON_MISSING_RECORD, REASON_WRONG_RUN, REASON_WRONG_ROUND,
    REASON_WRONG_PARTICIPANT, REASON_UNEXPECTED_SENDER, REASON_DUPLICATE_REPLY,
    REASON_UNREQUESTED_TASK, REASON_DUPLICATE_TASK, REASON_BAD_SHAPE, REASON_BAD_DTYPE,
    REASON_NONFINITE, REASON_NORM_BOUND, REASON_TIMEOUT,
)  # fmt: skip


@dataclass(frozen=True)
class Expectation:
    """What the server asked one participant for in one round."""

    run_id: str
    round_id: int
    participant_id: str
    task_ids: tuple[int, ...]
    dim: int
    clip: float  # math.inf in non-private mode
    reply_format: str = P.REPLY_PER_TASK
    tolerance: float = 1e-4


@dataclass(frozen=True)
class Accepted:
    """A valid reply, reduced to what aggregation needs."""

    participant_id: str
    task_ids: tuple[int, ...]
    grad_sum: Tensor  # float64 [dim], sum of rows each with norm <= clip
    norm_violations: int = 0  # rows over C (beyond tolerance) that were re-clipped
    nonfinite_rows: int = 0  # rows replaced by zero
    clipped_rows: int = 0  # rows at the bound (were clipped by the client) - private diagnostic
    post_clip_norms: tuple[float, ...] = ()  # private diagnostic, never exported raw
    compute_seconds: float | None = None

    @property
    def n_tasks(self) -> int:
        """Tasks received in this reply."""
        return len(self.task_ids)


@dataclass(frozen=True)
class Rejected:
    """A dropped reply and why."""

    participant_id: str | None
    reason: str
    detail: str


@dataclass
class RoundReplies:
    """The outcome of validating one round's replies."""

    accepted: list[Accepted] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    def rejected_by_reason(self) -> dict[str, int]:
        """Counts of rejected replies per reason."""
        out: dict[str, int] = {}
        for r in self.rejected:
            out[r.reason] = out.get(r.reason, 0) + 1
        return out


def _reject(pid: str | None, reason: str, detail: str) -> Rejected:
    return Rejected(pid, reason, detail)


def _as_float_array(arr: object, key: str) -> np.ndarray | str:
    try:
        a = arr.numpy()  # type: ignore[attr-defined]
    except Exception as error:  # noqa: BLE001 - any undecodable array is a bad reply
        return f"{key}: cannot decode array ({error})"
    return np.asarray(a)


def validate_reply(message: Message, exp: Expectation) -> Accepted | Rejected:
    """Validate one participant's reply against what was requested (see the module docstring)."""
    pid = exp.participant_id
    if message.has_error():
        err = message.error
        return _reject(pid, REASON_ERROR_REPLY, f"error reply: code {err.code}: {err.reason}")
    content = message.content
    if P.REPLY not in content.config_records or P.GRADS not in content.array_records:
        return _reject(pid, REASON_MISSING_RECORD, f"reply lacks {P.REPLY!r} or {P.GRADS!r}")
    meta = content.config_records[P.REPLY]
    for key in (P.RUN_ID, P.ROUND_ID, P.PARTICIPANT_ID, P.TASK_IDS):
        if key not in meta:
            return _reject(pid, REASON_MISSING_RECORD, f"reply lacks key {key!r}")
    if str(meta[P.RUN_ID]) != exp.run_id:
        return _reject(pid, REASON_WRONG_RUN, f"run {meta[P.RUN_ID]!r}, expected {exp.run_id!r}")
    if not isinstance(meta[P.ROUND_ID], int) or meta[P.ROUND_ID] != exp.round_id:
        return _reject(
            pid, REASON_WRONG_ROUND, f"round {meta[P.ROUND_ID]!r}, expected {exp.round_id}"
        )
    if str(meta[P.PARTICIPANT_ID]) != pid:
        return _reject(
            pid,
            REASON_WRONG_PARTICIPANT,
            f"participant {meta[P.PARTICIPANT_ID]!r}, expected {pid!r}",
        )
    raw_ids = meta[P.TASK_IDS]
    if not isinstance(raw_ids, list) or not all(isinstance(t, int) for t in raw_ids):
        return _reject(pid, REASON_BAD_DTYPE, "task_ids must be a list of int")
    ids = [int(t) for t in raw_ids]
    if len(set(ids)) != len(ids):
        return _reject(pid, REASON_DUPLICATE_TASK, "a task id appears more than once")
    unrequested = set(ids) - set(exp.task_ids)
    if unrequested:
        return _reject(pid, REASON_UNREQUESTED_TASK, f"{len(unrequested)} task id(s) not requested")
    compute = None
    metrics = content.metric_records.get(P.REPLY_METRICS)
    if metrics is not None and P.COMPUTE_SECONDS in metrics:
        value = metrics[P.COMPUTE_SECONDS]
        if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
            compute = float(value)
    arrays = content.array_records[P.GRADS]
    if exp.reply_format == P.REPLY_SUM_AND_NORMS:
        return _validate_sum(pid, ids, arrays, meta, exp, compute)
    return _validate_per_task(pid, ids, arrays, exp, compute)


def _check_array(
    pid: str, arrays: object, key: str, shape: tuple[int, ...]
) -> np.ndarray | Rejected:
    if key not in arrays:  # type: ignore[operator]
        return _reject(pid, REASON_MISSING_RECORD, f"reply lacks array {key!r}")
    arr = arrays[key]  # type: ignore[index]
    if str(getattr(arr, "dtype", None)) != "float32":
        return _reject(
            pid, REASON_BAD_DTYPE, f"{key}: dtype {getattr(arr, 'dtype', None)}, expected float32"
        )
    if tuple(getattr(arr, "shape", ())) != shape:
        return _reject(pid, REASON_BAD_SHAPE, f"{key}: shape {tuple(arr.shape)}, expected {shape}")
    a = _as_float_array(arr, key)
    if isinstance(a, str):
        return _reject(pid, REASON_BAD_DTYPE, a)
    if a.dtype != np.float32 or a.shape != shape:
        return _reject(
            pid, REASON_BAD_SHAPE, f"{key}: decoded {a.dtype} {a.shape}, expected {shape}"
        )
    return a


def _validate_per_task(
    pid: str, ids: list[int], arrays: object, exp: Expectation, compute: float | None
) -> Accepted | Rejected:
    a = _check_array(pid, arrays, P.GRADS_ARRAY, (len(ids), exp.dim))
    if isinstance(a, Rejected):
        return a
    g = torch.from_numpy(np.array(a, dtype=np.float64))
    finite = torch.isfinite(g).all(dim=1)
    nonfinite = int((~finite).sum())
    g = torch.where(finite[:, None], g, torch.zeros_like(g))
    norms = torch.linalg.vector_norm(g, dim=1)
    violations = 0
    clipped_rows = 0
    if math.isfinite(exp.clip):
        c = float(exp.clip)
        violations = int((norms > c * (1 + exp.tolerance)).sum())
        clipped_rows = int((norms >= c * (1 - 1e-5)).sum())
        over = norms > c
        if bool(over.any()):
            scale = torch.where(over, c / norms.clamp_min(1e-300), torch.ones_like(norms))
            g = g * scale[:, None]
            # Guard rounding: never above C.
            renorm = torch.linalg.vector_norm(g, dim=1)
            still = renorm > c
            if bool(still.any()):
                g = torch.where(still[:, None], g * (c / renorm * (1 - 1e-12))[:, None], g)
            norms = torch.linalg.vector_norm(g, dim=1)
    return Accepted(
        pid,
        tuple(ids),
        g.sum(0) if g.shape[0] else torch.zeros(exp.dim, dtype=torch.float64),
        norm_violations=violations,
        nonfinite_rows=nonfinite,
        clipped_rows=clipped_rows,
        post_clip_norms=tuple(float(x) for x in norms),
        compute_seconds=compute,
    )


def _validate_sum(
    pid: str, ids: list[int], arrays: object, meta: object, exp: Expectation, compute: float | None
) -> Accepted | Rejected:
    a = _check_array(pid, arrays, P.GRAD_SUM, (exp.dim,))
    if isinstance(a, Rejected):
        return a
    norms_raw = meta.get(P.TASK_NORMS) if hasattr(meta, "get") else None
    if not isinstance(norms_raw, list) or len(norms_raw) != len(ids):
        return _reject(pid, REASON_MISSING_RECORD, "sum_and_norms reply needs one norm per task id")
    if not all(isinstance(x, int | float) for x in norms_raw):
        return _reject(pid, REASON_BAD_DTYPE, "task_norms must be numbers")
    norms = [float(x) for x in norms_raw]
    s = torch.from_numpy(np.array(a, dtype=np.float64))
    if not bool(torch.isfinite(s).all()) or not all(math.isfinite(x) for x in norms):
        return _reject(pid, REASON_NONFINITE, "non-finite sum or norm")
    c = exp.clip
    if math.isfinite(c) and any(x > c * (1 + exp.tolerance) for x in norms):
        return _reject(pid, REASON_NORM_BOUND, "a reported per-task norm exceeds the clip bound")
    total = float(torch.linalg.vector_norm(s))
    if total > sum(norms) * (1 + exp.tolerance) + 1e-6:
        return _reject(pid, REASON_NORM_BOUND, "||sum|| exceeds the sum of the reported norms")
    if math.isfinite(c) and total > len(ids) * c:
        s = s * (len(ids) * c / total)
    clipped_rows = sum(1 for x in norms if math.isfinite(c) and x >= c * (1 - 1e-5))
    return Accepted(
        pid, tuple(ids), s, clipped_rows=clipped_rows, post_clip_norms=tuple(norms),
        compute_seconds=compute,
    )  # fmt: skip


def validate_round(
    replies: Sequence[Message],
    expectations: dict[int, Expectation],
) -> RoundReplies:
    """Validate all replies of a round; ``expectations`` maps destination node id -> what was asked.

    Replies from nodes that were not asked are dropped (``unexpected_sender``), as is any second
    reply from the same node (``duplicate_reply``). Nodes that never replied are recorded as
    ``timeout``.
    """
    out = RoundReplies()
    seen: set[int] = set()
    for msg in replies:
        node = int(msg.metadata.src_node_id)
        exp = expectations.get(node)
        if exp is None:
            out.rejected.append(
                _reject(None, REASON_UNEXPECTED_SENDER, f"node {node} was not asked")
            )
            continue
        if node in seen:
            out.rejected.append(_reject(exp.participant_id, REASON_DUPLICATE_REPLY, "second reply"))
            continue
        seen.add(node)
        result = validate_reply(msg, exp)
        if isinstance(result, Rejected):
            out.rejected.append(result)
        else:
            out.accepted.append(result)
    for node, exp in expectations.items():
        if node not in seen:
            out.rejected.append(
                _reject(exp.participant_id, REASON_TIMEOUT, "no reply before the timeout")
            )
    return out
