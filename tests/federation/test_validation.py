"""Every kind of malformed reply is dropped (structural) or neutralised (values), with a reason."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fedmeta import protocol as P
from server import validation as V
from server.round import _ensure_task_identity

pytestmark = pytest.mark.unit

DIM = 6
NODE = 7


def _request() -> Message:
    _ensure_task_identity()
    msg = Message(RecordDict(), NODE, P.MSG_TRAIN, group_id="3")
    msg.metadata.__dict__["_message_id"] = "m1"
    return msg


def _exp(**kw: object) -> V.Expectation:
    base: dict[str, object] = dict(
        run_id="run", round_id=3, participant_id="p", task_ids=(1, 4, 9), dim=DIM, clip=1.0
    )
    base.update(kw)
    return V.Expectation(**base)  # type: ignore[arg-type]


def _reply(
    grads: np.ndarray | None = None,
    *,
    run_id: str = "run",
    round_id: object = 3,
    pid: str = "p",
    task_ids: object = (1, 4, 9),
    drop: str | None = None,
    key: str = P.GRADS_ARRAY,
    extra_meta: dict[str, object] | None = None,
) -> Message:
    if grads is None:
        grads = np.full((3, DIM), 0.1, dtype=np.float32)
    meta: dict[str, object] = {
        P.RUN_ID: run_id, P.ROUND_ID: round_id, P.PARTICIPANT_ID: pid,
        P.TASK_IDS: list(task_ids),  # type: ignore[call-overload]
    }  # fmt: skip
    meta.update(extra_meta or {})
    if drop:
        meta.pop(drop, None)
    content = RecordDict(
        {
            P.GRADS: ArrayRecord({key: Array(grads)}),
            P.REPLY: ConfigRecord(meta),  # type: ignore[arg-type]
            P.REPLY_METRICS: MetricRecord({P.COMPUTE_SECONDS: 0.5}),
        }
    )
    return Message(content, reply_to=_request())


def test_valid_reply_is_accepted_and_summed() -> None:
    out = V.validate_reply(_reply(), _exp())
    assert isinstance(out, V.Accepted)
    assert out.task_ids == (1, 4, 9)
    assert out.grad_sum.shape == (DIM,)
    assert float(out.grad_sum[0]) == pytest.approx(0.3, rel=1e-6)
    assert out.norm_violations == 0 and out.compute_seconds == 0.5


def test_subset_of_requested_tasks_is_accepted() -> None:
    out = V.validate_reply(_reply(np.zeros((1, DIM), np.float32), task_ids=(4,)), _exp())
    assert isinstance(out, V.Accepted) and out.n_tasks == 1


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"run_id": "other"}, V.REASON_WRONG_RUN),
        ({"round_id": 2}, V.REASON_WRONG_ROUND),
        ({"round_id": "3"}, V.REASON_WRONG_ROUND),
        ({"pid": "q"}, V.REASON_WRONG_PARTICIPANT),
        ({"task_ids": (1, 4, 5)}, V.REASON_UNREQUESTED_TASK),
        ({"task_ids": (1, 4, 4)}, V.REASON_DUPLICATE_TASK),
        ({"drop": P.TASK_IDS}, V.REASON_MISSING_RECORD),
        ({"drop": P.RUN_ID}, V.REASON_MISSING_RECORD),
        ({"key": "wrong"}, V.REASON_MISSING_RECORD),
        ({"task_ids": ("1", "4", "9")}, V.REASON_BAD_DTYPE),
    ],
)
def test_structural_problems_drop_the_reply(kwargs: dict[str, object], reason: str) -> None:
    out = V.validate_reply(_reply(**kwargs), _exp())  # type: ignore[arg-type]
    assert isinstance(out, V.Rejected), out
    assert out.reason == reason


def test_wrong_shape_and_dtype() -> None:
    bad_shape = V.validate_reply(_reply(np.zeros((3, DIM + 1), np.float32)), _exp())
    assert isinstance(bad_shape, V.Rejected) and bad_shape.reason == V.REASON_BAD_SHAPE
    bad_rows = V.validate_reply(_reply(np.zeros((2, DIM), np.float32)), _exp())
    assert isinstance(bad_rows, V.Rejected) and bad_rows.reason == V.REASON_BAD_SHAPE
    bad_dtype = V.validate_reply(_reply(np.zeros((3, DIM), np.float64)), _exp())
    assert isinstance(bad_dtype, V.Rejected) and bad_dtype.reason == V.REASON_BAD_DTYPE
    ints = V.validate_reply(_reply(np.zeros((3, DIM), np.int32)), _exp())
    assert isinstance(ints, V.Rejected) and ints.reason == V.REASON_BAD_DTYPE


def test_missing_records_and_error_reply() -> None:
    empty = Message(RecordDict(), reply_to=_request())
    out = V.validate_reply(empty, _exp())
    assert isinstance(out, V.Rejected) and out.reason == V.REASON_MISSING_RECORD
    err = Message(Error(code=3, reason="boom"), reply_to=_request())
    out = V.validate_reply(err, _exp())
    assert isinstance(out, V.Rejected) and out.reason == V.REASON_ERROR_REPLY


def test_nonfinite_rows_are_zeroed_not_dropped() -> None:
    g = np.full((3, DIM), 0.1, dtype=np.float32)
    g[1, 2] = np.nan
    g[2, 0] = np.inf
    out = V.validate_reply(_reply(g), _exp())
    assert isinstance(out, V.Accepted)
    assert out.nonfinite_rows == 2
    assert float(out.grad_sum[0]) == pytest.approx(0.1, rel=1e-6)
    assert bool(np.isfinite(out.grad_sum.numpy()).all())


def test_over_norm_rows_are_reclipped_and_counted() -> None:
    g = np.zeros((3, DIM), dtype=np.float32)
    g[0, 0] = 5.0  # way over C = 1: a violation
    g[1, 1] = 1.0 + 1e-6  # rounding-level: re-clipped, not a violation
    g[2, 2] = 0.5
    out = V.validate_reply(_reply(g), _exp())
    assert isinstance(out, V.Accepted)
    assert out.norm_violations == 1
    assert max(out.post_clip_norms) <= 1.0
    assert float(out.grad_sum[0]) <= 1.0 and float(out.grad_sum[2]) == pytest.approx(0.5)


def test_non_private_does_not_clip() -> None:
    g = np.zeros((3, DIM), dtype=np.float32)
    g[0, 0] = 5.0
    out = V.validate_reply(_reply(g), _exp(clip=math.inf))
    assert isinstance(out, V.Accepted) and float(out.grad_sum[0]) == pytest.approx(5.0)


def _sum_reply(s: np.ndarray, norms: list[float], task_ids: tuple[int, ...] = (1, 4, 9)) -> Message:
    return _reply(s, key=P.GRAD_SUM, task_ids=task_ids, extra_meta={P.TASK_NORMS: norms})


def test_sum_and_norms_format() -> None:
    exp = _exp(reply_format=P.REPLY_SUM_AND_NORMS)
    s = np.zeros(DIM, np.float32)
    s[0] = 1.5
    ok = V.validate_reply(_sum_reply(s, [1.0, 0.5, 0.2]), exp)
    assert isinstance(ok, V.Accepted) and ok.n_tasks == 3
    over = V.validate_reply(_sum_reply(s, [2.0, 0.5, 0.2]), exp)
    assert isinstance(over, V.Rejected) and over.reason == V.REASON_NORM_BOUND
    inconsistent = V.validate_reply(_sum_reply(s, [0.1, 0.1, 0.1]), exp)
    assert isinstance(inconsistent, V.Rejected) and inconsistent.reason == V.REASON_NORM_BOUND
    missing = V.validate_reply(_sum_reply(s, [0.5]), exp)
    assert isinstance(missing, V.Rejected) and missing.reason == V.REASON_MISSING_RECORD
    s2 = s.copy()
    s2[1] = np.nan
    nonfinite = V.validate_reply(_sum_reply(s2, [1.0, 0.5, 0.2]), exp)
    assert isinstance(nonfinite, V.Rejected) and nonfinite.reason == V.REASON_NONFINITE


def test_round_level_duplicates_unexpected_senders_and_timeouts() -> None:
    good = _reply()
    dup = _reply()
    stranger = _reply()
    stranger.metadata.__dict__["_src_node_id"] = 99
    expectations = {NODE: _exp(), 8: _exp(participant_id="other")}
    out = V.validate_round([good, dup, stranger], expectations)
    reasons = out.rejected_by_reason()
    assert len(out.accepted) == 1
    assert reasons == {
        V.REASON_DUPLICATE_REPLY: 1, V.REASON_UNEXPECTED_SENDER: 1, V.REASON_TIMEOUT: 1
    }  # fmt: skip
