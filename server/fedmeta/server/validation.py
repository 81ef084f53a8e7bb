"""Validation of participants' replies before anything is aggregated: one rule for both formats.

Two kinds of problems, treated differently on purpose:

* **Structural** problems do not depend on private data values: a reply for another run, round or
  participant, a task id that was not requested or appears twice, an array of the wrong shape (the
  transport already refused error replies, timeouts and messages that do not decode). The whole
  reply is dropped and counted under its reason (:data:`REASONS`).
* **Value** problems depend on the data: a non-finite value, a contribution over the clip bound C.
  Dropping the whole reply for one of them would let one task's *values* decide whether its
  siblings are counted (a sensitivity above C). Instead the offending part is neutralised and
  counted: a non-finite row contributes zero, an over-norm row is re-clipped to C with the
  workload's own clipping function (:func:`metalearning.clip_by_global_norm`), so every accepted
  task contributes at most C, which is what the accountant assumes.

``per_task`` replies carry every task's clipped gradient, so both rules apply row by row. A
``sum_and_norms`` reply carries only the sum and the post-clip norms the participant reports. The
server checks and enforces what it can: a reported norm over C counts as a violation and is taken
as C; the sum is scaled down, if needed, to ``sum_i min(norm_i, C)``, the largest norm a sum of
such rows can have; a non-finite sum contributes zero. It cannot check any single task's
contribution, so in that format the per-task bound rests on the participant's own clipping (see
docs/federation.md: use ``per_task`` unless bandwidth matters).

At sample level (``Expectation.example_rows``; docs/privacy.md, "Running at sample level") no
task is requested: a reply's rows are its query examples' clipped gradients, numbered ``0 ..
n-1`` (anything else is structural, ``unrequested_task``), and each row is re-checked against C
(the outer clip ``C_out``) exactly as a task's row.

With adaptive clipping a reply must carry one ``clip_bits`` entry per task (the protocol already
refused any value but 0 or 1); a missing or mis-sized list is structural (``bad_shape``). The server
cannot check a bit against the pre-clip norm it never sees, and does not need to: any 0/1 value
keeps the count's sensitivity at 1/2 per task, which is all the accounting assumes
(accounting/fedmeta/accounting/adaptive.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from fedmeta.metalearning import clip_by_global_norm
from fedmeta.protocol import GradientReply, ReplyFormat
from fedmeta.server.recheck import fused_row_sum

REASON_WRONG_RUN = "wrong_run"
REASON_WRONG_ROUND = "wrong_round"
REASON_WRONG_PARTICIPANT = "wrong_participant"
REASON_UNREQUESTED_TASK = "unrequested_task"
REASON_DUPLICATE_TASK = "duplicate_task"
REASON_BAD_SHAPE = "bad_shape"
REASON_WRONG_FORMAT = "wrong_format"

#: Every reason this module rejects a reply for (the transport adds its own, see server/transport).
REASONS = (
    REASON_WRONG_RUN, REASON_WRONG_ROUND, REASON_WRONG_PARTICIPANT, REASON_UNREQUESTED_TASK,
    REASON_DUPLICATE_TASK, REASON_BAD_SHAPE, REASON_WRONG_FORMAT,
)  # fmt: skip


@dataclass(frozen=True)
class Expectation:
    """What the server asked one participant for in one round."""

    run_id: str
    round_id: int
    participant_id: str
    task_ids: tuple[int, ...]
    dim: int
    clip: float | None  # None: a non-private run, nothing is clipped
    reply_format: ReplyFormat
    tolerance: float = 1e-4  # relative slack before a norm counts as a violation
    clip_bits: bool = False  # adaptive clipping: the reply must carry one bit per task
    #: Sample level: no task ids were requested; the reply's rows are its query examples' clipped
    #: gradients, ids ``0 .. n-1`` in order, each re-checked against C (``C_out``) as a task's row.
    example_rows: bool = False


@dataclass(frozen=True)
class Accepted:
    """A valid reply, reduced to what aggregation and the diagnostics need."""

    participant_id: str
    n_tasks: int
    grad_sum: Tensor  # float64 [dim]; each task contributes at most C
    norm_violations: int = 0  # contributions over C (beyond tolerance), re-clipped
    nonfinite: int = 0  # rows (or sums) replaced by zero
    post_clip_norms: tuple[float, ...] = ()  # private diagnostic, never exported raw
    compute_seconds: float | None = None  # private diagnostic
    under_clip: int = 0  # tasks whose reported bit is 1 (adaptive clipping; released only noised)


@dataclass(frozen=True)
class Rejected:
    """A dropped reply and why."""

    participant_id: str
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


def _payload(reply: GradientReply, exp: Expectation) -> Rejected | None:
    """Sizes and dtypes, checked in O(1) before any set or array is built from the reply.

    A reply cannot name more tasks than were requested without repeating or adding one, and only
    real floating-point arrays are gradients (an integer, boolean, complex, object or text array
    is malformed whatever its values): so an oversized or ill-typed payload is dropped with
    bounded memory, never converted.
    """
    pid = exp.participant_id
    if exp.example_rows:
        if any(i != j for i, j in enumerate(reply.task_ids)):  # no copy of the ids
            return Rejected(pid, REASON_UNREQUESTED_TASK, "example rows not numbered 0 .. n-1")
    elif len(reply.task_ids) > len(exp.task_ids):
        detail = f"{len(reply.task_ids)} task ids for {len(exp.task_ids)} requested"
        return Rejected(pid, REASON_UNREQUESTED_TASK, detail)
    for name in ("grads", "grad_sum"):
        array = getattr(reply, name)
        if array is not None and not _floating(array):
            got = array.dtype if isinstance(array, np.ndarray | Tensor) else type(array).__name__
            return Rejected(pid, REASON_BAD_SHAPE, f"{name} of {got}, expected floating point")
    return None


def _floating(array: object) -> bool:
    """A real floating-point array, or (the in-process grid's device lane) tensor."""
    if isinstance(array, Tensor):
        return array.is_floating_point()
    return isinstance(array, np.ndarray) and array.dtype.kind == "f"


def _structure(reply: GradientReply, exp: Expectation) -> Rejected | None:
    pid = exp.participant_id
    early = _payload(reply, exp)
    if early is not None:
        return early
    checks = (
        (reply.run_id != exp.run_id, REASON_WRONG_RUN, f"run {reply.run_id!r}"),
        (reply.round_id != exp.round_id, REASON_WRONG_ROUND, f"round {reply.round_id}"),
        (reply.participant_id != pid, REASON_WRONG_PARTICIPANT, f"from {reply.participant_id!r}"),
        (len(set(reply.task_ids)) != len(reply.task_ids), REASON_DUPLICATE_TASK, "repeated id"),
        (not exp.example_rows and bool(set(reply.task_ids) - set(exp.task_ids)),
         REASON_UNREQUESTED_TASK, "not requested"),
        (reply.reply_format != exp.reply_format, REASON_WRONG_FORMAT, reply.reply_format),
    )
    for failed, reason, detail in checks:
        if failed:
            return Rejected(pid, reason, detail)
    n = len(reply.task_ids)
    if reply.grads is not None and reply.grads.shape != (n, exp.dim):
        return Rejected(
            pid, REASON_BAD_SHAPE, f"grads {reply.grads.shape}, expected {(n, exp.dim)}"
        )
    if reply.grad_sum is not None and reply.grad_sum.shape != (exp.dim,):
        return Rejected(pid, REASON_BAD_SHAPE, f"grad_sum {reply.grad_sum.shape}")
    if reply.task_norms is not None and len(reply.task_norms) != n:
        return Rejected(pid, REASON_BAD_SHAPE, f"{len(reply.task_norms)} norms for {n} tasks")
    if exp.clip_bits and (reply.clip_bits is None or len(reply.clip_bits) != n):
        got = "none" if reply.clip_bits is None else str(len(reply.clip_bits))
        return Rejected(pid, REASON_BAD_SHAPE, f"{got} clip bits for {n} tasks")
    return None


def _under_clip(reply: GradientReply, exp: Expectation) -> int:
    return sum(reply.clip_bits) if exp.clip_bits and reply.clip_bits is not None else 0


# The unfused re-check, kept as the reference the fused one (server/fedmeta/server/recheck.py,
# which validation uses) is tested against, and for bench/server_validation.py. Rows are re-checked
# in float64 a few at a time: the float64 copy of a block (4 rows of the Omniglot net's 113k
# parameters: 3.6 MB) stays in cache, where the whole reply converted at once (80 rows: 72 MB;
# 1.45 GB a round at DP-MAML's lot of 1,600) streams through memory in each of the check's passes:
# 3.4x faster on one or two threads of a quiet 2-core machine (bench/server_validation.py,
# docs/benchmarks.md). Every row's norm, clip and post-clip norm are bit for bit what one block
# gives; the sum differs only by the order of float64 additions.
ROWS_PER_BLOCK = 4


def clipped_row_sum(
    grads: np.ndarray, clip: float, rows_per_block: int = ROWS_PER_BLOCK
) -> tuple[Tensor, Tensor, Tensor, int]:
    """(sum of the rows clipped to ``clip``, pre-clip norms, post-clip norms, non-finite rows).

    ``grads`` is ``[n, dim]`` floating point (float32 from the wire); each row is clipped in
    float64 by :func:`~metalearning.clip_by_global_norm` (a non-finite row counts and contributes
    zero).
    """
    rows = np.asarray(grads)
    if rows.dtype.itemsize > 8 or not rows.dtype.isnative:
        rows = rows.astype(np.float64)  # torch takes neither long double nor a foreign byte order
    data = torch.from_numpy(rows)
    total = torch.zeros(data.shape[1], dtype=torch.float64)
    norms: list[Tensor] = []
    post: list[Tensor] = []
    nonfinite = 0
    for block in torch.split(data, max(1, rows_per_block)):
        g = block.to(torch.float64)
        clipped, pre = clip_by_global_norm(g, clip, nonfinite="zero")
        unbounded = ~torch.isfinite(pre)  # a NaN or infinite entry, or (float64) an overflow
        if bool(unbounded.any()):
            nonfinite += int((~torch.isfinite(g[unbounded]).all(dim=1)).sum())
        total += clipped.sum(0)
        norms.append(pre)
        post.append(torch.linalg.vector_norm(clipped, dim=1))
    empty = torch.zeros(0, dtype=torch.float64)
    pre_norms = torch.cat(norms) if norms else empty
    return total, pre_norms, torch.cat(post) if post else empty, nonfinite


def _per_task(reply: GradientReply, exp: Expectation) -> Accepted:
    assert reply.grads is not None
    clip = math.inf if exp.clip is None else exp.clip
    # The fused check (server/fedmeta/server/recheck.py): the same norms and bound as
    # clipped_row_sum, each row read from memory once.
    total, norms, post, nonfinite = fused_row_sum(reply.grads, clip)
    over = (norms > clip * (1 + exp.tolerance)) & torch.isfinite(norms)
    return Accepted(
        exp.participant_id,
        len(reply.task_ids),
        total.cpu(),  # rows checked on a GPU: their sum, one vector, is what reaches the host
        norm_violations=int(over.sum()),
        nonfinite=nonfinite,
        post_clip_norms=tuple(post.tolist()),
        compute_seconds=reply.compute_seconds,
        under_clip=_under_clip(reply, exp),
    )


def _sum_and_norms(reply: GradientReply, exp: Expectation) -> Accepted:
    assert reply.grad_sum is not None and reply.task_norms is not None
    clip = math.inf if exp.clip is None else exp.clip
    norms = [x if math.isfinite(x) and x >= 0 else clip for x in reply.task_norms]
    violations = sum(1 for x in norms if x > clip * (1 + exp.tolerance))
    bound = sum(min(x, clip) for x in norms)
    s = torch.from_numpy(np.asarray(reply.grad_sum, dtype=np.float64))
    nonfinite = 0 if bool(torch.isfinite(s).all()) else 1
    if nonfinite:
        s = torch.zeros_like(s)
    total = float(torch.linalg.vector_norm(s))
    if total > bound:
        # The largest norm honest rows could sum to; beyond it the reply is inconsistent.
        violations += 0 if total <= bound * (1 + exp.tolerance) else 1
        s = s * (bound / total) if bound > 0 else torch.zeros_like(s)
    return Accepted(
        exp.participant_id,
        len(reply.task_ids),
        s,
        norm_violations=violations,
        nonfinite=nonfinite,
        post_clip_norms=tuple(min(x, clip) for x in norms),
        compute_seconds=reply.compute_seconds,
        under_clip=_under_clip(reply, exp),
    )


def validate_reply(reply: GradientReply, exp: Expectation) -> Accepted | Rejected:
    """Validate one decoded reply against what was requested (see the module docstring)."""
    problem = _structure(reply, exp)
    if problem is not None:
        return problem
    if reply.grads is not None:
        return _per_task(reply, exp)
    return _sum_and_norms(reply, exp)


def validate_round(
    replies: Mapping[str, GradientReply], expectations: Mapping[str, Expectation]
) -> RoundReplies:
    """Validate the decoded replies of a round, keyed by participant id."""
    out = RoundReplies()
    for pid, reply in replies.items():
        result = validate_reply(reply, expectations[pid])
        if isinstance(result, Rejected):
            out.rejected.append(result)
        else:
            out.accepted.append(result)
    return out
