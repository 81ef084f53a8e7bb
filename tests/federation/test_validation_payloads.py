"""Reply validation, table-driven: oversized payloads, dtypes, shapes, NaN/Inf (issue 21).

Beside tests/federation/test_validation.py. Structural problems (sizes, shapes, dtypes) drop the
reply, in bounded memory: nothing the reply claims is converted or expanded before it is checked.
Value problems (NaN, Inf, norms over C) are neutralised and counted, never a reason to drop.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch

from fedmeta.protocol import REPLY_SUM_AND_NORMS, GradientReply
from fedmeta.server import validation as V

from .test_validation import DIM, _exp, _reply

pytestmark = pytest.mark.unit

TASKS = (1, 4, 9)


def _sum(grad_sum: Any, norms: tuple[float, ...] = (0.1, 0.1, 0.1)) -> GradientReply:
    return GradientReply("run", 3, "p", TASKS, None, grad_sum, norms, None)


SUM = {"reply_format": REPLY_SUM_AND_NORMS}

# (name, reply, expectation changes, the reason it is dropped)
DROPPED: list[tuple[str, GradientReply, dict[str, Any], str]] = [
    ("int32 grads", _reply(np.ones((3, DIM), np.int32)), {}, V.REASON_BAD_SHAPE),
    ("int64 grads", _reply(np.ones((3, DIM), np.int64)), {}, V.REASON_BAD_SHAPE),
    ("uint8 grads", _reply(np.ones((3, DIM), np.uint8)), {}, V.REASON_BAD_SHAPE),
    ("bool grads", _reply(np.ones((3, DIM), np.bool_)), {}, V.REASON_BAD_SHAPE),
    ("complex grads", _reply(np.ones((3, DIM), np.complex64)), {}, V.REASON_BAD_SHAPE),
    ("object grads", _reply(np.ones((3, DIM)).astype(object)), {}, V.REASON_BAD_SHAPE),
    ("text grads", _reply(np.full((3, DIM), "1.0")), {}, V.REASON_BAD_SHAPE),
    ("a list, not an array", _reply([[0.1] * DIM] * 3), {}, V.REASON_BAD_SHAPE),
    ("int sum", _sum(np.ones(DIM, np.int32)), SUM, V.REASON_BAD_SHAPE),
    ("complex sum", _sum(np.ones(DIM, np.complex128)), SUM, V.REASON_BAD_SHAPE),
    ("one row too many", _reply(np.zeros((4, DIM), np.float32)), {}, V.REASON_BAD_SHAPE),
    ("one row too few", _reply(np.zeros((2, DIM), np.float32)), {}, V.REASON_BAD_SHAPE),
    ("too wide", _reply(np.zeros((3, DIM + 1), np.float32)), {}, V.REASON_BAD_SHAPE),
    ("transposed", _reply(np.zeros((DIM, 3), np.float32)), {}, V.REASON_BAD_SHAPE),
    ("flat", _reply(np.zeros(3 * DIM, np.float32)), {}, V.REASON_BAD_SHAPE),
    ("3-d", _reply(np.zeros((3, DIM, 1), np.float32)), {}, V.REASON_BAD_SHAPE),
    ("sum too long", _sum(np.zeros(DIM + 1, np.float32)), SUM, V.REASON_BAD_SHAPE),
    ("sum 2-d", _sum(np.zeros((1, DIM), np.float32)), SUM, V.REASON_BAD_SHAPE),
    (
        "norms for 2 of 3 tasks",
        _sum(np.zeros(DIM, np.float32), (0.1, 0.1)),
        SUM,
        V.REASON_BAD_SHAPE,
    ),  # fmt: skip
    # Oversized: views whose data would take gigabytes; a check that converted them would die.
    (
        "a billion columns",
        _reply(np.broadcast_to(np.float32(0), (3, 10**9))),
        {},
        V.REASON_BAD_SHAPE,
    ),  # fmt: skip
    (
        "a billion rows",
        _reply(np.broadcast_to(np.float32(0), (10**9, DIM))),
        {},
        V.REASON_BAD_SHAPE,
    ),  # fmt: skip
    (
        "a billion-long sum",
        _sum(np.broadcast_to(np.float32(0), (10**9,))),
        SUM,
        V.REASON_BAD_SHAPE,
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    ("name", "reply", "change", "reason"), DROPPED, ids=[d[0] for d in DROPPED]
)
def test_structural_problems_drop_the_reply(
    name: str, reply: GradientReply, change: dict[str, Any], reason: str
) -> None:
    out = V.validate_reply(reply, _exp(**change))
    assert isinstance(out, V.Rejected) and out.reason == reason, (name, out)


def test_more_task_ids_than_requested_are_refused_before_any_set_is_built() -> None:
    many = tuple(range(1_000_000))
    reply = _reply(np.zeros((len(many), DIM), np.float32)[:0], task_ids=many)
    tracemalloc.start()
    try:
        out = V.validate_reply(reply, _exp())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(out, V.Rejected) and out.reason == V.REASON_UNREQUESTED_TASK
    assert peak < 1 << 20, peak  # a set of a million ids would take tens of MB


# (name, rows, expected: non-finite rows zeroed, norm violations counted)
NEUTRALISED = [
    ("NaN in one row", [[np.nan] + [0.1] * (DIM - 1), [0.1] * DIM, [0.1] * DIM], 1, 0),
    ("+Inf in one row", [[np.inf] + [0.1] * (DIM - 1), [0.1] * DIM, [0.1] * DIM], 1, 0),
    ("-Inf everywhere", [[-np.inf] * DIM] * 3, 3, 0),
    ("huge finite row", [[1e30] * DIM, [0.1] * DIM, [0.1] * DIM], 0, 1),
    ("float32 max", [[np.finfo(np.float32).max] * DIM] + [[0.0] * DIM] * 2, 0, 1),
    ("subnormal", [[1e-40] * DIM] * 3, 0, 0),
]


@pytest.mark.parametrize(
    ("name", "rows", "nonfinite", "violations"), NEUTRALISED, ids=[n[0] for n in NEUTRALISED]
)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_value_problems_are_neutralised_and_each_task_stays_within_c(
    name: str, rows: list[list[float]], nonfinite: int, violations: int, dtype: Any
) -> None:
    with np.errstate(over="ignore"):
        grads = np.asarray(rows, dtype=np.float64).astype(dtype)
    out = V.validate_reply(_reply(grads), _exp(clip=1.0))
    assert isinstance(out, V.Accepted) and out.n_tasks == 3, name
    assert bool(torch.isfinite(out.grad_sum).all())
    assert float(torch.linalg.vector_norm(out.grad_sum)) <= 3 * (1 + 1e-9)
    expected_nonfinite = (
        nonfinite if dtype != np.float16 else int((~np.isfinite(grads)).any(axis=1).sum())
    )  # float16 overflows 1e30 and float32 max to Inf: then the row is non-finite instead
    assert out.nonfinite == expected_nonfinite
    assert out.norm_violations + out.nonfinite == violations + nonfinite or dtype == np.float16


@pytest.mark.parametrize(
    ("grad_sum", "nonfinite"),
    [(np.full(DIM, np.nan, np.float32), 1), (np.full(DIM, np.inf, np.float64), 1),
     (np.full(DIM, 1e30, np.float32), 0), (np.zeros(DIM, np.float16), 0)],
)  # fmt: skip
def test_a_sum_reply_is_neutralised_the_same_way(grad_sum: np.ndarray, nonfinite: int) -> None:
    out = V.validate_reply(_sum(grad_sum), _exp(**SUM))
    assert isinstance(out, V.Accepted) and out.nonfinite == nonfinite
    # The sum is at most the sum of the reported (capped) norms: 3 x 0.1.
    assert float(torch.linalg.vector_norm(out.grad_sum)) <= 0.3 * (1 + 1e-6)
