"""Reply validation: structural problems drop a reply, value problems are neutralised and counted.

One rule for both reply formats: a value never decides whether a reply (and so its other tasks)
is counted; every accepted task contributes at most C.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedmeta.protocol import REPLY_PER_TASK, REPLY_SUM_AND_NORMS, GradientReply
from fedmeta.server import validation as V

pytestmark = pytest.mark.unit

DIM = 6


def _exp(**kw: object) -> V.Expectation:
    base: dict[str, object] = dict(
        run_id="run", round_id=3, participant_id="p", task_ids=(1, 4, 9), dim=DIM, clip=1.0,
        reply_format=REPLY_PER_TASK,
    )  # fmt: skip
    base.update(kw)
    return V.Expectation(**base)  # type: ignore[arg-type]


def _reply(rows: np.ndarray | None = None, **kw: object) -> GradientReply:
    grads = np.full((3, DIM), 0.1, dtype=np.float32) if rows is None else rows
    reply = GradientReply("run", 3, "p", (1, 4, 9), grads, None, None, 0.5)
    return replace(reply, **kw)  # type: ignore[arg-type]


def _sum_reply(s: np.ndarray, norms: tuple[float, ...]) -> GradientReply:
    return GradientReply("run", 3, "p", (1, 4, 9), None, s.astype(np.float32), norms, None)


def test_valid_reply_is_accepted_and_summed() -> None:
    out = V.validate_reply(_reply(), _exp())
    assert isinstance(out, V.Accepted) and out.n_tasks == 3 and out.compute_seconds == 0.5
    assert out.grad_sum.shape == (DIM,) and out.grad_sum.dtype == torch.float64
    assert float(out.grad_sum[0]) == pytest.approx(0.3, rel=1e-6)
    assert out.norm_violations == 0 and out.nonfinite == 0


def test_a_subset_of_the_requested_tasks_is_accepted() -> None:
    out = V.validate_reply(_reply(np.zeros((1, DIM), np.float32), task_ids=(4,)), _exp())
    assert isinstance(out, V.Accepted) and out.n_tasks == 1


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"run_id": "other"}, V.REASON_WRONG_RUN),
        ({"round_id": 2}, V.REASON_WRONG_ROUND),
        ({"participant_id": "q"}, V.REASON_WRONG_PARTICIPANT),
        ({"task_ids": (1, 4, 5)}, V.REASON_UNREQUESTED_TASK),
        ({"task_ids": (1, 4, 4)}, V.REASON_DUPLICATE_TASK),
        ({"grads": np.zeros((3, DIM + 1), np.float32)}, V.REASON_BAD_SHAPE),
        ({"grads": np.zeros((2, DIM), np.float32)}, V.REASON_BAD_SHAPE),
        ({"grads": None, "grad_sum": np.zeros(DIM, np.float32), "task_norms": (0.1,) * 3},
         V.REASON_WRONG_FORMAT),
    ],
)  # fmt: skip
def test_structural_problems_drop_the_reply(change: dict[str, object], reason: str) -> None:
    out = V.validate_reply(_reply(**change), _exp())
    assert isinstance(out, V.Rejected) and out.reason == reason, out


def test_nonfinite_rows_are_zeroed_not_dropped() -> None:
    g = np.full((3, DIM), 0.1, dtype=np.float32)
    g[1, 2] = np.nan
    g[2, 0] = np.inf
    out = V.validate_reply(_reply(g), _exp())
    assert isinstance(out, V.Accepted) and out.nonfinite == 2 and out.norm_violations == 0
    assert float(out.grad_sum[0]) == pytest.approx(0.1, rel=1e-6)
    assert bool(torch.isfinite(out.grad_sum).all())


def test_over_norm_rows_are_reclipped_with_the_workloads_clip_and_counted() -> None:
    g = np.zeros((3, DIM), dtype=np.float32)
    g[0, 0] = 5.0  # far over C = 1: a violation
    g[1, 1] = 1.0 + 1e-6  # rounding-level: re-clipped, not a violation
    g[2, 2] = 0.5
    out = V.validate_reply(_reply(g), _exp())
    assert isinstance(out, V.Accepted) and out.norm_violations == 1
    assert max(out.post_clip_norms) <= 1.0
    assert float(out.grad_sum[0]) <= 1.0 and float(out.grad_sum[2]) == pytest.approx(0.5)


def test_a_non_private_run_does_not_clip() -> None:
    g = np.zeros((3, DIM), dtype=np.float32)
    g[0, 0] = 5.0
    out = V.validate_reply(_reply(g), _exp(clip=None))
    assert isinstance(out, V.Accepted) and float(out.grad_sum[0]) == pytest.approx(5.0)


def test_sum_and_norms_follows_the_same_rule() -> None:
    exp = _exp(reply_format=REPLY_SUM_AND_NORMS)
    s = np.zeros(DIM)
    s[0] = 1.5
    ok = V.validate_reply(_sum_reply(s, (1.0, 0.5, 0.2)), exp)
    assert isinstance(ok, V.Accepted) and ok.norm_violations == 0
    assert float(ok.grad_sum[0]) == pytest.approx(1.5, rel=1e-6)
    # A reported norm over C is a violation taken as C; the sum is kept within sum(min(n_i, C)).
    over = V.validate_reply(_sum_reply(s * 4, (4.0, 1.0, 1.0)), exp)
    assert isinstance(over, V.Accepted) and over.norm_violations == 2  # the norm and the sum
    assert float(torch.linalg.vector_norm(over.grad_sum)) == pytest.approx(3.0, rel=1e-9)
    # A sum longer than its rows could add up to is scaled down and counted, not dropped.
    inconsistent = V.validate_reply(_sum_reply(s, (0.1, 0.1, 0.1)), exp)
    assert isinstance(inconsistent, V.Accepted) and inconsistent.norm_violations == 1
    assert float(torch.linalg.vector_norm(inconsistent.grad_sum)) == pytest.approx(0.3)
    nan = s.copy()
    nan[1] = np.nan
    nonfinite = V.validate_reply(_sum_reply(nan, (1.0, 0.5, 0.2)), exp)
    assert isinstance(nonfinite, V.Accepted) and nonfinite.nonfinite == 1
    assert float(torch.linalg.vector_norm(nonfinite.grad_sum)) == 0.0
    wrong_count = V.validate_reply(_sum_reply(s, (0.5,)), exp)
    assert isinstance(wrong_count, V.Rejected) and wrong_count.reason == V.REASON_BAD_SHAPE


def test_accepted_contributions_never_exceed_the_bound_per_task() -> None:
    """Property over random replies: after validation, ||sum|| <= n_tasks * C."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 4))
        g = (rng.standard_normal((n, DIM)) * rng.choice([0.01, 1, 100])).astype(np.float32)
        reply = GradientReply("run", 3, "p", (1, 4, 9)[:n], g, None, None)
        out = V.validate_reply(reply, _exp(clip=0.7))
        assert isinstance(out, V.Accepted)
        assert float(torch.linalg.vector_norm(out.grad_sum)) <= n * 0.7 * (1 + 1e-12)
        assert all(x <= 0.7 for x in out.post_clip_norms)


def test_validate_round_reports_rejections_by_reason() -> None:
    out = V.validate_round(
        {"p": _reply(), "q": _reply(participant_id="q", round_id=9)},
        {"p": _exp(), "q": _exp(participant_id="q")},
    )
    assert len(out.accepted) == 1 and out.rejected_by_reason() == {V.REASON_WRONG_ROUND: 1}
    assert math.isclose(float(out.accepted[0].grad_sum[0]), 0.3, rel_tol=1e-6)


@pytest.mark.parametrize("clip", [0.5, 3.0, math.inf])
@pytest.mark.parametrize("rows_per_block", [1, 3, 8, 64])
def test_blocked_row_check_equals_the_whole_reply_at_once(clip: float, rows_per_block: int) -> None:
    """Checking rows a block at a time (for speed) changes no row's result and the sum by rounding.

    The reference converts the whole reply to float64 and clips it in one call, as the server did
    before blocks; norms and post-clip norms must agree bit for bit, the sum to float64 rounding.
    """
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((21, 257)) * rng.choice([0.01, 1.0, 50.0], (21, 1))).astype(
        np.float32
    )
    rows[4, 9] = np.nan
    rows[13, 0] = np.inf
    rows[17] = 0.0
    total, norms, post, nonfinite = V.clipped_row_sum(rows, clip, rows_per_block)
    whole = torch.from_numpy(rows.astype(np.float64))
    ref_clipped, ref_norms = V.clip_by_global_norm(whole, clip, nonfinite="zero")
    assert nonfinite == 2
    assert torch.equal(norms, ref_norms)
    assert torch.equal(post, torch.linalg.vector_norm(ref_clipped, dim=1))
    tol = 1e-12 * max(1.0, float(ref_clipped.abs().sum(0).max()))
    assert torch.allclose(total, ref_clipped.sum(0), rtol=0, atol=tol)
    if math.isfinite(clip):
        assert float(post.max()) <= clip


def test_a_long_double_or_big_endian_reply_is_checked_like_float64() -> None:
    rows = np.array([[3.0, 4.0], [0.3, 0.4]])
    expected = V.clipped_row_sum(rows, 1.0)
    for odd in (rows.astype(np.longdouble), rows.astype(">f8")):
        total, norms, post, nonfinite = V.clipped_row_sum(odd, 1.0)
        assert torch.equal(total, expected[0]) and torch.equal(norms, expected[1])
        assert torch.equal(post, expected[2]) and nonfinite == 0
